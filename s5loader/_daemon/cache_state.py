"""The daemon's state in the cache directory: the state file (how far delivery got, written
atomically), the ledger of delivered samples not yet consumed, and the steps that recover a
cache a stopped daemon left. The lock is :mod:`.lock`'s."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .._engine.budget import check_sample_fits
from .._index.sample import Sample
from .._staging.area import room_for, tree_bytes
from .._util.uri import format_size
from ..exceptions import DaemonError
from .protocol import (
    CLAIMED_DIR,
    CONTROL_FILES,
    END_MARKER,
    END_TMP,
    EPOCH_DIR,
    ERROR_MARKER,
    ERROR_TMP,
    LOCK_FILE,
    STAGING_DIR,
    STATE_FILE,
    STATE_TMP,
    claimed_names,
    parse_seq,
    ready_names,
)

log = logging.getLogger(__name__)

STATE_VERSION = 1
# The ledger looks at the cache at most this often; it trusts an unchanged directory
# timestamp only for a listing taken this long after it (ns), and lists again this often.
_LOOK_S = 0.05
_MTIME_MARGIN_NS = 1_000_000_000
_RELIST_S = 5.0


def write_atomic(path: str, text: str, tmp: str | None = None) -> None:
    """Write ``text`` to ``tmp`` (default ``PATH.tmp``), then rename it over ``path``.

    The file is flushed to disk before the rename and the directory after it, so a power loss
    leaves the old content or the new one, never an empty or missing file.
    """
    tmp = tmp or f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class DaemonState:
    """``CACHE/.state.json``: which run the cache belongs to and how far delivery got.

    ``delivered`` is the next delivery number. It is written once per delivery, before the
    sample's rename, already counting it, with ``pending`` naming that rename: a daemon
    killed before the rename is done completes it at the next start, so the sample is
    neither delivered twice nor lost.
    ``run`` names this pass over the source (new with every ``--fresh`` start); ``END``
    repeats it, so a consumer can tell a new run's end from an old one.
    """

    source: str
    group_by: str
    shuffle: bool | str
    seed: int
    epochs: int
    samples: int
    index: str
    delivered: int = 0
    skipped: int = 0
    pending: dict[str, Any] | None = None
    version: int = STATE_VERSION
    done: bool = False
    run: str = ""
    block_size: int | None = None  # with shuffle "block": the blocks' most samples
    window: int | None = None  # with shuffle "block": the windows' most samples (kept on restart)
    block_rule: int | None = None  # with shuffle "block": how blocks were cut (blocks.GROW)

    IDENTITY = (
        "version",
        "source",
        "group_by",
        "shuffle",
        "seed",
        "epochs",
        "samples",
        "index",
        "block_size",
        "block_rule",
    )

    @classmethod
    def load(cls, path: str) -> DaemonState | None:
        """The state in ``path``, or None when there is none.

        Raises:
            DaemonError: the file is not a state this version wrote.
        """
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
            return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as exc:
            raise DaemonError(
                f"cannot read the daemon state {path}: {exc}; remove the cache or pass --fresh"
            ) from exc

    def save(self, path: str) -> None:
        write_atomic(path, json.dumps(asdict(self)))

    def differences(self, other: DaemonState, grown: Callable[[], bool] = lambda: True) -> list[str]:
        """What differs from ``other`` in :data:`IDENTITY`. A state from before its block rule
        was kept cut its blocks as ``other`` does where none of ``other``'s grew past
        ``block_size`` (``grown()``, asked only then)."""
        if self.block_rule is None and other.block_rule is not None and not grown():
            self.block_rule = other.block_rule
        return [
            f"{k} {getattr(self, k)!r} (now {getattr(other, k)!r})"
            for k in self.IDENTITY
            if getattr(self, k) != getattr(other, k)
        ]


class Ledger:
    """Delivered samples not yet consumed: a sample is consumed once its folder is gone, from
    the cache and from ``.claimed/`` (where consumers move the samples they claim).

    Looks at the cache at most every 50 ms, under a lock so a delivery is never mistaken for
    a consumption. A look costs one ``stat`` of each of the two directories while nothing in
    them changed (a folder deleted or renamed changes its directory's modification time), and
    a ``listdir`` only when something did, so a daemon that waits on a full cache of many
    samples (its engine asks about every one of them several times a second) spends next to
    no CPU. The listings are trusted only once taken :data:`_MTIME_MARGIN_NS` after the
    directories' last change (file system timestamps are coarse), and repeated every
    :data:`_RELIST_S` whatever the timestamps say (a clock or file system that does not keep
    them can delay a release by that much, never lose it). The cache is listed before
    ``.claimed/``, so a sample claimed meanwhile is in one listing or the other; one in neither
    is looked for by name before it counts as consumed (a consumer may hand a claim back).
    """

    def __init__(self, cache: str) -> None:
        self.cache = cache
        self.claimed = os.path.join(cache, CLAIMED_DIR)
        self._present: dict[int, tuple[str, int]] = {}
        self._bytes = 0  # the sizes of _present, summed
        self._lock = threading.Lock()
        self._last = 0.0  # when the cache was last looked at (monotonic)
        self._listed = 0.0  # when it was last listed (monotonic)
        self._listed_ns = 0  # ... by the wall clock, which file system timestamps follow
        self._dir: tuple[tuple[int, int, int] | None, ...] | None = (
            None  # the directories' (inode, mtime, ctime)
        )
        self.listings = 0  # listdir calls so far (for tests and the curious)

    def add(self, seq: int, name: str, size: int) -> None:
        with self._lock:
            old = self._present.get(seq)
            self._present[seq] = (name, size)
            self._bytes += size - (old[1] if old is not None else 0)

    @staticmethod
    def _stamp(path: str) -> tuple[int, int, int] | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)

    def _there(self, name: str) -> bool:
        return any(os.path.lexists(os.path.join(d, name)) for d in (self.cache, self.claimed, self.cache))

    def refresh(self, force: bool = False) -> None:
        """Forget the samples whose folders are gone (``force``: even within 50 ms of the last
        look)."""
        with self._lock:
            now = time.monotonic()
            if not force and now - self._last < _LOOK_S:
                return
            self._last = now
            if not self._present:
                return
            stamp = (self._stamp(self.cache), self._stamp(self.claimed))
            changed = max((max(s[1], s[2]) for s in stamp if s is not None), default=0)
            if (
                stamp[0] is not None
                and stamp == self._dir
                and now - self._listed < _RELIST_S
                and self._listed_ns - changed > _MTIME_MARGIN_NS
            ):
                return  # unchanged since a listing that saw every change before it
            self._dir, self._listed, self._listed_ns = stamp, now, time.time_ns()
            names = set(os.listdir(self.cache))
            with contextlib.suppress(FileNotFoundError):
                names.update(os.listdir(self.claimed))
            self.listings += 1
            for seq in [s for s, (n, _) in self._present.items() if n not in names]:
                if not self._there(self._present[seq][0]):
                    self._bytes -= self._present.pop(seq)[1]

    def is_released(self, seq: int) -> bool:
        # Asked for every delivered sample on each look of the engine: a dict lookup, and a
        # look at the cache when the last one is older than 50 ms.
        if time.monotonic() - self._last >= _LOOK_S:
            self.refresh()
        return seq not in self._present

    @property
    def count(self) -> int:
        return len(self._present)

    @property
    def held(self) -> int:
        """The bytes of the delivered samples not yet consumed."""
        return self._bytes

    def items(self) -> list[tuple[int, int]]:
        """``(delivery number, bytes)`` of every delivered sample not yet consumed."""
        with self._lock:
            return [(seq, size) for seq, (_, size) in self._present.items()]


def check_unused(cache: str) -> None:
    """Refuse a directory that holds anything but a daemon's files."""
    ours = {
        LOCK_FILE,
        STAGING_DIR,
        EPOCH_DIR,
        END_MARKER,
        STATE_TMP,
        END_TMP,
        ERROR_MARKER,
        ERROR_TMP,
        CLAIMED_DIR,
    }
    other = sorted(n for n in os.listdir(cache) if n not in ours)
    if other:
        raise DaemonError(
            f"the cache {cache} is not empty and holds no daemon state "
            f"({', '.join(other[:3])}{' ...' if len(other) > 3 else ''}); "
            "use an empty or new directory"
        )


def wipe(cache: str) -> None:
    """Remove the delivered samples (claimed or not), the staging folder, the state and END
    (``--fresh``)."""
    log.info("--fresh: removing the samples and state in %s", cache)
    for name in os.listdir(cache):
        path = os.path.join(cache, name)
        if parse_seq(name) is not None or name in (STAGING_DIR, EPOCH_DIR, CLAIMED_DIR):
            shutil.rmtree(path, ignore_errors=True)
        elif name in (STATE_FILE, END_MARKER, STATE_TMP, END_TMP):
            os.unlink(path)


def recover_pending(st: DaemonState, state_path: str) -> None:
    """Complete the rename of a delivery the last daemon recorded but may not have done."""
    p = st.pending
    if not p:
        return
    # The last daemon stopped between writing "pending" and recording the delivery.
    if os.path.isdir(p["from"]) and not os.path.exists(p["to"]):
        os.rename(p["from"], p["to"])
    st.delivered = max(st.delivered, int(p["seq"]) + 1)
    st.pending = None
    st.save(state_path)


def clear_staging(cache: str) -> int:
    """Remove whatever an earlier daemon left in ``CACHE/.staging``; returns the bytes freed.

    Called under the cache's lock after :func:`recover_pending` and before anything is
    fetched: no other process stages there, so everything in it is a stopped run's. Not only
    staging areas whose lock is free (which :func:`~s5loader._staging.area.clean_stale` would
    remove too), but also a half-made area and folders without a lock: s5cmd creates a missing
    destination folder, so a copy that outlived its daemon recreates one after that daemon's
    area was removed, and such a folder, left alone, would hold bytes no budget counts.
    """
    staging = os.path.join(cache, STAGING_DIR)
    try:
        names = os.listdir(staging)
    except FileNotFoundError:
        return 0
    freed = 0
    for name in names:
        path = os.path.join(staging, name)
        if os.path.isdir(path) and not os.path.islink(path):
            freed += tree_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                freed += os.lstat(path).st_size
                os.unlink(path)
    if names:
        log.info("removed what an earlier daemon left in %s (%s)", staging, format_size(freed))
    return freed


def adopt_delivered(cache: str, ledger: Ledger) -> int:
    """Count samples a previous run delivered and nobody consumed yet (claimed or not); their
    bytes."""
    total = 0
    found = [(name, os.path.join(cache, name)) for name in ready_names(cache)]
    found += [(name, os.path.join(cache, CLAIMED_DIR, name)) for name in claimed_names(cache)]
    for name, path in found:
        seq = parse_seq(name)
        assert seq is not None
        size = tree_bytes(path) - _control_bytes(path)
        ledger.add(seq, name, size)
        total += size
    if total:
        log.info("%d delivered samples (%s) wait in %s", ledger.count, format_size(total), cache)
    return total


def _control_bytes(folder: str) -> int:
    total = 0
    for name in CONTROL_FILES:
        with contextlib.suppress(OSError):
            total += os.lstat(os.path.join(folder, name)).st_size
    return total


def write_end(cache: str, st: DaemonState) -> None:
    """Record that every sample was delivered: the state, then ``END`` naming the run."""
    st.done, st.pending = True, None
    st.save(os.path.join(cache, STATE_FILE))
    write_atomic(
        os.path.join(cache, END_MARKER),
        json.dumps({"samples": st.delivered, "skipped": st.skipped, "run": st.run}) + "\n",
        tmp=os.path.join(cache, END_TMP),
    )


def remove_end(cache: str) -> None:
    try:
        os.unlink(os.path.join(cache, END_MARKER))
    except FileNotFoundError:
        pass


def check_cache_budget(
    samples: Sequence[Sample], budget: int, epochs: int, cache: str, held: int, epoch_cache: int = 0
) -> None:
    """Refuse a budget no sample fits in, or one the cache's file system cannot hold (with an
    ``epoch_cache`` of that many bytes beside it).

    ``held``: bytes of delivered samples already in the cache.
    """
    check_sample_fits(max(samples, key=lambda s: s.size), budget, "raise --budget")
    need = min(budget, sum(s.size for s in samples) * epochs) - held + epoch_cache
    room_for(cache, need, budget, "lower --budget or free space")
