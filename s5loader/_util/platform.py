"""What s5loader needs from the operating system, and the check that it is there: Linux."""

from __future__ import annotations

import ctypes
import sys
from typing import Any

from ..exceptions import PlatformError

NEEDS = (
    "flock on staging directories, /proc/PID/io to tell a stalled s5cmd call from a slow one, "
    "prctl(PR_SET_PDEATHSIG) so that s5cmd dies with its loader, and tmpfs (/dev/shm)"
)


_PRCTL: Any
try:  # resolved here, in the parent: no dlopen between fork and exec in a threaded process
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _PRCTL = None


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
