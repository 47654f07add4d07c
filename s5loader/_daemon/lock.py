"""The cache's lock and its markers of how a run ended: the daemon holds an exclusive ``flock``
on ``CACHE/.lock`` while it lives (the kernel releases it however the daemon dies), waits past
a consumer that probes the lock, and writes ``ERROR`` with its message when it fails."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time

from .._util.uri import for_cli
from ..exceptions import DaemonError, S5LoaderError
from .cache_state import check_unused, remove_end, wipe
from .protocol import CLAIMED_DIR, ERROR_MARKER, ERROR_TMP, LOCK_FILE, STATE_FILE
from .reporting import ProgressReporter, open_reporter

log = logging.getLogger(__name__)

# How long a starting daemon waits for a lock held by a process that is not a live daemon (a
# consumer's probe holds it for an instant), looking this often.
_PROBE_WAIT_S = 10.0
_PROBE_LOOK_S = 0.01


def _alive(pid: int) -> bool:
    """Whether process ``pid`` lives (the pid a daemon wrote into the lock: a probe writes none)."""
    if pid == os.getpid():
        return False  # the pid of an earlier daemon, given to this process since
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


class CacheLock:
    """An exclusive ``flock`` on ``CACHE/.lock`` for the daemon's lifetime; holds its pid.

    A consumer may probe the lock (a shared ``flock`` for an instant, as
    :func:`s5loader.handover.lock_held` or ``flock -n -s .lock true`` take it): a daemon that
    finds the lock held by anything but a live daemon waits up to 10 s for it, so a probe never
    makes a start fail.
    """

    def __init__(self, cache: str) -> None:
        self.cache = cache
        self.path = os.path.join(cache, LOCK_FILE)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> CacheLock:
        """Take the lock.

        Raises:
            DaemonError: another daemon holds it (the message names the cache and its pid), or
                a process that is not a daemon held it for 10 s.
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            self._wait(fd)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def _wait(self, fd: int) -> None:
        """Take the lock on ``fd``, waiting for a process that is not a live daemon."""
        deadline, told = time.monotonic() + _PROBE_WAIT_S, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise DaemonError(f"cannot lock the cache {self.cache}: {exc.strerror}") from exc
            text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
            pid = int(text) if text.isdigit() else None
            if pid is not None and _alive(pid):
                raise DaemonError(
                    f"another s5loader prefetch daemon (pid {pid}) is running on the cache "
                    f"{self.cache}; stop it first or use another --cache"
                )
            if time.monotonic() > deadline:
                raise DaemonError(
                    f"the lock {self.path} of the cache {self.cache} was held for {_PROBE_WAIT_S:g}s by "
                    f"a process that is no prefetch daemon{f' (pid {pid} in it has ended)' if pid else ''}: "
                    "a consumer may probe the lock (flock -n -s .lock true) but must not hold it"
                )
            if not told:
                told = True
                log.info("the lock %s is held for now (a consumer's probe?): waiting for it", self.path)
            time.sleep(_PROBE_LOOK_S)

    def release(self) -> None:
        """Release the lock (the file stays: removing it would race a starting daemon)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def take_cache(cache: str, fresh: bool) -> CacheLock:
    """Make the cache directory and lock it for this daemon (with ``fresh``, then empty it: the
    old run's ``END`` first): the first thing a daemon does, before it loads torch, so that a
    consumer that probes the lock sees it at once.

    Raises:
        DaemonError: the directory cannot be made, holds other files and no daemon state, or
            another daemon holds it.
    """
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError as exc:
        raise DaemonError(f"cannot create the cache {cache}: {exc.strerror}") from exc
    if not os.path.exists(os.path.join(cache, STATE_FILE)):
        check_unused(cache)  # before leaving a .lock in someone else's directory
    lock = CacheLock(cache).acquire()
    if fresh:
        remove_end(cache)  # first: a consumer must not take the old run's END for this run's
        wipe(cache)
    return lock


def take_over(cache: str) -> None:
    """What a daemon does to the cache first, under its lock: remove the ``ERROR`` an earlier
    run left (that failure is not this run's), and make the folder consumers claim samples in."""
    remove_error(cache)
    os.makedirs(os.path.join(cache, CLAIMED_DIR), exist_ok=True)


def record_failure(
    cache: str, exc: BaseException, lock: CacheLock, json_log: str | None, reporter: ProgressReporter | None
) -> str:
    """Tell consumers that the daemon failed with ``exc``: ``CACHE/ERROR`` holds the message,
    written only while ``lock`` is held (a daemon that could not take the cache must not speak
    for the one that has it), and a ``failed`` event goes to the JSON log (opened for it if the
    daemon failed before it opened the log). Returns the message, in the command line's words."""
    message = for_cli(str(exc) if isinstance(exc, S5LoaderError) else f"{type(exc).__name__}: {exc}")
    if lock.held:
        write_error(cache, message)
    if reporter is None and json_log:
        reporter, opened = open_reporter(0, 0, json_log, False)
        reporter.event("failed", cache=cache, error=message, pid=os.getpid())
        if opened is not None:
            opened.close()
    elif reporter is not None:
        reporter.event("failed", cache=cache, error=message, pid=os.getpid())
    return message


def write_error(cache: str, message: str) -> None:
    """``CACHE/ERROR``: the daemon's message, one line, written atomically (call under the
    lock: a daemon that could not take it must not speak for the one that holds it)."""
    tmp = os.path.join(cache, ERROR_TMP)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(" ".join(message.split()) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(cache, ERROR_MARKER))


def remove_error(cache: str) -> None:
    """Remove the ``ERROR`` an earlier run left (under the lock, before anything else)."""
    for name in (ERROR_MARKER, ERROR_TMP):
        try:
            os.unlink(os.path.join(cache, name))
        except FileNotFoundError:
            pass
