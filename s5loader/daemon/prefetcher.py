"""The prefetcher: opens the cache, delivers samples in order as the engine stages them,
stops cleanly. See the package docstring for the cache layout."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from .._index.blocks import plan_blocks
from .._index.sample import Sample
from .._sampling.order import Order, block_window
from .._util.platform import require_linux
from .._util.uri import format_size
from ..dataset import S5Dataset
from ..engine import Stager
from ..exceptions import DaemonError
from ..s5cmd import S5cmd
from ..staging.area import StagingArea
from .delivery import Deliveries, StarvationWatch, Summary
from .epochcache import DaemonEpochCache, epoch_cache_room, open_epoch_cache
from .epochs import EpochSamples, index_fingerprint
from .lock import CacheLock, record_failure, take_cache, take_over
from .options import PrefetchOptions
from .progress import ProgressReporter, open_reporter
from .protocol import STAGING_DIR, STATE_FILE
from .shards import ShardDeliveries, Unpacker
from .state import (
    DaemonState,
    Ledger,
    adopt_delivered,
    check_cache_budget,
    check_unused,
    clear_staging,
    recover_pending,
    remove_end,
)

log = logging.getLogger(__name__)
# How long the delivery loop waits for the next sample before it looks at the consumer again:
# at first, and at most while nothing changes (a full cache whose consumer is away; a staged
# sample ends the wait at once, a stop signal within this long).
_WAIT = 0.25
_WAIT_MAX = 1.0


class PrefetchDaemon:
    """The prefetch daemon's work: open the cache, deliver samples, stop cleanly.

    Use as a context manager; :meth:`run` returns when every sample is delivered or
    ``stop`` is set. :meth:`close` (idempotent) kills s5cmd, removes partial files and
    releases the cache's lock; delivered samples stay for the consumer.
    """

    def __init__(
        self, options: PrefetchOptions, stop: threading.Event | None = None, lock: CacheLock | None = None
    ) -> None:
        require_linux("the prefetch daemon")
        self.opts = options
        self.cache = os.path.abspath(options.cache)
        self.stop = stop or threading.Event()
        self._lock = lock or CacheLock(self.cache)  # taken already by the command line
        self._state_path = os.path.join(self.cache, STATE_FILE)
        self._ledger = Ledger(self.cache)
        self._stager: Stager | None = None
        self._area: StagingArea | None = None
        self._view: Sequence[Sample] | None = None
        self._state: DaemonState | None = None
        self._reporter: ProgressReporter | None = None
        self._json_file: IO[str] | None = None
        self._start = 0
        self._shards: ShardDeliveries | None = None
        self._unpacker: Unpacker | None = None
        self._delivery: Deliveries | None = None
        self._epoch_cache: DaemonEpochCache | None = None
        self.summary = Summary()
        self._watch = StarvationWatch(self._ledger, self.summary, options.samples_per_call)

    # -- opening ----------------------------------------------------------------------------
    def open(self) -> PrefetchDaemon:
        """Lock the cache, build the index, check the budget, recover the last run's state.

        Raises:
            DaemonError: another daemon runs on the cache, or the cache holds something else.
            BudgetError: a sample larger than the budget, or a budget the disk cannot hold.
            S5LoaderError: the source cannot be listed.
        """
        if not self._lock.held:
            self._lock = take_cache(self.cache, self.opts.fresh)
        old = DaemonState.load(self._state_path)  # none after --fresh (take_cache wiped it)
        if old is None:
            check_unused(self.cache)  # again, under the lock
        take_over(self.cache)
        samples, listing, total, self._shards = _index(self.opts)
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
        clear_staging(self.cache)  # a stopped run's files, counted by no budget: gone before any fetch
        check_cache_budget(
            samples, self.opts.budget, self.opts.epochs, self.cache, adopt_delivered(self.cache, self._ledger),
            epoch_cache_room(self.opts, samples),
        )
        self._start = state.delivered
        self.summary.total = len(self._view)
        self.summary.resumed_from = state.delivered
        if state.delivered < len(self._view):
            remove_end(self.cache)
        state.save(self._state_path)
        self._open_stager()
        return self

    def _open_stager(self) -> None:
        assert self._view is not None and self._state is not None
        staging = os.path.join(self.cache, STAGING_DIR)
        os.makedirs(staging, exist_ok=True)
        self._area = StagingArea(staging)
        self._area.create()
        sh = self._shards
        # over shards: budget, calls and s5cmd workers counted in shards
        options = self.opts.stager_options() if sh is None else sh.engine_options(self.opts.stager_options(), self.opts.budget)
        s5 = S5cmd(access=self.opts.store, numworkers=options.s5cmd_workers)
        if sh is None:
            order: Sequence[int] = range(self._state.delivered, len(self._view))
            ec = self._epoch_cache = open_epoch_cache(self.opts, self.cache, self._view, self._state.index, self._area.path)
            self._stager = Stager(
                self._view, order, self._area, s5, options, kept=ec.open(self._state.delivered) if ec else None,
                is_released=self._ledger.is_released, access=self.opts.store,
            )
            self._stager.budget.on_release = ec.attach(self._stager.budget) if ec is not None else None
            for seq, size in self._ledger.items():
                self._stager.hold(seq, size)
        else:
            # The engine stages visits of shards (indices >= 0); a delivered sample is held
            # under -(seq + 1) until the consumer deletes its folder.
            area, ledger = self._area, self._ledger
            self._start = sh.visit_of(self._state.delivered) if self._state.delivered < len(sh) else len(sh.visits)
            self._stager = Stager(
                sh.visits, range(self._start, len(sh.visits)), area, s5, options,
                is_released=lambda k: ledger.is_released(-k - 1) if k < 0 else not os.path.isdir(area.sample_dir(k)),
                access=self.opts.store, first_call=1,
            )
            self._unpacker = Unpacker(sh, area.path, self.opts.on_error)
            for seq, size in self._ledger.items():
                self._stager.hold(-seq - 1, size)
        self._reporter, self._json_file = open_reporter(
            self.opts.budget, len(self._view), self.opts.json_log, self.opts.progress
        )
        self._delivery = Deliveries(
            self.cache, self._state_path, self._state, self._ledger, self.summary, self._view, self._area,
            self._unpacker, self._epoch_cache,
        )

    # -- running ----------------------------------------------------------------------------
    def run(self) -> Summary:
        """Deliver samples until the source is exhausted or :attr:`stop` is set.

        Raises:
            S5LoaderError: staging failed (FetchError, StallError, StagingSpaceError, ...).
        """
        st, stager, rep, delivery = self._state, self._stager, self._reporter, self._delivery
        assert st is not None and stager is not None and rep is not None and self._view is not None and delivery
        rep.event(
            "start", source=self.opts.source, cache=self.cache, total=len(self._view),
            epochs=self.opts.epochs, per_epoch=len(self._view) // self.opts.epochs,
            budget=self.opts.budget, epoch_cache=self.opts.epoch_cache, resumed_from=st.delivered, pid=os.getpid(),
        )
        if st.delivered < len(self._view):
            log.info(
                "prefetching %d samples into %s within a budget of %s%s",
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
                delivery.skip(seq)
        else:
            delivery.finish()
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
        ready = None if self.stop.is_set() else stager.poll(pos, 0)  # a stop is seen however fast samples come
        if ready is not None:
            self._tick()
            return ready
        wait, seen = _WAIT, None
        while True:  # behind the consumer, or ahead of it on a full budget
            if self.stop.is_set():
                return self._drain(pos)
            ready = stager.poll(pos, wait)
            if ready is not None or time.monotonic() - self._watch.last_check >= _WAIT:
                assert self._state is not None and self._reporter is not None
                self._watch.check(seq, self._state, self._consumed, self._reporter)
            self._tick()
            if ready is not None:
                return ready
            # Longer waits while neither the consumer nor the engine changes anything.
            now = (self._ledger.count, stager.reserved)
            wait = min(2 * wait, _WAIT_MAX) if now == seen else _WAIT
            seen = now

    def _drain(self, pos: int) -> bool | None:
        """On stop: s5cmd is killed; what was completely staged in order is still delivered."""
        stager = self._stager
        assert stager is not None
        stager.close()
        return stager.poll(pos, 0)

    def _deliver(self, seq: int) -> None:
        assert self._delivery is not None and self._stager is not None
        self._delivery.deliver(seq, self._stager)
        self._watch.fed()

    def _consumed(self) -> int:
        assert self._delivery is not None
        return self._delivery.consumed()

    def _snapshot(self) -> dict[str, Any]:
        st, stager = self._state, self._stager
        assert st is not None and stager is not None
        reserved = stager.reserved
        per_epoch = max(1, self.summary.total // max(1, self.opts.epochs))
        starving = self._watch.waiting_s()
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
            **(self._epoch_cache.figures(st.delivered) if self._epoch_cache is not None else {}),
        }

    def _tick(self) -> None:
        if self._reporter is not None:
            self._ledger.refresh()
            self._reporter.tick(self._snapshot())

    # -- closing ----------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> str:
        """Tell consumers that this daemon failed (:func:`.lock.record_failure`); the message."""
        return record_failure(self.cache, exc, self._lock, self.opts.json_log, self._reporter)

    def close(self) -> None:
        """Kill s5cmd, remove partially staged files, release the lock. Safe to call twice."""
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.close()
        if self._epoch_cache is not None:
            self._epoch_cache.close(done=self._state is not None and self._state.done)
        area, self._area = self._area, None
        if area is not None:
            area.remove()
        if self._reporter is not None:
            self._reporter.close()
        f, self._json_file = self._json_file, None
        if f is not None:
            f.close()
        self._lock.release()

    def __enter__(self) -> PrefetchDaemon:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, Exception):
            self.fail(exc)
        self.close()


def _index(opts: PrefetchOptions) -> tuple[Sequence[Sample], Sequence[str] | None, int, ShardDeliveries | None]:
    """The samples of ``opts.source``, the key listing they came from, their bytes, and (over
    tar shards) the deliveries of their shards."""
    src, store, gb = opts.source, opts.store, opts.group_by
    if opts.shards:
        sds = S5Dataset.from_shards(src, index=opts.index, access=store)
        assert sds.shards is not None
        order = Order(opts.shuffle, opts.seed, 1, 0, False)
        deliveries = ShardDeliveries(sds, order, opts.epochs)
        log.info("%s: %d samples in %d shards, %s", src, len(sds), len(sds.shards), format_size(sds.total_bytes))
        return sds.samples, None, sds.total_bytes, deliveries
    if src.startswith("s3://") and not src.endswith((".jsonl", ".json")):
        ds = S5Dataset.from_prefix(src, access=store, group_by=gb)
    else:
        ds = S5Dataset.from_manifest(src, access=store, group_by=gb)
    log.info("%s: %d samples, %s", src, len(ds), format_size(ds.total_bytes))
    return ds.samples, ds._listing, ds.total_bytes, None
