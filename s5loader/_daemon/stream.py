"""The daemon's staging: the sampler's staging run over every epoch's order, one pass per epoch,
fed to the delivery loop as the samples are staged.

The daemon is one more front end of the run that :class:`~s5loader.S5Sampler` and
:class:`~s5loader.S5IterableDataset` use: the same order (a permutation per ``seed + epoch``,
``"block"`` windows, or a shard order that keeps as many shards open as the budget holds), the
same engine, the same shard passes (a shard staged whole and read by offset, its first shard
read while it downloads) and the same epoch cache. Delivery ``seq`` is position ``seq % n`` of
epoch ``seq // n`` (``n`` samples per epoch). A thread walks the passes and puts each position's
outcome in a queue (see :class:`~s5loader._sampling.feed.FeedHost`); the delivery loop takes
them with a timeout, so it watches its consumer and a stop request meanwhile.

What the consumer holds stays in the budget. A delivered raw-object sample (its staged folder,
moved) is held under ``-(seq + 1)`` until the ledger says the consumer deleted it, and the engine
finds the staged folders it moved out by looking (the daemon's engine polls, with a back-off,
instead of reading release events). Samples written out of tar shards are copies: the delivery
loop bounds what the consumer holds of them by the delivery window (see :func:`lift_layout`),
beside the engine's budget.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

from .._engine import Stager
from .._engine.counters import Metrics
from .._sampling.feed import INDEX, SKIP, FeedHost, Hello, local
from .._sampling.order import Order
from .._sampling.staging import HandOff, Staging, layout
from .._sampling.units import units_of
from .._staging.area import tree_bytes
from .._staging.epochcache import EpochCache, index_fingerprint
from .._staging.layout import StagingLayout
from .._util.platform import HOLE_BLOCK, punches_holes
from ..config import StagingOptions
from ..dataset import S5Dataset

log = logging.getLogger(__name__)
# figures that count on across the daemon's passes (its JSON log reports the run's)
_CUMULATIVE = (
    "fetched_bytes",
    "fetched_units",
    "retries",
    "skips",
    "get_requests",
    "head_requests",
    "list_requests",
)


class LiftLayout(NamedTuple):
    """The daemon's staging within its budget (see :func:`lift_layout`)."""

    room: int  # the budget its engine stages within
    window: int  # the window of its order (a block order's, or the shards a shard order keeps open)
    punch: bool  # a sample written out of a shard punches its bytes out of it
    counts: bool  # the order counts what each sample written out gives back
    delivery: int  # the bytes of written-out samples the consumer may hold; 0: no such bound
    sample: int  # a sample's bytes, about (what one more delivery adds to the window)


def lift_layout(
    dataset: S5Dataset, options: StagingOptions, shuffle: bool | str, epochs: int, root: str
) -> LiftLayout:
    """The daemon's staging within its budget: for raw objects, whose staged folders move into
    the cache, the engine's budget is all of it and counts what the consumer holds; over tar
    shards, whose samples are written out of them (a second copy of bytes the shard holds until
    they are punched out or the shard is done), the budget less a delivery window that bounds what
    the consumer holds of them (see :meth:`ShardUnits.delivery_window
    <s5loader._sampling.units.ShardUnits.delivery_window>`); a sample written out of a shard
    punches its bytes out of it where the file system below ``root`` can and no epoch cache keeps
    shards whole, and a ``shuffle=True`` order then counts that, whether or not the data set fits
    (the rule of the daemon's saved runs, which a restart continues).

    Raises:
        BudgetError: the budget cannot hold the largest shard beside the delivery window.
    """
    units = units_of(dataset)
    cached = bool(options.epoch_cache) and epochs > 1
    punch = not cached and punches_holes(root, HOLE_BLOCK)
    delivery = units.delivery_window(options.budget)
    room = options.budget - delivery
    counts = punch and units.frees_on_read(shuffle)
    window = layout(dataset, room, shuffle, root, cached)[0]
    return LiftLayout(room, window, punch, counts, delivery, units.sample_estimate())


class DaemonStream:
    """Every epoch of ``dataset`` in ``order``, staged below ``root`` within ``options.budget``.

    Args:
        dataset: the data set.
        options: the staging options (``epoch_cache``: bytes kept from one epoch for the next).
        order: the order (one rank: the daemon's).
        window: the ``shuffle="block"`` window, or a shard order's open shards.
        punch: a sample lifted out of a tar shard punches its bytes out of the shard (see
            :func:`lift_layout`).
        counts: the order counts what each sample lifted out gives back.
        epochs: how many epochs are delivered.
        root: the staging root (inside the daemon's cache).
        cache_root: where the epoch cache's folder lives (it survives restarts).
        released: whether the consumer deleted delivery ``seq`` (the ledger's answer).
        outstanding: the deliveries the consumer still holds, ``(seq, bytes)``: each pass's
            engine counts them from its start.
        windowed: a delivery window bounds the samples written out (see :func:`lift_layout`);
            the engine counts only those delivered beyond it (:meth:`hold_beyond`).
    """

    def __init__(
        self,
        dataset: S5Dataset,
        options: StagingOptions,
        order: Order,
        window: int,
        punch: bool,
        counts: bool,
        epochs: int,
        root: str,
        cache_root: str,
        released: Callable[[int], bool],
        outstanding: Callable[[], Iterable[tuple[int, int]]],
        windowed: bool = False,
    ) -> None:
        self.dataset = dataset
        self.epochs = epochs
        self.n = len(dataset)
        cached = bool(options.epoch_cache) and epochs > 1

        def is_released(key: int, layout: StagingLayout) -> bool:
            # a delivered sample: the consumer's; a staged one: gone from its pass folder
            return released(-key - 1) if key < 0 else not os.path.isdir(layout.sample_dir(key))

        # deliveries beyond the delivery window that the engine's budget counts: seq -> bytes
        self.overflow: dict[int, int] = {}

        def hold_outstanding(stager: Stager) -> None:
            for seq, size in outstanding():
                if not windowed or seq in self.overflow:
                    stager.hold(-seq - 1, size)

        self.staging = Staging.within(
            dataset,
            options,
            order,
            root,
            hand_off=HandOff(is_released, hold_outstanding),
            window=window,
            frees=punch,
            whole=cached,
            counts=counts,
        )
        self.run = self.staging.run
        if cached:  # kept across restarts, until END
            fingerprint = index_fingerprint(dataset.samples)
            self.staging.use_cache(EpochCache(cache_root, "daemon", fingerprint, keep=True))
        self.feed: FeedHost | None = None
        self._progress = threading.Condition()
        self._upto = 0
        self._before: collections.Counter[str] = collections.Counter()

    def plan(self, epoch: int, start: int) -> tuple[list[int], list[int] | None]:
        """Epoch ``epoch``'s order from position ``start`` on, and where its windows begin."""
        return self.staging.plan(epoch, start)

    def start(self, delivered: int) -> Iterator[tuple[str, Any]]:
        """Stage every delivery from ``delivered`` on; returns the messages of the delivery loop:
        ``(INDEX, staged index)``, ``(SKIP, None)``, then ``(END, None)`` or ``(ERROR, exc)``."""
        self.close()
        self._upto = delivered
        hello = Hello(0, 1, 0, 0, ())
        self.feed = FeedHost(
            f"s5loader-daemon-{secrets.token_hex(8)}", hello, lambda _: self._serve(delivered), lambda pos: 0
        ).start()
        return local(self.feed)

    def _serve(self, delivered: int) -> Iterator[tuple[int, tuple[str, Any]]]:
        epoch, start = divmod(delivered, self.n)
        seq = delivered
        while epoch < self.epochs:
            # a pass begins once the last one's samples are delivered: it removes that one's folder
            self._wait_delivered(seq)
            order, windows = self.plan(epoch, start)
            stream = self.staging.stage_order(order, windows, functools.partial(int, epoch), skips=True)
            for idx, staged in zip(order, stream, strict=True):
                yield seq, ((INDEX, staged) if staged is not None else (SKIP, idx))
                seq += 1
            last = self.run.passes.last_metrics
            if last is not None:  # the run's figures count on across its passes
                self._before.update({k: getattr(last, k) for k in _CUMULATIVE})
            epoch, start = epoch + 1, 0

    def metrics(self, epoch: int, samples: int) -> Metrics:
        """The figures of the run (see :class:`~s5loader._engine.counters.Metrics`): what it
        fetched, retried and skipped counts on across its passes, over ``samples`` in all."""
        now = self.run.metrics(epoch, samples)
        if self.run.passes.active is None:
            now = dataclasses.replace(now, **{k: 0 for k in _CUMULATIVE})  # the last pass's, counted already
        return dataclasses.replace(
            now, samples=samples, **{k: getattr(now, k) + self._before[k] for k in _CUMULATIVE}
        )

    def delivered(self, upto: int) -> None:
        """The delivery loop is done with every sample before ``upto`` (delivered or skipped)."""
        with self._progress:
            self._upto = upto
            self._progress.notify_all()

    def _wait_delivered(self, upto: int) -> None:
        with self._progress:
            while self._upto < upto and not (self.feed is not None and self.feed.stop.is_set()):
                self._progress.wait(0.2)

    def room_for(self, size: int, held: int, budget: int) -> bool:
        """Whether ``size`` more bytes fit: in the engine's budget while its pass stages; once
        the pass has staged everything (no engine to ask), in ``budget`` beside what is on disk
        below the staging root (its shards by size, punched or not) and the ``held`` bytes
        the consumer holds."""
        stager = self.run.passes.active
        if stager is None:
            return tree_bytes(self.run.area.root) + held + size <= budget
        budget_now = stager.budget
        with budget_now.cond:
            return budget_now.reserved + size <= budget_now.limit

    def hold_beyond(self, seq: int, size: int) -> None:
        """Count delivery ``seq``'s ``size`` bytes, written out beyond the delivery window,
        against the engine's budget until the consumer deletes it."""
        self.overflow[seq] = size
        stager = self.run.passes.active
        if stager is not None:
            stager.hold(-seq - 1, size)

    def beyond_held(self, released: Callable[[int], bool]) -> int:
        """The bytes of the deliveries beyond the window that the consumer still holds."""
        self.overflow = {seq: n for seq, n in self.overflow.items() if not released(seq)}
        return sum(self.overflow.values())

    def hand_on(self, index: int, seq: int, size: int) -> None:
        """Staged sample ``index`` becomes delivery ``seq``: once the engine sees its staged
        folder gone, its ``size`` bytes are held as the consumer's until the consumer deletes it
        (see :meth:`Budget.hand_on <s5loader._engine.budget.Budget.hand_on>`)."""
        stager = self.run.passes.active
        if stager is not None:
            stager.budget.hand_on(index, -seq - 1, size)

    def close(self) -> None:
        """Stop staging (kill s5cmd) and the thread that walks the passes. Safe to call twice."""
        feed, self.feed = self.feed, None
        if feed is not None:
            feed.stop.set()
            self.run.passes.close_active()
            feed.close()

    def remove(self, done: bool) -> None:
        """After :meth:`close`: remove the staging folders; the epoch cache goes once every epoch
        was delivered (``done``)."""
        cache = self.run.cache
        if cache is not None:
            cache.cache.keep = not done
        self.run.close()
        if cache is not None and done:
            with contextlib.suppress(OSError):  # not empty: another daemon's entries (it removes them)
                os.rmdir(cache.cache.root)
