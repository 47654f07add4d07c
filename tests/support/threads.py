"""Running a call in a thread the test watches: whether it still waits, and what it returned
or raised."""

from __future__ import annotations

import threading
from collections.abc import Callable


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``fn`` in a daemon thread; its result (or the exception it raised) lands in the list."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out
