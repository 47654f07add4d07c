"""A sampler's staging passes: each stages one order into a folder of its own and yields the
indices whose files are staged, in order.

A pass runs a :class:`~s5loader._engine.Stager` on the pass's units (:mod:`.units`: samples of
raw objects, or the shard visits of a :class:`~s5loader._shards.shardpass.ShardPass`). When a pass ends, is
abandoned or is replaced by a newer one, its folder is not removed at once: DataLoader workers
may still read its queued samples, so the next pass, ``close()`` or exit removes it. With
``keep_staged`` every pass stages into one folder whose files outlive the pass.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from .._engine import Stager, Stats
from .._engine.callplan import write_plan_files
from .._engine.counters import Metrics
from .._engine.stager import close_off_engine
from .._index.blocks import BlockPlan
from .._s5cmd import S5cmd
from .._staging.area import PassArea, StagingArea
from .._staging.layout import StagingLayout
from .._staging.plainindex import plain_reads
from ..config import StagingOptions
from ..dataset import S5Dataset, StagedIndex
from .cacherun import CacheRun, Hits
from .early import EARLY
from .resume import Position
from .units import PassUnits, units_of


class HandOff(NamedTuple):
    """How the samples of a staging run leave it, a parameter of the run: by default
    (:data:`READERS`) each reader of a staged sample reads and deletes it and writes its index to
    the pass's release FIFO, which the engine reads as an event. A front end whose consumer
    releases samples its own way (the prefetch daemon's, which moves each staged folder into its
    cache) gives ``released``: whether key ``k`` of a pass (a folder of its :class:`StagingLayout`)
    is released, which the engine then looks up instead of reading events; and ``on_stager``:
    what each pass's engine is told when it is made (the bytes the consumer still holds)."""

    released: Callable[[int, StagingLayout], bool] | None = None
    on_stager: Callable[[Stager], None] | None = None


READERS = HandOff()


class StagingPasses:
    """The passes of one sampler below its :class:`StagingArea`: the one running, the folders
    of earlier ones awaiting removal, the indices kept staged, and the last pass's figures."""

    def __init__(
        self,
        dataset: S5Dataset,
        area: StagingArea,
        s5cmd: S5cmd,
        layout: BlockPlan,
        keep: bool,
        frees: bool = False,
        hand_off: HandOff = READERS,
    ) -> None:
        self.dataset = dataset
        self.hand_off = hand_off
        self.frees = frees  # orders count what samples free as they are read (see ShardUnits.order_cost)
        self.area = area
        self.s5cmd = s5cmd
        self.layout = layout
        self.keep = keep
        self.count = 0  # passes made; each stages into a folder of its own
        self.replaced: list[StagingArea] = []  # folders of earlier passes, removed by the next
        self.kept: set[int] = set()
        self.active: Stager | None = None
        self.units: PassUnits | None = None  # the running pass's units (a download of its own to stop)
        self.last_stats: Stats | None = None
        self.last_metrics: Metrics | None = None

    def run(
        self,
        order: list[int],
        windows: list[int] | None,
        options: StagingOptions,
        shuffle: bool | str,
        position: Position,
        epoch: Callable[[], int],
        report: Callable[[Stats, float, bool], None],
        cache: CacheRun | None = None,
        skips: bool = False,
        early: bool = False,
    ) -> Iterator[StagedIndex | None]:
        """Stage ``order`` (shuffled as ``shuffle`` says) and yield its staged indices, counting
        them in ``position``; a skipped sample is counted but not yielded (``skips``: yielded as
        None, so that every position yields). ``report`` gets the pass's figures at its end.
        With an epoch ``cache``, its hits are not fetched and the samples it keeps are handed
        back by their readers. With ``early``, an index not staged yet goes out at once, its
        reader to wait for it (:mod:`.early`)."""
        where, units, stager, hits, back = self._open(order, windows, options, shuffle, epoch(), cache, early)
        keep, later = self.keep, units.streams_first
        self.active, self.units = stager, units
        position.yielded = 0
        position.pass_len = len(order)
        t0 = time.monotonic()
        finished = False
        try:
            for pos, idx in enumerate(order):
                ok = units.take(pos, stager)
                if later:
                    stager.start()
                    later = False
                position.yielded += 1  # a skipped sample still counts as consumed
                if ok:
                    back_unit = hits is not None and bool(back) and hits.keeps(units.unit_of(idx))
                    yield StagedIndex(idx, where.path, keep, back_unit, self.frees, ok is EARLY)
                elif skips:
                    yield None
            units.finish(stager)
            finished = True
        finally:
            units.close()
            superseded = self.active is not stager  # a newer pass owns the sampler now
            close_off_engine(stager.close)  # a generator closed by a collector on the engine's thread
            if not superseded:
                self.active = None
            stager.stats.plain_indices = plain_reads(where.path)
            self.last_stats = stager.stats
            self.last_metrics = stager.metrics(epoch=epoch(), position=position.yielded)
            if keep:
                self.kept.update(stager.ready_indices())
            elif not superseded:
                # Finished or abandoned (break, exception): the next pass, close() or exit
                # removes this pass's folder once no worker can still be reading from it.
                self.replaced.append(where)
            if finished and not superseded:
                position.epoch_done = True
            if cache is not None:
                cache.end_pass(epoch())
            report(stager.stats, time.monotonic() - t0, finished)

    def _open(
        self,
        order: list[int],
        windows: list[int] | None,
        options: StagingOptions,
        shuffle: bool | str,
        epoch: int,
        cache: CacheRun | None,
        early: bool,
    ) -> tuple[PassArea, PassUnits, Stager, Hits | None, frozenset[int]]:
        """A new pass over ``order``: its folder, its units, its engine (started, unless the
        first unit streams) and the units the epoch cache keeps (handed back by their readers)."""
        where = self._new_pass()
        hits, back = (
            cache.begin_pass(epoch, order, where.path, self.frees)
            if cache is not None
            else (None, frozenset())
        )
        keep = self.keep
        units = units_of(self.dataset).open_pass(
            order, where.path, keep, options, shuffle, self.frees, hits, early
        )
        released, folders = self.hand_off.released, StagingLayout(where.path)
        stager = Stager(
            self.dataset.samples,
            units.engine_order,
            where,
            self.s5cmd,
            units.engine_options(options),
            kept=self.kept if keep else units.engine_kept(hits),
            access=self.dataset.access,
            layout=self.layout,
            windows=units.engine_windows(windows),
            first_call=units.first_call,
            first_workers=units.first_workers,
            is_released=(lambda k: released(k, folders)) if released is not None else None,
        )
        if self.hand_off.on_stager is not None:
            self.hand_off.on_stager(stager)
        units.start(stager, options)
        if cache is not None:
            stager.budget.on_release = cache.on_release
        # a pass whose first unit streams starts the engine once that unit gave its first sample
        if not units.streams_first:
            stager.start()
        return where, units, stager, hits, back

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "active": None}  # a copy in another process runs no pass

    def stats(self) -> Stats | None:
        """What the running pass did so far, else the last one."""
        stager = self.active
        if stager is None:
            return self.last_stats
        stager.stats.plain_indices = plain_reads(stager.area.path)
        return stager.stats

    def metrics(self, epoch: int, position: int, samples: int, budget: int) -> Metrics:
        """The running pass's figures, else the last pass's as it ended, else zeros."""
        stager = self.active
        if stager is not None:
            return stager.metrics(epoch=epoch, position=position)
        if self.last_metrics is not None:
            return self.last_metrics
        return Metrics(epoch=epoch, samples=samples, budget=budget)

    def _new_pass(self) -> PassArea:
        if self.keep:
            where = PassArea(self.area, "kept")  # one folder: its files outlive the pass
        else:
            self.count += 1
            where = PassArea(self.area, f"p{self.count}")
        where.create()
        return where

    def remove_replaced(self) -> None:
        replaced, self.replaced = self.replaced, []
        for where in replaced:
            where.remove()

    def close_active(self) -> None:
        """Stop the running pass; its folder goes with the next :meth:`remove_replaced`."""
        stager, self.active = self.active, None
        units, self.units = self.units, None
        if units is not None:
            units.close()
        if stager is not None:
            stager.close()
            if not self.keep:
                self.replaced.append(stager.area)

    def close(self) -> None:
        self.close_active()
        self.kept.clear()
        self.replaced.clear()

    def abort(self) -> None:
        """On SIGTERM: kill s5cmd and stop a shard's download, taking no lock."""
        stager, units = self.active, self.units
        if units is not None:
            units.stop()
        if stager is not None:
            stager.abort()


def write_command_files(
    dataset: S5Dataset,
    order: list[int],
    windows: list[int] | None,
    layout: BlockPlan,
    options: StagingOptions,
    directory: str,
) -> list[str]:
    """Write the command files that stage ``order`` into ``directory`` as a pass would (see
    ``S5Sampler.write_command_files``), without running them; returns their paths in order."""
    os.makedirs(directory, exist_ok=True)
    stage = os.path.abspath(directory)
    # over shards: a line per shard visit
    units = units_of(dataset).open_pass(order, stage, False, options, None)
    return write_plan_files(
        dataset.samples,
        units.engine_order,
        units.engine_windows(windows),
        layout,
        units.engine_options(options).samples_per_call,
        stage,
    )
