"""The prefetcher: opens the cache, delivers samples in order as the engine stages them,
stops cleanly. See the package docstring for the cache layout."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import IO, Any

from .._blocks import plan_blocks
from .._index import GROUP_BY, Sample
from .._order import Order, block_window
from .._platform import require_linux
from .._uri import format_size
from ..config import Access, StagingOptions
from ..engine import Stager
from ..exceptions import ConfigError, DaemonError
from ..s5cmd import S5cmd
from ..staging.area import StagingArea
from .epochs import EpochSamples, index_fingerprint
from .progress import ProgressReporter, open_reporter
from .protocol import END_MARKER, KEY_FILE, STAGING_DIR, STATE_FILE, sample_folder_name
from .shards import ShardDeliveries, Unpacker
from .state import (
    CacheLock,
    DaemonState,
    Ledger,
    adopt_delivered,
    check_cache_budget,
    check_unused,
    recover_pending,
    remove_end,
    wipe,
    write_end,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefetchOptions:
    """What ``s5loader prefetch`` was asked to do (its command-line options).

    The staging options (``budget``, ``samples_per_call``, ``calls_in_flight``,
    ``s5cmd_workers``, ``block_size``, ``stall_timeout``, ``retries``, ``on_error``,
    ``verify``) have the names, defaults and checks of :class:`~s5loader.S5Sampler`'s:
    :meth:`stager_options` is the one :class:`~s5loader.StagingOptions` object, and
    ``shuffle`` takes ``True``, ``False`` or ``"block"`` as the sampler's does. ``access``
    (with ``endpoint_url`` folded in) says how the store is reached.
    """

    source: str
    cache: str
    budget: int
    group_by: str = "stem"
    shuffle: bool | str = False
    seed: int = 0
    epochs: int = 1
    endpoint_url: str | None = None
    samples_per_call: int = 1000
    calls_in_flight: int = 2
    s5cmd_workers: int = 256
    block_size: int = 64
    on_error: str = "raise"
    stall_timeout: float = 60.0
    retries: int = 3
    verify: bool = False
    fresh: bool = False
    json_log: str | None = None
    progress: bool | None = None  # None: a bar when stderr is a terminal
    access: Access | None = None
    shards: bool = False  # the source names tar shards (see .shards)
    index: str | None = None  # their wids shard index; default: wids.json beside them

    def __post_init__(self) -> None:
        if self.group_by not in GROUP_BY:
            raise ConfigError(f"group_by must be one of {', '.join(GROUP_BY)}; got {self.group_by!r}")
        if self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1, got {self.epochs}")
        if self.shuffle not in (True, False, "block"):
            raise ConfigError(f"shuffle must be True, False or 'block', got {self.shuffle!r}")
        object.__setattr__(self, "access", Access.coerce(self.access, self.endpoint_url))
        self.stager_options()  # checks the staging options as the sampler's are checked

    @property
    def store(self) -> Access:
        """How the store is reached (``access`` with ``endpoint_url`` folded in)."""
        assert self.access is not None
        return self.access

    def stager_options(self) -> StagingOptions:
        return StagingOptions(
            budget=self.budget,
            samples_per_call=self.samples_per_call,
            calls_in_flight=self.calls_in_flight,
            s5cmd_workers=self.s5cmd_workers,
            block_size=self.block_size,
            stall_timeout=self.stall_timeout,
            retries=self.retries,
            on_error=self.on_error,
            verify=self.verify,
        )


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
        self._ledger = Ledger(self.cache)
        self._stager: Stager | None = None
        self._area: StagingArea | None = None
        self._view: Sequence[Sample] | None = None
        self._state: DaemonState | None = None
        self._reporter: ProgressReporter | None = None
        self._json_file: IO[str] | None = None
        self._starving = 0.0
        self._last_starve_log = 0.0
        self._last_starve_check = 0.0
        self._start = 0
        self._shards: ShardDeliveries | None = None
        self._unpacker: Unpacker | None = None
        self._key_clash_warned = False
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
            check_unused(self.cache)  # before leaving a .lock in someone else's directory
        self._lock.acquire()
        if self.opts.fresh:
            remove_end(self.cache)  # first: a consumer must not take the old run's END for this run's
        old = DaemonState.load(self._state_path)
        if old is None:
            check_unused(self.cache)  # again, under the lock
        if self.opts.fresh:
            wipe(self.cache)
            old = None
        samples, listing, total = self._index()
        order = Order(self.opts.shuffle, self.opts.seed, 1, 0, False)
        units = None
        if self._shards is not None:
            count, fingerprint = len(self._shards.dataset), self._shards.fingerprint()
        else:
            if self.opts.shuffle == "block":
                units = plan_blocks(samples, self.opts.block_size, listing).units
            count, fingerprint = len(samples), index_fingerprint(samples)
        state = DaemonState(
            self.opts.source, "shards" if self.opts.shards else self.opts.group_by, self.opts.shuffle,
            self.opts.seed, self.opts.epochs, count, fingerprint, run=secrets.token_hex(8),
            block_size=self.opts.block_size if units is not None else None,
            # as the sampler's windows; a restart keeps the saved one, whatever its budget
            window=block_window(self.opts.budget, total / max(1, len(samples)),
                                self.opts.calls_in_flight) if units is not None else None,
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
        if self._shards is not None:
            self._view = self._shards
        else:
            self._view = EpochSamples(samples, order, self.opts.epochs, units, state.window or self.opts.samples_per_call)
        recover_pending(state, self._state_path)
        check_cache_budget(samples, self.opts.budget, self.opts.epochs, self.cache, adopt_delivered(self.cache, self._ledger))
        self._start = state.delivered
        self.summary.total = len(self._view)
        self.summary.resumed_from = state.delivered
        if state.delivered < len(self._view):
            remove_end(self.cache)
        state.save(self._state_path)
        self._open_stager()
        return self

    def _index(self) -> tuple[Sequence[Sample], Sequence[str] | None, int]:
        from ..dataset import S5Dataset

        src, store, gb = self.opts.source, self.opts.store, self.opts.group_by
        if self.opts.shards:
            from .._shardset import ShardDataset

            sds = S5Dataset.from_shards(src, index=self.opts.index, access=store)
            assert isinstance(sds, ShardDataset)
            order = Order(self.opts.shuffle, self.opts.seed, 1, 0, False)
            self._shards = ShardDeliveries(sds, order, self.opts.epochs)
            log.info("%s: %d samples in %d shards, %s", src, len(sds), len(sds.shards), format_size(sds.total_bytes))
            return sds.samples, None, sds.total_bytes
        if src.startswith("s3://") and not src.endswith((".jsonl", ".json")):
            ds = S5Dataset.from_prefix(src, access=store, group_by=gb)
        else:
            ds = S5Dataset.from_manifest(src, access=store, group_by=gb)
        log.info("%s: %d samples, %s", src, len(ds), format_size(ds.total_bytes))
        return ds.samples, ds._listing, ds.total_bytes

    def _open_stager(self) -> None:
        assert self._view is not None and self._state is not None
        staging = os.path.join(self.cache, STAGING_DIR)
        os.makedirs(staging, exist_ok=True)
        self._area = StagingArea(staging)
        self._area.create()
        options = self.opts.stager_options()
        s5 = S5cmd(access=self.opts.store, numworkers=options.s5cmd_workers)
        sh = self._shards
        if sh is None:
            order: Sequence[int] = range(self._state.delivered, len(self._view))
            self._stager = Stager(
                self._view, order, self._area, s5, options,
                is_released=self._ledger.is_released, endpoint_url=self.opts.store,
            )
            for seq, size in self._ledger.items():
                self._stager.hold(seq, size)
        else:
            # The engine stages visits of shards (indices >= 0); a delivered sample is held
            # under -(seq + 1) until the consumer deletes its folder.
            options = replace(options, budget=sh.check_budget(self.opts.budget))
            area, ledger = self._area, self._ledger
            self._start = sh.visit_of(self._state.delivered) if self._state.delivered < len(sh) else len(sh.visits)
            self._stager = Stager(
                sh.visits, range(self._start, len(sh.visits)), area, s5, options,
                is_released=lambda k: ledger.is_released(-k - 1) if k < 0 else not os.path.isdir(area.sample_dir(k)),
                endpoint_url=self.opts.store,
            )
            self._unpacker = Unpacker(sh, area.path, self.opts.on_error)
            for seq, size in self._ledger.items():
                self._stager.hold(-seq - 1, size)
        self._reporter, self._json_file = open_reporter(
            self.opts.budget, len(self._view), self.opts.json_log, self.opts.progress
        )

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
        if self._shards is not None:
            ready = self._await_shard(seq)
            if ready and self._unpacker is not None and not self._unpacker.open(self._shards.visit_of(seq)):
                return False
            return ready
        return self._await_pos(seq, pos)

    def _await_shard(self, seq: int) -> bool | None:
        assert self._shards is not None and self._stager is not None
        v = self._shards.visit_of(seq)
        fresh = self._unpacker is not None and self._unpacker.visit != v
        ready = self._await_pos(seq, v - self._start)
        if ready and fresh:
            self._stager.yielded(v)  # the shard is freed once its folder is gone
        return ready

    def _await_pos(self, seq: int, pos: int) -> bool | None:
        stager = self._stager
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
        if self._unpacker is not None:
            src, key, size = self._unpacker.unpack(seq)
        else:
            src, key, size = area.sample_dir(seq), sample.key, sample.size
        name = sample_folder_name(seq, key)
        dst = os.path.join(self.cache, name)
        self._write_key(src, key)
        # the one write of this delivery: a restart completes the rename if it did not happen
        st.delivered, st.pending = seq + 1, {"seq": seq, "from": src, "to": dst}
        st.save(self._state_path)
        os.rename(src, dst)  # the sample appears complete, or not at all
        self._ledger.add(seq, name, size)
        assert self._stager is not None
        if self._unpacker is not None:
            self._stager.hold(-seq - 1, size)
        else:
            self._stager.yielded(seq)
        self.summary.delivered += 1
        if self._starving:
            self.summary.starved_s += time.monotonic() - self._starving
            self._starving = 0.0

    def _write_key(self, folder: str, key: str) -> None:
        """The sample's full key into its folder, before the folder is renamed into place (a
        control file of a few bytes, not counted in the budget)."""
        path = os.path.join(folder, KEY_FILE)
        if os.path.lexists(path):  # a field of the sample has that name
            if not self._key_clash_warned:
                self._key_clash_warned = True
                log.warning("sample %r has a field named %s; its folders carry no %s file", key, KEY_FILE, KEY_FILE)
            return
        with open(path, "w", encoding="utf-8") as f:
            f.write(key)

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
        write_end(self.cache, st)
        log.info("all %d samples delivered to %s; wrote %s", st.delivered, self.cache, END_MARKER)

    def _consumed(self) -> int:
        st = self._state
        assert st is not None
        return st.delivered - st.skipped - self._ledger.count

    def _snapshot(self) -> dict[str, Any]:
        st, stager = self._state, self._stager
        assert st is not None and stager is not None
        reserved = stager.reserved
        per_epoch = max(1, self.summary.total // max(1, self.opts.epochs))
        starving = time.monotonic() - self._starving if self._starving else 0.0
        # The figures S5Sampler.metrics() gives, for this run of the daemon (positions count
        # on across epochs), then the daemon's own.
        metrics = stager.metrics(
            epoch=min(st.delivered // per_epoch, self.opts.epochs - 1), position=st.delivered,
            samples=self.summary.total, waited_s=self.summary.starved_s + starving,
        )
        return {
            **metrics.as_dict(),
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
        f, self._json_file = self._json_file, None
        if f is not None:
            f.close()
        self._lock.release()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
