"""What s5loader needs from the operating system, and the check that it is there: Linux."""

from __future__ import annotations

import sys

from .exceptions import PlatformError

NEEDS = (
    "flock on staging directories, /proc/PID/io to tell a stalled s5cmd call from a slow one, "
    "prctl(PR_SET_PDEATHSIG) so that s5cmd dies with its loader, and tmpfs (/dev/shm)"
)


def require_linux(what: str) -> None:
    """Fail early and clearly instead of running without stall detection or cleanup.

    Raises:
        PlatformError: not Linux.
    """
    if not sys.platform.startswith("linux"):
        raise PlatformError(f"{what} runs on Linux only: it needs {NEEDS}; this system is {sys.platform!r}")
