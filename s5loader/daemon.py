"""``s5loader prefetch``: a daemon that keeps a bounded local cache filled from S3 for any
consumer, in any language.

It builds the same sample index as :class:`~s5loader.S5Dataset`, orders it as
:class:`~s5loader.S5Sampler` does (one seeded permutation per epoch) and stages with the same
s5cmd engine (:class:`~s5loader.engine.Stager`) into a hidden ``.staging`` directory inside
the cache. Each sample whose turn has come is renamed into place as ``SEQUENCE-KEY/`` (see
:mod:`s5loader.consume` and docs/daemon.md for the protocol); the consumer deletes it, which
frees its bytes for the next. A state file records how far delivery got, so a restarted
daemon continues where the last one stopped.

Layout of a cache directory::

    CACHE/000000000000-train_0000/   a delivered sample (its files named by field)
    CACHE/END                        every sample was delivered
    CACHE/.lock                      flock-ed by the running daemon (holds its pid)
    CACHE/.state.json                progress; replaced atomically after every delivery
    CACHE/.staging/                  samples being fetched (never visible to ``ls``)
"""

from __future__ import annotations

import argparse
import collections
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import IO, Any, overload

from ._args import positive_int, size_arg
from ._index import GROUP_BY, Sample
from ._order import Order
from ._platform import require_linux
from ._s5cmd import S5cmd
from ._uri import format_size
from .consume import END_MARKER, SEQ_WIDTH, parse_seq, ready_names
from .engine import ON_ERROR, Stager, StagerOptions
from .exceptions import BudgetError, ConfigError, DaemonError
from .staging.area import StagingArea, free_bytes

log = logging.getLogger(__name__)

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
STATE_FILE = ".state.json"
LOCK_FILE = ".lock"
STAGING_DIR = ".staging"
STATE_VERSION = 1
_KEY_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_KEY_LEN = 64


def sample_folder_name(seq: int, key: str) -> str:
    """``SEQUENCE-KEY``: the zero-padded delivery number, then the key made safe and short.

    The key keeps its last 64 characters (the most specific part); anything but letters,
    digits, ``.``, ``_`` and ``-`` becomes ``_``.
    """
    short = _KEY_CHARS.sub("_", key)[-_KEY_LEN:] or "_"
    return f"{seq:0{SEQ_WIDTH}d}-{short}"


def index_fingerprint(samples: Sequence[Sample]) -> str:
    """A digest of the sample index (keys, fields, URIs, sizes, ETags)."""
    h = hashlib.sha256()
    for s in samples:
        for f in s.fields:
            h.update(f"{s.key}\0{f.name}\0{f.uri}\0{f.size}\0{f.etag}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


class EpochSamples(Sequence[Sample]):
    """All epochs as one sequence: item ``seq`` is the sample delivered ``seq``-th.

    ``seq = epoch * n + position``; each epoch's order comes from :class:`Order`, computed
    when first needed (a few epochs are kept).
    """

    def __init__(self, samples: Sequence[Sample], order: Order, epochs: int) -> None:
        self._samples = samples
        self._order = order
        self._n = len(samples)
        self._epochs = epochs
        self._perms: collections.OrderedDict[int, list[int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._n * self._epochs

    @overload
    def __getitem__(self, seq: int) -> Sample: ...

    @overload
    def __getitem__(self, seq: slice) -> Sequence[Sample]: ...

    def __getitem__(self, seq: int | slice) -> Sample | Sequence[Sample]:
        if isinstance(seq, slice):
            return [self[i] for i in range(*seq.indices(len(self)))]
        if not 0 <= seq < len(self):
            raise IndexError(seq)
        epoch, pos = divmod(seq, self._n)
        return self._samples[self._perm(epoch)[pos]]

    def _perm(self, epoch: int) -> list[int]:
        with self._lock:
            perm = self._perms.get(epoch)
            if perm is None:
                perm = self._order.indices(self._n, epoch)
                self._perms[epoch] = perm
                while len(self._perms) > 3:
                    self._perms.popitem(last=False)
            return perm


@dataclass(frozen=True)
class PrefetchOptions:
    """What ``s5loader prefetch`` was asked to do (its command-line options)."""

    source: str
    cache: str
    budget: int
    group_by: str = "stem"
    shuffle: bool = False
    seed: int = 0
    epochs: int = 1
    endpoint_url: str | None = None
    samples_per_call: int = 1000
    buffers: int = 2
    numworkers: int = 256
    on_error: str = "raise"
    fresh: bool = False
    json_log: str | None = None
    progress: bool | None = None  # None: a bar when stderr is a terminal

    def __post_init__(self) -> None:
        if self.group_by not in GROUP_BY:
            raise ConfigError(f"group_by must be one of {', '.join(GROUP_BY)}; got {self.group_by!r}")
        if self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1, got {self.epochs}")
        if self.numworkers < 1:
            raise ConfigError(f"numworkers must be >= 1, got {self.numworkers}")
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"on_error must be one of {', '.join(ON_ERROR)}; got {self.on_error!r}")


# -- the cache directory: lock and state -------------------------------------------------------
class CacheLock:
    """An exclusive ``flock`` on ``CACHE/.lock`` for the daemon's lifetime; holds its pid."""

    def __init__(self, cache: str) -> None:
        self.cache = cache
        self.path = os.path.join(cache, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> CacheLock:
        """Take the lock.

        Raises:
            DaemonError: another daemon holds it (the message names the cache and its pid).
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            try:
                other = os.read(fd, 64).decode("ascii", "replace").strip() or "unknown"
            finally:
                os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DaemonError(
                    f"another s5loader prefetch daemon (pid {other}) is running on the cache "
                    f"{self.cache}; stop it first or use another --cache"
                ) from None
            raise DaemonError(f"cannot lock the cache {self.cache}: {exc.strerror}") from exc
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        """Release the lock (the file stays: removing it would race a starting daemon)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _write_atomic(path: str, text: str, tmp: str | None = None) -> None:
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
    shuffle: bool
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

    IDENTITY = ("version", "source", "group_by", "shuffle", "seed", "epochs", "samples", "index")

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
        _write_atomic(path, json.dumps(asdict(self)))

    def differences(self, other: DaemonState) -> list[str]:
        return [
            f"{k} {getattr(self, k)!r} (now {getattr(other, k)!r})"
            for k in self.IDENTITY
            if getattr(self, k) != getattr(other, k)
        ]


class _Ledger:
    """Delivered samples not yet consumed: a sample is consumed once its folder is gone.

    Looks at the cache with one ``listdir`` at most every 50 ms, under a lock so a delivery
    is never mistaken for a consumption.
    """

    def __init__(self, cache: str) -> None:
        self.cache = cache
        self._present: dict[int, tuple[str, int]] = {}
        self._lock = threading.Lock()
        self._last = 0.0

    def add(self, seq: int, name: str, size: int) -> None:
        with self._lock:
            self._present[seq] = (name, size)

    def refresh(self, force: bool = False) -> None:
        with self._lock:
            now = time.monotonic()
            if not force and now - self._last < 0.05:
                return
            self._last = now
            if not self._present:
                return
            names = set(os.listdir(self.cache))
            for seq in [s for s, (n, _) in self._present.items() if n not in names]:
                del self._present[seq]

    def is_released(self, seq: int) -> bool:
        self.refresh()
        with self._lock:
            return seq not in self._present

    @property
    def count(self) -> int:
        return len(self._present)

    def items(self) -> list[tuple[int, int]]:
        """``(delivery number, bytes)`` of every delivered sample not yet consumed."""
        with self._lock:
            return [(seq, size) for seq, (_, size) in self._present.items()]


# -- progress ----------------------------------------------------------------------------------
class _Reporter:
    """A progress bar on a terminal and/or JSON lines for machines."""

    def __init__(self, budget: int, total: int, bar: bool, json_out: IO[str] | None) -> None:
        self.budget = budget
        self.total = total
        self.bar = bar
        self.json_out = json_out
        self._last = 0.0
        self._rates: collections.deque[tuple[float, int]] = collections.deque(maxlen=20)
        self._drawn = False

    def event(self, name: str, **fields: Any) -> None:
        if self.json_out is not None:
            rec = {"event": name, "time": round(time.time(), 3), **fields}
            self.json_out.write(json.dumps(rec) + "\n")
            self.json_out.flush()

    def tick(self, snap: dict[str, Any], force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < (0.25 if self.bar else 1.0):
            return
        self._last = now
        self._rates.append((now, snap["fetched_bytes"]))
        t0, b0 = self._rates[0]
        snap["mb_s"] = round((snap["fetched_bytes"] - b0) / (now - t0) / 1e6, 2) if now > t0 else 0.0
        if self.bar:
            self._draw(snap)
        self.event("progress", **snap)

    def _draw(self, s: dict[str, Any]) -> None:
        width = 20
        filled = min(width, int(width * s["cache_bytes"] / self.budget)) if self.budget else 0
        line = (
            f"staged {s['delivered']}/{self.total}  consumed {s['consumed']}  "
            f"cache [{'#' * filled}{'.' * (width - filled)}] {format_size(s['cache_bytes'])}"
            f"/{format_size(self.budget)}  {s['mb_s']:.1f} MB/s"
        )
        sys.stderr.write("\r\x1b[K" + line)
        sys.stderr.flush()
        self._drawn = True

    def clear_line(self) -> None:
        """Wipe the bar so a log line starts on a clean line; the next tick redraws it."""
        if self._drawn:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()

    def close(self) -> None:
        if self._drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._drawn = False


class _ClearBar(logging.Filter):
    """Put on the CLI's log handlers: clears the progress bar before each log line."""

    def __init__(self, reporter: _Reporter) -> None:
        super().__init__()
        self.reporter = reporter

    def filter(self, record: logging.LogRecord) -> bool:
        self.reporter.clear_line()
        return True


# -- the daemon --------------------------------------------------------------------------------
@dataclass
class Summary:
    """What one run of the daemon did."""

    delivered: int = 0
    skipped: int = 0
    total: int = 0
    resumed_from: int = 0
    stopped: bool = False
    starved: int = 0
    starved_s: float = 0.0
    skipped_uris: list[str] = field(default_factory=list)


class Prefetcher:
    """The prefetch daemon's work: open the cache, deliver samples, stop cleanly.

    Use as a context manager; :meth:`run` returns when every sample is delivered or
    ``stop`` is set. :meth:`close` (idempotent) kills s5cmd, removes partial files and
    releases the cache's lock; delivered samples stay for the consumer.
    """

    def __init__(self, options: PrefetchOptions, stop: threading.Event | None = None) -> None:
        require_linux("the prefetch daemon")
        self.opts = options
        self.cache = os.path.abspath(options.cache)
        self.stop = stop or threading.Event()
        self._lock = CacheLock(self.cache)
        self._state_path = os.path.join(self.cache, STATE_FILE)
        self._ledger = _Ledger(self.cache)
        self._stager: Stager | None = None
        self._area: StagingArea | None = None
        self._view: EpochSamples | None = None
        self._state: DaemonState | None = None
        self._reporter: _Reporter | None = None
        self._json_file: IO[str] | None = None
        self._bar_filter: _ClearBar | None = None
        self._starving = 0.0
        self._last_starve_log = 0.0
        self._last_starve_check = 0.0
        self._start = 0
        self.summary = Summary()

    # -- opening ----------------------------------------------------------------------------
    def open(self) -> Prefetcher:
        """Lock the cache, build the index, check the budget, recover the last run's state.

        Raises:
            DaemonError: another daemon runs on the cache, or the cache holds something else.
            BudgetError: a sample larger than the budget, or a budget the disk cannot hold.
            S5LoaderError: the source cannot be listed.
        """
        try:
            os.makedirs(self.cache, exist_ok=True)
        except OSError as exc:
            raise DaemonError(f"cannot create the cache {self.cache}: {exc.strerror}") from exc
        if not os.path.exists(self._state_path):
            self._check_unused()  # before leaving a .lock in someone else's directory
        self._lock.acquire()
        if self.opts.fresh:
            self._remove_end()  # first: a consumer must not take the old run's END for this run's
        old = DaemonState.load(self._state_path)
        if old is None:
            self._check_unused()  # again, under the lock
        if self.opts.fresh:
            self._wipe()
            old = None
        samples, endpoint = self._index()
        order = Order(self.opts.shuffle, self.opts.seed, 1, 0, False)
        self._view = EpochSamples(samples, order, self.opts.epochs)
        state = DaemonState(
            self.opts.source, self.opts.group_by, self.opts.shuffle, self.opts.seed,
            self.opts.epochs, len(samples), index_fingerprint(samples), run=secrets.token_hex(8),
        )
        if old is not None:
            diff = old.differences(state)
            if diff:
                raise DaemonError(
                    f"the cache {self.cache} holds the progress of another run ({'; '.join(diff)}); "
                    "use the same arguments to continue it, another --cache, or --fresh to start over"
                )
            state = old
            state.run = state.run or secrets.token_hex(8)  # a state from before runs were named
        self._state = state
        self._recover_pending()
        self._check_budget(samples, self._adopt_delivered())
        self._start = state.delivered
        self.summary.total = len(self._view)
        self.summary.resumed_from = state.delivered
        if state.delivered < len(self._view):
            self._remove_end()
        state.save(self._state_path)
        self._open_stager(samples, endpoint)
        return self

    def _index(self) -> tuple[Sequence[Sample], str | None]:
        from .dataset import S5Dataset

        src, ep, gb = self.opts.source, self.opts.endpoint_url, self.opts.group_by
        if src.startswith("s3://") and not src.endswith((".jsonl", ".json")):
            ds = S5Dataset.from_prefix(src, endpoint_url=ep, group_by=gb)
        else:
            ds = S5Dataset.from_manifest(src, endpoint_url=ep, group_by=gb)
        log.info("%s: %d samples, %s", src, len(ds), format_size(ds.total_bytes))
        return ds.samples, ds.endpoint_url

    def _check_unused(self) -> None:
        ours = {LOCK_FILE, STAGING_DIR, END_MARKER, f"{STATE_FILE}.tmp", f".{END_MARKER}.tmp"}
        other = sorted(n for n in os.listdir(self.cache) if n not in ours)
        if other:
            raise DaemonError(
                f"the cache {self.cache} is not empty and holds no daemon state "
                f"({', '.join(other[:3])}{' ...' if len(other) > 3 else ''}); "
                "use an empty or new directory"
            )

    def _wipe(self) -> None:
        log.info("--fresh: removing the samples and state in %s", self.cache)
        for name in os.listdir(self.cache):
            path = os.path.join(self.cache, name)
            if parse_seq(name) is not None or name == STAGING_DIR:
                shutil.rmtree(path, ignore_errors=True)
            elif name in (STATE_FILE, END_MARKER, f"{STATE_FILE}.tmp", f".{END_MARKER}.tmp"):
                os.unlink(path)

    def _recover_pending(self) -> None:
        st = self._state
        assert st is not None
        p = st.pending
        if not p:
            return
        # The last daemon stopped between writing "pending" and recording the delivery.
        if os.path.isdir(p["from"]) and not os.path.exists(p["to"]):
            os.rename(p["from"], p["to"])
        st.delivered = max(st.delivered, int(p["seq"]) + 1)
        st.pending = None
        st.save(self._state_path)

    def _check_budget(self, samples: Sequence[Sample], held: int) -> None:
        budget = self.opts.budget
        largest = max(samples, key=lambda s: s.size)
        if largest.size > budget:
            raise BudgetError(
                f"sample {largest.key!r} ({', '.join(f.uri for f in largest.fields[:3])}) is "
                f"{format_size(largest.size)}, larger than the budget of {format_size(budget)}; "
                "raise --budget"
            )
        need = min(budget, sum(s.size for s in samples) * self.opts.epochs) - held
        free = free_bytes(self.cache)
        if need > free:
            raise BudgetError(
                f"the budget of {format_size(budget)} does not fit the {format_size(free)} free in "
                f"{self.cache}; lower --budget or free space"
            )

    def _adopt_delivered(self) -> int:
        """Count samples a previous run delivered and nobody consumed yet; their bytes."""
        total = 0
        for name in ready_names(self.cache):
            seq = parse_seq(name)
            assert seq is not None
            size = _tree_bytes(os.path.join(self.cache, name))
            self._ledger.add(seq, name, size)
            total += size
        if total:
            log.info("%d delivered samples (%s) wait in %s", self._ledger.count, format_size(total), self.cache)
        return total

    def _open_stager(self, samples: Sequence[Sample], endpoint: str | None) -> None:
        assert self._view is not None and self._state is not None
        staging = os.path.join(self.cache, STAGING_DIR)
        os.makedirs(staging, exist_ok=True)
        self._area = StagingArea(staging)
        self._area.create()
        options = StagerOptions(
            budget=self.opts.budget,
            samples_per_call=self.opts.samples_per_call,
            buffers=self.opts.buffers,
            on_error=self.opts.on_error,
        )
        s5 = S5cmd(endpoint, numworkers=self.opts.numworkers)
        order = range(self._state.delivered, len(self._view))
        self._stager = Stager(
            self._view, order, self._area, s5, options,
            is_released=self._ledger.is_released, endpoint_url=endpoint,
        )
        for seq, size in self._ledger.items():
            self._stager.hold(seq, size)
        json_out: IO[str] | None = None
        if self.opts.json_log == "-":
            json_out = sys.stdout
        elif self.opts.json_log:
            json_out = self._json_file = open(self.opts.json_log, "a", encoding="utf-8")  # noqa: SIM115
        bar = sys.stderr.isatty() if self.opts.progress is None else self.opts.progress
        self._reporter = _Reporter(self.opts.budget, len(self._view), bar, json_out)
        if bar:
            self._bar_filter = _ClearBar(self._reporter)
            for handler in logging.getLogger().handlers:
                handler.addFilter(self._bar_filter)

    # -- running ----------------------------------------------------------------------------
    def run(self) -> Summary:
        """Deliver samples until the source is exhausted or :attr:`stop` is set.

        Raises:
            S5LoaderError: staging failed (FetchError, StallError, StagingSpaceError, ...).
        """
        st, stager, rep = self._state, self._stager, self._reporter
        assert st is not None and stager is not None and rep is not None and self._view is not None
        rep.event(
            "start", source=self.opts.source, cache=self.cache, total=len(self._view),
            budget=self.opts.budget, resumed_from=st.delivered, pid=os.getpid(),
        )
        if st.delivered < len(self._view):
            log.info(
                "prefetching %d samples into %s (budget %s)%s",
                len(self._view) - st.delivered, self.cache, format_size(self.opts.budget),
                f", resuming at {st.delivered}" if st.delivered else "",
            )
        stager.start()
        for seq in range(st.delivered, len(self._view)):
            ready = self._await(seq)
            if ready is None:
                self.summary.stopped = True
                if st.pending is not None:  # the last delivery's rename is done
                    st.pending = None
                    st.save(self._state_path)
                break
            if ready:
                self._deliver(seq)
            else:
                self._skip(seq)
        else:
            self._finish()
        rep.tick(self._snapshot(), force=True)
        rep.close()
        end = "stopped" if self.summary.stopped else "done"
        rep.event(end, **self._snapshot(), starved=self.summary.starved, starved_s=round(self.summary.starved_s, 2))
        return self.summary

    def _await(self, seq: int) -> bool | None:
        """True when ``seq`` is staged, False when skipped, None when the daemon stops."""
        stager, pos = self._stager, seq - self._start
        assert stager is not None
        ready = stager.poll(pos, 0)
        if ready is not None:
            self._tick()
            return ready
        while True:  # behind the consumer, or ahead of it on a full budget
            if self.stop.is_set():
                return self._drain(pos)
            ready = stager.poll(pos, 0.1)
            if ready is not None or time.monotonic() - self._last_starve_check >= 0.1:
                self._check_starved(seq)
            self._tick()
            if ready is not None:
                return ready

    def _drain(self, pos: int) -> bool | None:
        """On stop: s5cmd is killed; what was completely staged in order is still delivered."""
        stager = self._stager
        assert stager is not None
        stager.close()
        return stager.poll(pos, 0)

    def _check_starved(self, seq: int) -> None:
        st = self._state
        assert st is not None
        self._last_starve_check = time.monotonic()
        self._ledger.refresh(force=True)
        if self._ledger.count or st.delivered - st.skipped == 0 or self._starving:
            return
        self._starving = time.monotonic()
        self.summary.starved += 1
        consumed = self._consumed()
        # Right after a restart the consumer has used up what the last run delivered while this
        # run's first s5cmd call is under way: an ordinary restart, not a slow source.
        catching_up = bool(self.summary.resumed_from) and self.summary.delivered < self.opts.samples_per_call
        assert self._reporter is not None
        self._reporter.event("starved", seq=seq, consumed=consumed, catching_up=catching_up)
        if catching_up:
            log.info(
                "catching up after a restart at sample %d: the consumer has consumed the samples "
                "delivered before it (%d in all) and waits for sample %d, which this run is fetching",
                self.summary.resumed_from, consumed, seq,
            )
            return
        now = time.monotonic()
        if now - self._last_starve_log > 30:
            self._last_starve_log = now
            log.warning(
                "starved: the consumer has consumed all %d delivered samples and waits for sample "
                "%d (%d starvation(s) so far); the source or the network is the bottleneck",
                consumed, seq, self.summary.starved,
            )

    def _deliver(self, seq: int) -> None:
        st, area, view = self._state, self._area, self._view
        assert st is not None and area is not None and view is not None
        sample = view[seq]
        name = sample_folder_name(seq, sample.key)
        src, dst = area.sample_dir(seq), os.path.join(self.cache, name)
        # the one write of this delivery: a restart completes the rename if it did not happen
        st.delivered, st.pending = seq + 1, {"seq": seq, "from": src, "to": dst}
        st.save(self._state_path)
        os.rename(src, dst)  # the sample appears complete, or not at all
        self._ledger.add(seq, name, sample.size)
        assert self._stager is not None
        self._stager.yielded(seq)
        self.summary.delivered += 1
        if self._starving:
            self.summary.starved_s += time.monotonic() - self._starving
            self._starving = 0.0

    def _skip(self, seq: int) -> None:
        st, view = self._state, self._view
        assert st is not None and view is not None
        st.delivered, st.skipped, st.pending = seq + 1, st.skipped + 1, None
        st.save(self._state_path)
        self.summary.skipped += 1
        self.summary.skipped_uris.append(view[seq].fields[0].uri)

    def _finish(self) -> None:
        st = self._state
        assert st is not None
        st.done, st.pending = True, None
        st.save(self._state_path)
        _write_atomic(
            os.path.join(self.cache, END_MARKER),
            json.dumps({"samples": st.delivered, "skipped": st.skipped, "run": st.run}) + "\n",
            tmp=os.path.join(self.cache, f".{END_MARKER}.tmp"),
        )
        log.info("all %d samples delivered to %s; wrote %s", st.delivered, self.cache, END_MARKER)

    def _remove_end(self) -> None:
        try:
            os.unlink(os.path.join(self.cache, END_MARKER))
        except FileNotFoundError:
            pass

    def _consumed(self) -> int:
        st = self._state
        assert st is not None
        return st.delivered - st.skipped - self._ledger.count

    def _snapshot(self) -> dict[str, Any]:
        st, stager = self._state, self._stager
        assert st is not None and stager is not None
        reserved = stager.reserved
        return {
            "delivered": st.delivered,
            "consumed": self._consumed(),
            "in_cache": self._ledger.count,
            "cache_bytes": reserved,
            "budget": self.opts.budget,
            "fetched_bytes": stager.stats.staged_bytes,
            "skipped": st.skipped,
        }

    def _tick(self) -> None:
        if self._reporter is not None:
            self._ledger.refresh()
            self._reporter.tick(self._snapshot())

    # -- closing ----------------------------------------------------------------------------
    def close(self) -> None:
        """Kill s5cmd, remove partially staged files, release the lock. Safe to call twice."""
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.close()
        area, self._area = self._area, None
        if area is not None:
            area.remove()
        if self._reporter is not None:
            self._reporter.close()
        bar_filter, self._bar_filter = self._bar_filter, None
        if bar_filter is not None:
            for handler in logging.getLogger().handlers:
                handler.removeFilter(bar_filter)
        f, self._json_file = self._json_file, None
        if f is not None:
            f.close()
        self._lock.release()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for fn in files:
            try:
                total += os.lstat(os.path.join(root, fn)).st_size
            except OSError:
                pass
    return total


# -- signals and the command line --------------------------------------------------------------
class _Interrupted(BaseException):
    """A stop signal arrived while nothing needed a clean stop (before the first sample)."""


class _Signals:
    """SIGTERM and SIGINT set :attr:`event`; while :attr:`interruptible`, they also raise."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.interruptible = True
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name
        self.event.set()
        if self.interruptible:
            raise _Interrupted()

    def __enter__(self) -> _Signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _DefaultsHelp(argparse.HelpFormatter):
    """Shows every option's default, except for required options and those without one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.required or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        default = "off" if action.default is False else "%(default)s"
        return f"{text} (default: {default})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="s5loader prefetch",
        formatter_class=_DefaultsHelp,
        description=(
            "Keep a local cache directory filled with samples from S3, up to a byte budget, "
            "for any consumer: each sample appears complete as a folder SEQUENCE-KEY/ (ls order "
            "is the delivery order), the consumer deletes it when done, END marks the end."
        ),
        epilog="exit codes: 0 done or stopped by SIGTERM/SIGINT, 1 error, 2 usage. See docs/daemon.md.",
    )
    p.add_argument("source", help="s3://bucket/prefix/, or a JSON Lines manifest (local path or s3 URI)")
    p.add_argument("--cache", required=True, help="the cache directory consumers read from")
    p.add_argument("--budget", required=True, type=size_arg, help="most bytes in the cache (e.g. 2GiB)")
    p.add_argument("--group-by", default="stem", choices=list(GROUP_BY), help="how objects form samples")
    p.add_argument("--shuffle", action="store_true", help="a seeded permutation per epoch")
    p.add_argument("--seed", type=int, default=0, help="the permutation's seed")
    p.add_argument("--epochs", type=positive_int, default=1, help="passes over the source")
    p.add_argument("--endpoint-url", help="the S3 endpoint (default: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL or S3_ENDPOINT_URL, else AWS)")
    p.add_argument("--samples-per-call", type=positive_int, default=1000, help="samples per s5cmd call")
    p.add_argument("--buffers", type=positive_int, default=2, help="s5cmd calls in flight")
    p.add_argument("--numworkers", type=positive_int, default=256, help="s5cmd --numworkers")
    p.add_argument("--on-error", default="raise", choices=list(ON_ERROR), help="a sample that cannot be fetched")
    p.add_argument("--fresh", action="store_true", help="discard the cache's samples and progress first")
    p.add_argument(
        "--json-log", nargs="?", const="-", metavar="PATH",
        help="write JSON lines of progress to PATH, or to stdout without PATH (default: none)",
    )
    bar = p.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None, help="always draw the bar (default: only when stderr is a terminal)")
    bar.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="never draw the bar")
    return p


def options_from_args(args: argparse.Namespace) -> PrefetchOptions:
    return PrefetchOptions(
        source=args.source, cache=args.cache, budget=args.budget, group_by=args.group_by,
        shuffle=args.shuffle, seed=args.seed, epochs=args.epochs, endpoint_url=args.endpoint_url,
        samples_per_call=args.samples_per_call, buffers=args.buffers, numworkers=args.numworkers,
        on_error=args.on_error, fresh=args.fresh, json_log=args.json_log, progress=args.progress,
    )


def main(argv: list[str] | None = None) -> int:
    """``s5loader prefetch``: returns the exit code (0 done or stopped by a signal).

    Raises:
        S5LoaderError: an error (``s5loader`` prints it and exits with 1).
        SystemExit: a usage error (exit code 2).
    """
    args = build_parser().parse_args(argv)
    opts = options_from_args(args)
    with _Signals() as signals:
        prefetcher = Prefetcher(opts, stop=signals.event)
        try:
            try:
                prefetcher.open()
            finally:
                signals.interruptible = False
            if signals.event.is_set():
                raise _Interrupted()
            summary = prefetcher.run()
        except _Interrupted:
            log.info("stopped by %s before the first delivery", signals.received)
            return EXIT_OK
        finally:
            prefetcher.close()
    if summary.stopped:
        log.info(
            "stopped by %s: %d samples delivered in this run, %d of %d in all; a restart continues",
            signals.received, summary.delivered,
            summary.resumed_from + summary.delivered + summary.skipped, summary.total,
        )
    else:
        log.info(
            "done: %d samples delivered in this run (%d skipped), starved %d time(s) for %.1fs",
            summary.delivered, summary.skipped, summary.starved, summary.starved_s,
        )
    return EXIT_OK

