"""The local folder of a pack: ``ROOT/s5loader-pack-UID/<work>/``, removed at the end, on
errors, KeyboardInterrupt and SIGTERM (its transfers killed first), and ``s5loader-pack-UID``
with it unless another pack works there; the folders of packs that were killed (SIGKILL) are
removed by the next pack that finds their process gone."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator

from .._largeobj.transfer import margin
from .._largeobj.volumes import FetchWork
from .._staging.area import free_bytes
from .._util.uri import format_size
from ..exceptions import StagingSpaceError

log = logging.getLogger(__name__)

PID_FILE = "pid"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(folder: str) -> list[str]:
    """Remove the work folders in ``folder`` whose pack process is gone; returns them."""
    gone = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            with open(os.path.join(path, PID_FILE), encoding="ascii") as f:
                pid = int(f.read().strip() or 0)
        except (OSError, ValueError):
            continue
        if pid and not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone


class _PackWork(FetchWork):
    """A pack's work folder: closing it (at the end, on errors, KeyboardInterrupt, SIGTERM and
    exit) also removes ``s5loader-pack-UID`` where no other pack works."""

    def close(self) -> None:
        super().close()
        if os.getpid() == self._pid:
            try:
                os.rmdir(os.path.dirname(self.path))
            except OSError:  # another pack works there, or it is gone already
                pass


@contextlib.contextmanager
def open_work(root: str, need: int = 0) -> Iterator[FetchWork]:
    """A fresh work folder below ``root``, with room for ``need`` bytes checked first.

    Raises:
        StagingSpaceError: ``root`` has less free space than ``need`` (and a margin).
    """
    folder = os.path.join(root, f"s5loader-pack-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    work = _PackWork(folder)  # before anything else: the folder is not empty, so no other pack removes it
    try:
        with open(os.path.join(work.path, PID_FILE), "w", encoding="ascii") as f:
            f.write(str(os.getpid()))
        for path in clean_stale(folder):
            log.info("removed %s, left by a pack that was killed", path)
        free = free_bytes(folder)
        if need and need + margin(need) > free:
            raise StagingSpaceError(
                f"packing through {folder} needs {format_size(need)} of local disk (the budget, or the "
                f"shards if less); {format_size(free)} free there: pass a smaller budget or another "
                "staging_dir"
            )
        yield work
    finally:
        work.close()
