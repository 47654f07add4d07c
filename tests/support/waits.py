"""Waiting for another thread or process: poll a condition until it holds, with a deadline that
fails the test naming what never came, instead of sleeping a guessed while."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T], timeout: float = 30.0, what: str = "the condition", interval: float = 0.01
) -> T:
    """Call ``condition`` every ``interval`` seconds until it returns a true value, and return
    that value; after ``timeout`` seconds without one, fail naming ``what``. An assertion inside
    ``condition`` (a process that must stay alive meanwhile) fails the wait at once."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}, in vain (last seen: {found!r})")
        time.sleep(interval)


def stays_false(condition: Callable[[], object], seconds: float, what: str, interval: float = 0.01) -> None:
    """Fail as soon as ``condition`` returns a true value (naming ``what`` and the value); pass
    once ``seconds`` have gone by without one. For what must not happen while a test holds
    another party back."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = condition()
        if found:
            raise AssertionError(f"{what}: {found!r}")
        time.sleep(interval)
