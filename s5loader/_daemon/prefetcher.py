"""The prefetcher: opens the cache, delivers samples in order as the shared staging run stages
them (see :mod:`.stream`), stops cleanly. See the package docstring for the cache layout."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import threading
import time
from dataclasses import replace
from typing import IO, Any

from .._index.blocks import GROW, block_count
from .._sampling.feed import ERROR, INDEX, SKIP
from .._sampling.order import Order
from .._sampling.units import units_of
from .._util.platform import require_linux
from .._util.uri import SHARD_SUFFIXES, format_size
from ..dataset import S5Dataset, StagedIndex
from ..exceptions import DaemonError
from .cache_state import (
    DaemonState,
    Ledger,
    adopt_delivered,
    check_cache_budget,
    check_unused,
    clear_staging,
    recover_pending,
    remove_end,
)
from .delivery import Deliveries, StarvationWatch, Summary
from .lock import CacheLock, record_failure, take_cache, take_over
from .prefetch_options import PrefetchOptions
from .protocol import EPOCH_DIR, STAGING_DIR, STATE_FILE
from .reporting import ProgressReporter, open_reporter
from .stream import DaemonStream, lift_layout

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
        self._stream: DaemonStream | None = None
        self._state: DaemonState | None = None
        self._reporter: ProgressReporter | None = None
        self._json_file: IO[str] | None = None
        self._delivery: Deliveries | None = None
        self._inbox: queue.SimpleQueue[tuple[str, Any]] | None = None
        self._total = 0
        self._delivery_window = 0  # bytes of written-out samples a consumer may hold (over tar shards)
        self._sample_estimate = 0
        self.summary = Summary()
        self._watch = StarvationWatch(self._ledger, self.summary, options.staging.samples_per_call)

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
        opts, staging = self.opts, self.opts.staging
        ds = _dataset(opts)
        staging_root = os.path.join(self.cache, STAGING_DIR)
        os.makedirs(staging_root, exist_ok=True)
        # as the sampler's window (a block order's, or the shards a shard order keeps open); a
        # restart keeps the saved one, whatever its budget
        lift = lift_layout(ds, staging, opts.shuffle, opts.epochs, staging_root)
        self._delivery_window, self._sample_estimate = lift.delivery, lift.sample
        state = _run_state(opts, ds, lift.window, old, self.cache)
        self._state = state
        self._total = len(ds) * opts.epochs
        recover_pending(state, self._state_path)
        clear_staging(self.cache)  # a stopped run's files, counted by no budget: gone before any fetch
        kept = min(staging.epoch_cache, ds.total_bytes) if opts.epochs > 1 else 0
        check_cache_budget(
            ds.samples,
            staging.budget,
            opts.epochs,
            self.cache,
            adopt_delivered(self.cache, self._ledger),
            kept,
        )
        self.summary.total = self._total
        self.summary.resumed_from = state.delivered
        if state.delivered < self._total:
            remove_end(self.cache)
        state.save(self._state_path)
        self._stream = DaemonStream(
            ds,
            replace(staging, budget=lift.room),
            Order(opts.shuffle, opts.seed, 1, 0, False),
            state.window or lift.window,
            lift.punch,
            lift.counts,
            opts.epochs,
            staging_root,
            os.path.join(self.cache, EPOCH_DIR),
            self._ledger.is_released,
            self._ledger.items,
            windowed=bool(lift.delivery),
        )
        if lift.delivery:  # a restart: what the last run delivered beyond the window counts in the budget
            kept = 0
            for seq, size in sorted(self._ledger.items()):
                kept += size
                if kept > lift.delivery:
                    self._stream.overflow[seq] = size
        self._reporter, self._json_file = open_reporter(
            staging.budget, self._total, opts.json_log, opts.progress
        )
        self._delivery = Deliveries(
            self.cache, self._state_path, state, self._ledger, self.summary, ds, self._stream
        )
        return self

    # -- running ----------------------------------------------------------------------------
    def run(self) -> Summary:
        """Deliver samples until the source is exhausted or :attr:`stop` is set.

        Raises:
            S5LoaderError: staging failed (FetchError, StallError, StagingSpaceError, ...).
        """
        st, stream, rep, delivery = self._state, self._stream, self._reporter, self._delivery
        assert st is not None and stream is not None and rep is not None and delivery is not None
        staging = self.opts.staging
        rep.event(
            "start",
            source=self.opts.source,
            cache=self.cache,
            total=self._total,
            epochs=self.opts.epochs,
            per_epoch=self._total // self.opts.epochs,
            budget=staging.budget,
            epoch_cache=staging.epoch_cache,
            resumed_from=st.delivered,
            pid=os.getpid(),
        )
        if st.delivered < self._total:
            log.info(
                "prefetching %d samples into %s within a budget of %s%s",
                self._total - st.delivered,
                self.cache,
                format_size(staging.budget),
                f", resuming at {st.delivered}" if st.delivered else "",
            )
        stream.start(st.delivered)
        assert stream.feed is not None
        self._inbox = stream.feed.inbox  # read on after a stop closed the feed: what it staged
        seq = st.delivered
        while seq < self._total:
            msg = self._next(seq)
            within: bool | None = True
            if msg is not None and msg[0] == INDEX and self._delivery_window:
                within = delivery.await_window(
                    self._delivery_window, self._sample_estimate, staging.budget, self.stop, self._tick
                )
                if within is None:
                    msg = None  # stopped while the consumer held the whole delivery window
            if msg is None:
                self.summary.stopped = True
                if st.pending is not None:  # the last delivery's rename is done
                    st.pending = None
                    st.save(self._state_path)
                break
            kind, payload = msg
            if kind == ERROR:
                raise payload
            if kind == INDEX:
                size = self._deliver(seq, payload)
                if not within:
                    stream.hold_beyond(seq, size)
            elif kind == SKIP:
                delivery.skip(seq, payload)
            seq += kind in (INDEX, SKIP)
            stream.delivered(seq)
        else:
            delivery.finish()
        rep.tick(self._snapshot(), force=True)
        rep.close()
        end = "stopped" if self.summary.stopped else "done"
        rep.event(
            end, **self._snapshot(), starved=self.summary.starved, starved_s=round(self.summary.starved_s, 2)
        )
        return self.summary

    def _next(self, seq: int) -> tuple[str, Any] | None:
        """The next message of the staging run (what became of ``seq``), or None once the daemon
        stops (what was staged in order before the stop is still delivered)."""
        stream, inbox = self._stream, self._inbox
        assert stream is not None and inbox is not None and self._state is not None and self._reporter
        msg: tuple[str, Any] | None = None
        if not self.stop.is_set():  # a stop is seen however fast samples come
            with contextlib.suppress(queue.Empty):
                msg = inbox.get_nowait()
        if msg is not None:
            self._tick()
            return msg
        wait, seen = _WAIT, None
        while True:  # behind the consumer, or ahead of it on a full budget
            if self.stop.is_set():
                stream.close()  # s5cmd killed; what is in the inbox was staged
                with contextlib.suppress(queue.Empty):
                    msg = inbox.get_nowait()
                return msg if msg is not None and msg[0] in (INDEX, SKIP) else None
            with contextlib.suppress(queue.Empty):
                msg = inbox.get(timeout=wait)
            if msg is not None or time.monotonic() - self._watch.last_check >= _WAIT:
                self._watch.check(seq, self._state, self._consumed, self._reporter)
            self._tick()
            if msg is not None:
                return msg
            # Longer waits while neither the consumer nor the engine changes anything.
            now = (self._ledger.count, self._reserved())
            wait = min(2 * wait, _WAIT_MAX) if now == seen else _WAIT
            seen = now

    def _deliver(self, seq: int, staged: StagedIndex) -> int:
        assert self._delivery is not None
        size = self._delivery.deliver(seq, staged)
        self._watch.fed()
        return size

    def _reserved(self) -> int:
        stager = self._stream.run.passes.active if self._stream is not None else None
        return stager.reserved if stager is not None else 0

    def _in_window(self) -> int:
        """The bytes of written-out samples the consumer holds within the delivery window (the
        engine's budget counts the rest)."""
        stream = self._stream
        if not self._delivery_window or stream is None:
            return 0
        return self._ledger.held - stream.beyond_held(self._ledger.is_released)

    def _consumed(self) -> int:
        assert self._delivery is not None
        return self._delivery.consumed()

    def _snapshot(self) -> dict[str, Any]:
        st, stream = self._state, self._stream
        assert st is not None and stream is not None
        per_epoch = max(1, self._total // max(1, self.opts.epochs))
        starving = self._watch.waiting_s()
        # The figures S5Sampler.metrics() gives, for this run of the daemon (positions count
        # on across epochs), then the daemon's own.
        epoch = min(st.delivered // per_epoch, self.opts.epochs - 1)
        metrics = stream.metrics(epoch, self._total)
        # the hits before the bytes: a hit the engine stops counting in between is then in
        # neither, never in the bytes alone (see Delivery.epoch_figures)
        delivery = self._delivery
        hits = delivery.epoch_figures(epoch) if stream.run.cache is not None and delivery is not None else {}
        figures = {
            **metrics.as_dict(),
            "position": st.delivered,
            "waited_s": round(self.summary.starved_s + starving, 3),
            "delivered": st.delivered,
            "consumed": self._consumed(),
            "in_cache": self._ledger.count,
            "cache_bytes": self._reserved() + self._in_window(),
            "budget": self.opts.staging.budget,
            "skipped": st.skipped,
        }
        figures.update(hits)
        return figures

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
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
            stream.remove(done=self._state is not None and self._state.done)
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


def _run_state(
    opts: PrefetchOptions, ds: S5Dataset, window: int, old: DaemonState | None, cache: str
) -> DaemonState:
    """The state of this run: the last run's (``old``) where it was made with the same
    arguments, so the run continues it, else a fresh one.

    Raises:
        DaemonError: ``old`` belongs to a run with other arguments; names the differences.
    """
    size = units_of(ds).block_size(opts.staging)
    state = DaemonState(
        opts.source,
        "shards" if opts.shards else opts.group_by,
        opts.shuffle,
        opts.seed,
        opts.epochs,
        len(ds),
        units_of(ds).fingerprint(),
        run=secrets.token_hex(8),
        block_size=opts.staging.block_size if opts.shuffle == "block" else None,
        window=window,
        block_rule=GROW if opts.shuffle == "block" else None,
    )
    if old is None:
        return state
    diff = old.differences(state, lambda: block_count(ds.samples, size, ds._listing)[1])
    if diff:
        raise DaemonError(
            f"the cache {cache} holds the progress of another run ({'; '.join(diff)}); "
            "use the same arguments to continue it, another --cache, or --fresh to start over"
        )
    old.run = old.run or secrets.token_hex(8)  # a state from before runs were named
    return old


def _dataset(opts: PrefetchOptions) -> S5Dataset:
    """The data set of ``opts.source``: tar shards (``--shards``), a prefix, or a manifest."""
    src, store = opts.source, opts.store
    if opts.shards:
        ds = S5Dataset.from_shards(src, index=opts.index, access=store)
    elif src.startswith("s3://") and not src.endswith((".jsonl", ".json")):
        ds = S5Dataset.from_prefix(src, access=store, group_by=opts.group_by)
        _hint_shards(ds, src)
    else:
        ds = S5Dataset.from_manifest(src, access=store, group_by=opts.group_by)
    log.info("%s: %r, %s", src, ds, format_size(ds.total_bytes))
    return ds


# Object keys looked at for the --shards hint: a folder of shards shows itself in its first ones.
_HINT_KEYS = 1000


def _hint_shards(ds: S5Dataset, source: str) -> None:
    """Warn when ``source``, given without ``--shards``, holds tar shards only: each shard would
    be delivered whole, as one sample with a ``tar`` field, where ``--shards`` delivers the
    samples inside them (a shard index such as ``wids.json`` beside them does not matter)."""
    keys = ds.samples.text[: min(_HINT_KEYS, len(ds.samples.text))]
    shards = sum(k.endswith(SHARD_SUFFIXES) for k in keys)
    if shards and all(k.endswith((*SHARD_SUFFIXES, ".json")) for k in keys):  # wids.json beside them
        log.warning(
            "%s holds tar shards (such as %s): without --shards each one is delivered whole, as one "
            "sample; pass --shards to deliver the samples inside them",
            source,
            ds.samples.field(0).uri,
        )
