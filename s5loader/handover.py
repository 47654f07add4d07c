"""The cache directory of ``s5loader prefetch``, as any consumer sees it: its names, claiming a
sample, and whether a daemon is alive on it (docs/daemon.md, "The hand-over protocol").

Both sides take the names from here: :mod:`s5loader.consume` (the consumer, which depends on
nothing of the daemon) and :mod:`s5loader._daemon` (the producer).

* A delivered sample is a folder ``SEQUENCE-KEY`` (:data:`SEQ_WIDTH` digits), so plain ``ls``
  order is the delivery order; ``__key__`` and ``__epoch__`` in it hold its full key and its
  epoch.
* A consumer *claims* a sample by renaming its folder into :data:`CLAIMED_DIR` under the same
  name (:func:`claim`; ``mv NAME .claimed/`` in a shell): a rename is atomic, so of several
  consumers exactly one gets it. The daemon counts a claimed sample against the budget until its
  folder is deleted there.
* :data:`END_MARKER` appears once every sample was delivered; :data:`ERROR_MARKER`, holding the
  daemon's message, when it failed. Both sort after every sample folder.
* The running daemon holds an exclusive ``flock`` on :data:`LOCK_FILE` (which holds its pid).
  A consumer may probe it (:func:`lock_held`, or ``flock -n -s .lock true`` in a shell) at any
  time: a daemon that starts while a probe holds the lock waits for it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
from dataclasses import dataclass

#: Digits of the delivery number that starts every sample folder's name.
SEQ_WIDTH = 12
#: The file the daemon writes into the cache once every sample has been delivered.
END_MARKER = "END"
#: The file the daemon writes into the cache when it fails: its message, one line.
ERROR_MARKER = "ERROR"
#: The file in each delivered folder that holds the sample's full key (UTF-8, no newline; a
#: tar member name that is not UTF-8 keeps its own bytes).
KEY_FILE = "__key__"
#: The file in each delivered folder that holds the sample's epoch (ASCII digits, from 0).
EPOCH_FILE = "__epoch__"
#: Control files of a sample folder: not fields.
CONTROL_FILES = (KEY_FILE, EPOCH_FILE)
#: Where consumers move the samples they claimed (same name; hidden from ``ls``).
CLAIMED_DIR = ".claimed"
LOCK_FILE = ".lock"
STATE_FILE = ".state.json"
STAGING_DIR = ".staging"
_SAMPLE_RE = re.compile(rf"^(\d{{{SEQ_WIDTH}}})-")


def parse_seq(name: str) -> int | None:
    """The delivery number of a sample folder's name, or None if ``name`` is not one."""
    m = _SAMPLE_RE.match(name)
    return int(m.group(1)) if m else None


def _sample_names(folder: str) -> list[str]:
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(n for n in names if _SAMPLE_RE.match(n))


def ready_names(cache: str) -> list[str]:
    """The sample folders ready in ``cache``, in delivery order (empty if it does not exist)."""
    return _sample_names(cache)


def claimed_names(cache: str) -> list[str]:
    """The sample folders consumers claimed and have not deleted yet, in delivery order."""
    return _sample_names(os.path.join(cache, CLAIMED_DIR))


def claim(cache: str, name: str) -> str | None:
    """Claim the ready sample ``name``: rename it into ``CACHE/.claimed/``. Returns its new
    path, or None when another consumer claimed it first (or it is gone)."""
    dest = os.path.join(cache, CLAIMED_DIR, name)
    for _ in range(2):
        try:
            os.rename(os.path.join(cache, name), dest)
            return dest
        except FileNotFoundError:
            if not os.path.lexists(os.path.join(cache, name)):
                return None  # claimed (or deleted) by another consumer
            os.makedirs(os.path.join(cache, CLAIMED_DIR), exist_ok=True)  # a daemon older than claims
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return None  # the name is taken in .claimed: not ours to overwrite
            raise
    return None


def unclaim(cache: str, name: str) -> bool:
    """Hand a claimed sample back: rename it from ``.claimed/`` to the cache, where the next
    consumer takes it. Whether it was there to hand back."""
    try:
        os.rename(os.path.join(cache, CLAIMED_DIR, name), os.path.join(cache, name))
        return True
    except OSError:
        return False


def lock_held(cache: str) -> bool | None:
    """Whether a daemon holds the cache's lock now; None when there is no lock file (no daemon
    ever started there). The probe takes a shared lock for an instant (never creating the
    file); a daemon that starts meanwhile waits for it."""
    try:
        fd = os.open(os.path.join(cache, LOCK_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)  # also releases the probe's lock
    return False


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None


@dataclass(frozen=True)
class DaemonStatus:
    """What :func:`daemon_status` found.

    Attributes:
        state: ``running`` (a daemon holds the cache), ``done`` (every sample was delivered and
            the daemon ended), ``failed`` (the daemon wrote :data:`ERROR_MARKER` and ended),
            ``gone`` (it ended before the end: stopped by a signal or killed, also while it
            started, before its first state: its pid is in the lock and nothing else) or
            ``absent`` (no daemon has run on the cache, or it failed before it took the cache).
        cache: the cache directory.
        pid: the last daemon's pid (from the lock file), if any.
        error: with ``failed``, the daemon's message.
        delivered, total: from the state file: samples delivered so far, and in all epochs.
    """

    state: str
    cache: str
    pid: int | None = None
    error: str | None = None
    delivered: int | None = None
    total: int | None = None

    @property
    def alive(self) -> bool:
        """True while a daemon runs, or when it ended having delivered everything."""
        return self.state in ("running", "done")

    def describe(self) -> str:
        """One sentence for people."""
        who = f"the prefetch daemon (pid {self.pid})" if self.pid else "the prefetch daemon"
        progress = f"{self.delivered} of {self.total} samples delivered" if self.delivered is not None else ""
        if self.state == "running":
            return f"{who} runs on {self.cache}" + (f": {progress}" if progress else "")
        if self.state == "done":
            return f"{who} delivered every sample into {self.cache} and ended" + (
                f" ({progress})" if progress else ""
            )
        if self.state == "failed":
            return f"{who} on the cache {self.cache} failed: {self.error}"
        if self.state == "gone" and self.total is None:
            return (
                f"no prefetch daemon runs on the cache {self.cache}: {who} took it and ended while it "
                "started, before its first delivery (stopped by a signal, or killed); start it again "
                "to begin"
            )
        if self.state == "gone":
            return (
                f"no prefetch daemon runs on the cache {self.cache}: {who} ended before the end "
                f"(stopped by a signal, or killed){' with ' + progress if progress else ''}; start it "
                "again with the same arguments to continue"
            )
        where = "" if os.path.isdir(self.cache) else " (the folder does not exist)"
        return f"no prefetch daemon has started on the cache {self.cache}{where}"


def daemon_status(cache: str | os.PathLike[str]) -> DaemonStatus:
    """Whether a daemon is alive on ``cache``, without disturbing it (see :func:`lock_held`)."""
    cache = os.path.abspath(os.fspath(cache))
    held = lock_held(cache)
    pid_text = (_read(os.path.join(cache, LOCK_FILE)) or "").strip()
    pid = int(pid_text) if pid_text.isdigit() else None
    state: dict[str, object] = {}
    with contextlib.suppress(ValueError, TypeError):
        state = json.loads(_read(os.path.join(cache, STATE_FILE)) or "{}")
    delivered, samples, epochs = state.get("delivered"), state.get("samples"), state.get("epochs")
    total = samples * epochs if isinstance(samples, int) and isinstance(epochs, int) else None
    done: int | None = delivered if isinstance(delivered, int) and total is not None else None
    if held:
        return DaemonStatus("running", cache, pid, None, done, total)
    error = _read(os.path.join(cache, ERROR_MARKER))
    if error is not None:
        return DaemonStatus("failed", cache, pid, error.strip() or "(no message)", done, total)
    if state:
        ended = bool(state.get("done")) and os.path.exists(os.path.join(cache, END_MARKER))
        return DaemonStatus("done" if ended else "gone", cache, pid, None, done, total)
    if pid is not None:
        # A daemon writes its pid into the lock when it takes the cache, seconds before its first
        # state (it loads torch and lists the source first): killed or stopped in between, it
        # leaves its pid and nothing else. No probe writes the file.
        return DaemonStatus("gone", cache, pid)
    return DaemonStatus("absent", cache, pid)


def sample_bytes(cache: str | os.PathLike[str]) -> int:
    """The bytes of samples in ``cache`` now, as the budget counts them: those being fetched
    into ``.staging/``, the delivered folders, the claimed ones not yet deleted; not the control
    files (the lock, the state, ``__key__``, ``__epoch__``, s5cmd's command files), nor the
    epoch cache, nor folders themselves.

    ``.staging/`` is looked at first and files are counted once per inode, so a sample renamed
    into place during the look is not counted twice; only files still there at the end of the
    look count, so a sample the consumer deleted meanwhile is not added to the one fetched in
    its place: a lower bound of the bytes at the end of the look.
    """
    cache = os.fspath(cache)
    seen: dict[tuple[int, int], tuple[str, int]] = {}

    def walk(top: str) -> None:
        for root, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d != ".calls"]  # s5cmd's command files
            for fn in files:
                if fn in CONTROL_FILES or fn == LOCK_FILE:
                    continue
                path = os.path.join(root, fn)
                with contextlib.suppress(OSError):
                    st = os.lstat(path)
                    seen[(st.st_dev, st.st_ino)] = (path, st.st_size)

    walk(os.path.join(cache, STAGING_DIR))
    for name in ready_names(cache):  # before the claimed ones: a claim moves a folder there
        walk(os.path.join(cache, name))
    for name in claimed_names(cache):
        walk(os.path.join(cache, CLAIMED_DIR, name))
    total = 0
    for (dev, ino), (path, size) in seen.items():
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) == (dev, ino):
                total += size
    return total
