"""What s5loader needs from the operating system, and the check that it is there: Linux."""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
from typing import Any

from ..exceptions import PlatformError

NEEDS = (
    "flock on staging directories, /proc/PID/io to tell a stalled s5cmd call from a slow one, "
    "prctl(PR_SET_PDEATHSIG) so that s5cmd dies with its loader, and tmpfs (/dev/shm)"
)


_PRCTL: Any
_FALLOCATE: Any
try:  # resolved here, in the parent: no dlopen between fork and exec in a threaded process
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _PRCTL = _LIBC.prctl
    _FALLOCATE = _LIBC.fallocate
    _FALLOCATE.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _PRCTL = _FALLOCATE = None

_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
# The blocks a reader punches and an order counts in: only where the staging directory's file
# system punches blocks this size or smaller (punches_holes), so each is whole blocks there too.
HOLE_BLOCK = 4096


def die_with_parent(sig: int) -> None:  # pragma: no cover - runs in the child between fork and exec
    """Have the kernel send ``sig`` to this process when the thread that started it dies
    (``PR_SET_PDEATHSIG``); for a ``preexec_fn``."""
    if _PRCTL is not None:
        _PRCTL(1, sig)  # PR_SET_PDEATHSIG


def require_linux(what: str) -> None:
    """Fail early and clearly instead of running without stall detection or cleanup.

    Raises:
        PlatformError: not Linux.
    """
    if not sys.platform.startswith("linux"):
        raise PlatformError(f"{what} runs on Linux only: it needs {NEEDS}; this system is {sys.platform!r}")


def punch_hole(fd: int, offset: int, length: int, block: int) -> int:
    """Free the whole ``block``-sized blocks inside ``[offset, offset + length)`` of the file
    open for writing as ``fd`` (``fallocate(FALLOC_FL_PUNCH_HOLE)``: the file keeps its size,
    the range reads as zeros). Returns the bytes of those blocks; 0 where nothing is whole or
    the file system cannot punch holes (tmpfs and ext4 can; :func:`punches_holes` checks)."""
    lo = -(-offset // block) * block
    hi = (offset + length) // block * block
    if hi <= lo or _FALLOCATE is None:
        return 0
    if _FALLOCATE(fd, _PUNCH_HOLE, lo, hi - lo) != 0:
        return 0  # EOPNOTSUPP and the like: the bytes stay, and are counted as held
    return hi - lo


def punches_holes(folder: str, most: int = HOLE_BLOCK) -> bool:
    """Whether the file system of ``folder`` frees the blocks :func:`punch_hole` punches, in
    blocks of at most ``most`` bytes (a probe file, removed at once)."""
    try:
        with tempfile.TemporaryFile(dir=folder) as fh:
            block = os.fstat(fh.fileno()).st_blksize
            if block > most:
                return False
            fh.write(b"\1" * 2 * block)
            fh.flush()
            os.fsync(fh.fileno())
            before = os.fstat(fh.fileno()).st_blocks
            return punch_hole(fh.fileno(), 0, block, block) > 0 and os.fstat(fh.fileno()).st_blocks < before
    except OSError:
        return False
