"""Where files are staged: choosing the staging root (tmpfs or the temp directory) against the
byte budget, one directory per loader, and removing what dead loaders left behind."""

from __future__ import annotations

import atexit
import fcntl
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._util.dist import local_world_size
from .._util.procs import ProcessId
from .._util.uri import format_size
from ..exceptions import BudgetError, ConfigError

log = logging.getLogger(__name__)

PREFIX = "s5loader-"
SHM = "/dev/shm"
LOCK = ".lock"  # in a staging directory: its owner holds it, and it names them (pid, start)


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def choose_root(
    staging_dir: str | None, need: int, shrink: bool = False, footprint: float = 1.0, shared: int = 0
) -> tuple[str, int]:
    """Pick the staging root and check that ``need`` bytes fit in it, for every rank of the node.

    The ranks of one node (:func:`local_world_size`) stage into the same file system, each up to
    its own budget, so the check is against ``need`` times their number. A file takes whole
    blocks on disk (4 KiB pages on tmpfs), so ``need`` bytes of objects take ``need *
    footprint`` bytes of the file system (see :func:`disk_footprint`). ``staging_dir=None``
    picks ``/dev/shm`` when it has room for all of them, else the system temp directory.
    ``shared`` bytes (the epoch cache, which the node's ranks share) count once per node.

    Returns:
        the root directory and the number of bytes this rank may stage (``need``, or its
        share of the free space when ``shrink`` is true and the root has less room).

    Raises:
        BudgetError: the root has less free space than the node's ranks need and ``shrink``
            is false.
    """
    local = local_world_size()
    ranks = f" x {local} ranks on this node" if local > 1 else ""
    on_disk = math.ceil(need * max(1.0, footprint))
    if on_disk > need * 1.05:
        ranks += f" (taking {format_size(on_disk)} on disk in whole blocks)"
    cache = math.ceil(shared * max(1.0, footprint))
    if shared:
        ranks += f" + an epoch cache of {format_size(shared)} for the node"
    if staging_dir is None:
        if os.path.isdir(SHM) and os.access(SHM, os.W_OK) and free_bytes(SHM) >= on_disk * local + cache:
            root = SHM
        else:
            root = tempfile.gettempdir()
        log.info(
            "staging in %s (%s free, budget %s%s)",
            root,
            format_size(free_bytes(root)),
            format_size(need),
            ranks,
        )
    else:
        root = os.path.abspath(os.fspath(staging_dir))
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the staging directory {root!r}: {exc.strerror}") from exc
    advice = "lower the budget, free space, choose another staging_dir, or pass shrink_budget=True"
    free = room_for(root, on_disk * local + cache, need, advice, ranks, fail=not shrink)
    if on_disk * local + cache > free:
        shrunk = int(max(0, free * 0.9 - cache) / max(1.0, footprint)) // local
        log.warning(
            "budget shrunk from %s to %s to fit the free space of %s%s",
            format_size(need),
            format_size(shrunk),
            root,
            f" shared by {local} ranks" if local > 1 else "",
        )
        return root, shrunk
    return root, need


def room_for(root: str, need: int, budget: int, advice: str, detail: str = "", fail: bool = True) -> int:
    """The free bytes of ``root``; with ``fail``, a :class:`BudgetError` when ``need`` bytes do
    not fit, naming the ``budget`` (``detail``: how ``need`` was counted) and ``advice``."""
    free = free_bytes(root)
    if fail and need > free:
        raise BudgetError(
            f"the budget of {format_size(budget)}{detail} does not fit the {format_size(free)} free "
            f"in {root}; {advice}"
        )
    return free


def tree_bytes(path: str) -> int:
    """Bytes of the files below ``path`` (files that vanish meanwhile count nothing)."""
    total = 0
    for root, _, files in os.walk(path):
        for fn in files:
            try:
                total += os.lstat(os.path.join(root, fn)).st_size
            except OSError:
                pass
    return total


def disk_footprint(sizes: Sequence[int] | np.ndarray, block: int = 4096) -> float:
    """Bytes of file system per byte of objects: each file takes whole blocks (``block``: the
    page size of tmpfs, the block size of most disk file systems), which matters for small
    objects (a 1-byte label takes 4 KiB)."""
    a = np.asarray(sizes, dtype=np.int64)
    total = int(a.sum())
    if total <= 0:
        return 1.0
    return float(((a + block - 1) // block * block).sum()) / total


class StagingArea:
    """A directory of one loader's own: ``ROOT/s5loader-PID-TOKEN/``.

    It holds one sub-directory per staged sample, named by its index, and a ``.lock`` file
    that stays locked (``flock``) while the owning process lives, so a later loader can tell
    a dead loader's leftovers from a live one. Created lazily; :meth:`remove` is idempotent.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = os.path.join(root, f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        self._owner = os.getpid()
        self._lock_fd: int | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_lock_fd"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def sample_dir(self, index: int) -> str:
        return f"{self.path}/{index}"

    @property
    def control_dir(self) -> str:
        return os.path.join(self.path, ".calls")

    def create(self) -> str:
        """Create the directory (once), remove dead loaders' leftovers, take the lock."""
        with self._lock:
            if self._lock_fd is not None and os.path.isdir(self.path):
                return self.path
            clean_stale(self.root)
            tmp = os.path.join(self.root, f".init-{os.path.basename(self.path)}")
            os.makedirs(tmp, mode=0o700)
            fd = os.open(os.path.join(tmp, LOCK), os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, json.dumps(ProcessId.me()._asdict()).encode())  # its owner: pid and start
            os.makedirs(os.path.join(tmp, ".calls"), mode=0o700)
            if os.path.isdir(self.path):  # recreated after someone removed it: start clean
                shutil.rmtree(self.path, ignore_errors=True)
            os.rename(tmp, self.path)
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            self._lock_fd = fd
            _register(self)
            return self.path

    def clear(self) -> None:
        """Remove every staged sample, keep the directory."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return
        for name in names:
            if not name.startswith("."):
                shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)

    def remove(self) -> None:
        """Remove the directory and everything in it. Safe to call twice, and from atexit."""
        if os.getpid() != self._owner:
            return
        # Again where a process still at work in it (a DataLoader worker writing its figures, a
        # late s5cmd) put a file in a folder the first pass had emptied, so that none is left.
        for _ in range(3):
            shutil.rmtree(self.path, ignore_errors=True)
            if not os.path.lexists(self.path):
                break
            time.sleep(0.01)
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        _LIVE.pop(id(self), None)


class PassArea(StagingArea):
    """The folder of one staging pass inside a loader's :class:`StagingArea`: ``AREA/NAME/``.

    Each pass (an epoch, or the resumed rest of one) stages into a folder of its own, and the
    indices the sampler yields name it, so a DataLoader worker still reading a replaced pass's
    samples never meets the next pass's files, and one dataset can serve several samplers.
    """

    def __init__(self, parent: StagingArea, name: str) -> None:
        self.root = parent.path
        self.path = os.path.join(parent.path, name)
        self._owner = os.getpid()
        self._lock_fd = None
        self._lock = threading.Lock()

    def create(self) -> str:
        os.makedirs(self.control_dir, mode=0o700, exist_ok=True)
        return self.path

    def remove(self) -> None:
        if os.getpid() == self._owner:
            shutil.rmtree(self.path, ignore_errors=True)


_NAME = re.compile(r"^(\.init-)?s5loader-\d+-[0-9a-f]{8}$")


def _owner_alive(path: str) -> bool:
    """Whether a staging directory's owner still holds its lock (or it is not ours at all)."""
    try:
        fd = os.open(os.path.join(path, LOCK), os.O_RDONLY)
    except OSError:
        return True  # no lock file: not a directory s5loader made, or cannot tell; leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True  # locked: its owner lives (or we cannot tell)
    finally:
        os.close(fd)
    return False


def clean_stale(root: str) -> list[str]:
    """Remove staging directories under ``root`` whose owning process is gone.

    A directory whose lock is held (its loader, or that loader's DataLoader workers, still
    run) is never touched. Returns the removed paths.
    """
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not _NAME.match(name):
            continue
        path = os.path.join(root, name)
        if os.path.islink(path) or not os.path.isdir(path) or _owner_alive(path):
            continue
        if name.startswith(".init-") and time.time() - os.path.getmtime(path) < 60:
            continue  # another loader may be setting it up right now
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed %s, left by a loader that is gone", path)
        removed.append(path)
    return removed


# Loaders alive in this process, cleaned at exit and on SIGTERM.
_LIVE: dict[int, Any] = {}
_CLEANUPS: weakref.WeakSet[Any] = weakref.WeakSet()
_PID = os.getpid()


def _register(area: StagingArea) -> None:
    _LIVE[id(area)] = area


def register_cleanup(obj: Any) -> None:
    """Have ``obj.close()`` called at exit and on SIGTERM (held weakly)."""
    _CLEANUPS.add(obj)
    install_sigterm_handler()


def cleanup_all() -> None:
    if os.getpid() != _PID:
        return
    for obj in list(_CLEANUPS):
        try:
            obj.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            log.exception("cleanup of %r failed", obj)
    for area in list(_LIVE.values()):
        area.remove()


atexit.register(cleanup_all)


def abort_all() -> None:
    """Kill s5cmd and remove the staging directories, taking no lock and joining no thread.

    For the SIGTERM handler: it runs in the main thread between two of its instructions,
    maybe while that thread holds a lock a ``close()`` would wait for (an engine's condition,
    which the engine's thread needs before it can be joined). Objects registered with
    :func:`register_cleanup` provide ``_abort()`` for this; for one that does not (a transfer,
    a fetch: no engine thread), ``close()`` runs once, and must take no such lock.
    """
    if os.getpid() != _PID:
        return
    closed: set[int] = set()
    for _ in range(2):  # again, for an s5cmd call started while the first round ran
        for obj in list(_CLEANUPS):
            abort = getattr(obj, "_abort", None)
            if abort is None:
                if id(obj) in closed:
                    continue
                closed.add(id(obj))
                abort = obj.close
            try:
                abort()
            except Exception:  # noqa: BLE001 - best effort, the process is ending
                pass
        for area in list(_LIVE.values()):
            area.remove()


def _on_sigterm(signum: int, frame: Any) -> None:
    if os.getpid() == _PID:
        abort_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def install_sigterm_handler() -> None:
    """Clean up on SIGTERM, then die of it as before.

    Only installed from the main thread and only where SIGTERM still has its default action:
    a handler the program installed itself is left alone (atexit still cleans up when that
    handler ends the process by raising ``SystemExit``).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    from torch.utils.data import get_worker_info

    if get_worker_info() is not None:
        # A DataLoader worker: torch's own handler (set in C, so getsignal says None) ends the
        # worker quietly when its loader stops it; ours would make that a reported crash.
        return
    try:
        current = signal.getsignal(signal.SIGTERM)
    except ValueError:  # pragma: no cover
        return
    if current in (signal.SIG_DFL, None) and os.getpid() == _PID:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _after_fork_in_child() -> None:
    global _PID
    # A forked DataLoader worker owns none of its parent's loaders.
    _LIVE.clear()
    _CLEANUPS.clear()
    _PID = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)
