"""Which process is which, by what the kernel says of it: a process is named by its pid and its
start time (``/proc/PID/stat``'s field 22), so a pid the kernel gave to another process since
does not pass for the one that ended; never by a parent's pid, which inside containers is often
1 while the process that matters lives."""

from __future__ import annotations

import os
from typing import NamedTuple


def proc_is_ours() -> bool:
    """Whether ``/proc`` shows this process's pid namespace (not so under ``unshare -p`` without a
    ``/proc`` of its own): only then do pids found there mean what the kernel's say here."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def _stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command name (field 3 on), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()
    except OSError:
        return None


def parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` (None when it is gone or ``/proc`` cannot tell)."""
    fields = _stat(pid)
    try:
        return int(fields[1]) if fields is not None else None
    except (IndexError, ValueError):
        return None


class ProcessId(NamedTuple):
    """A process: its pid and its start time in clock ticks after boot (None where ``/proc`` is
    not this namespace's, and only the pid can be checked)."""

    pid: int
    start: int | None

    @classmethod
    def of(cls, pid: int) -> ProcessId:
        fields = _stat(pid) if proc_is_ours() else None
        try:
            return cls(pid, int(fields[19]) if fields is not None else None)
        except (IndexError, ValueError):
            return cls(pid, None)

    @classmethod
    def me(cls) -> ProcessId:
        return cls.of(os.getpid())

    def alive(self) -> bool:
        """Whether this process still runs (not a zombie, and not another one under its pid)."""
        if self.pid == os.getpid():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's: it exists
        if self.start is None or not proc_is_ours():
            return True
        fields = _stat(self.pid)
        if fields is None:
            return False
        try:
            return fields[0] != b"Z" and int(fields[19]) == self.start
        except (IndexError, ValueError):
            return True
