"""One staging run: a staging area, its passes, the position in the current order, and the report
at the end of each pass. :class:`~s5loader.S5Sampler` holds one for its rank's part of each
epoch; each DataLoader worker of :class:`~s5loader.S5IterableDataset` holds one for its own part.
Neither reaches into the other: both compose this."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import weakref
from collections.abc import Callable, Generator
from typing import Any

from .._engine import Stats
from .._engine.counters import Metrics, PassReport
from .._index.blocks import BlockPlan, plan_blocks
from .._s5cmd import S5cmd
from .._staging.area import StagingArea, register_cleanup
from ..config import StagingOptions
from ..dataset import S5Dataset, StagedIndex
from .cacherun import CacheRun
from .passes import READERS, HandOff, StagingPasses
from .resume import Position
from .units import units_of

log = logging.getLogger("s5loader.sampler")


class StagingRun:
    """Stages orders of ``dataset`` below ``root`` within ``options.budget``.

    Args:
        dataset: the data set whose samples are staged.
        options: the checked staging options (budget, calls, retries, error policy, ...).
        root: the staging root; the run's own directory is made below it on the first pass.
        keep: keep staged files across passes (``keep_staged``).
        frees: the orders staged count what their samples free as they are read (over tar
            shards, see :meth:`~s5loader._sampling.units.ShardUnits.order_cost`).
        hand_off: how its staged samples leave it (see :class:`~.passes.HandOff`).
    """

    def __init__(
        self,
        dataset: S5Dataset,
        options: StagingOptions,
        root: str,
        keep: bool = False,
        frees: bool = False,
        hand_off: HandOff = READERS,
    ) -> None:
        self.dataset = dataset
        self.cache: CacheRun | None = None  # the epoch cache, if any (see Staging.use_cache)
        self.options = options
        self.units = units = units_of(dataset)
        self.blocks: BlockPlan = plan_blocks(dataset.samples, units.block_size(options), dataset._listing)
        self.s5cmd = S5cmd(access=dataset.access, numworkers=units.s5cmd_workers(options))
        self.area = StagingArea(root)
        self.position = Position()
        self.passes = StagingPasses(dataset, self.area, self.s5cmd, self.blocks, keep, frees, hand_off)
        self._reporter = PassReport(log)
        collect_abandoned()

    def stage(
        self,
        order: list[int],
        windows: list[int] | None,
        shuffle: bool | str,
        epoch: Callable[[], int],
        skips: bool = False,
        early: bool = False,
    ) -> Generator[StagedIndex | None, None, None]:
        """Stage ``order`` in a new pass and yield each index once its files are staged,
        counting them in :attr:`position` (skipped samples are counted, not yielded; with
        ``skips``, yielded as None); with ``early`` (a DataLoader's reader waits), one not
        staged yet at once (see :mod:`~s5loader._sampling.early`)."""
        self.area.create()
        register_cleanup(self)
        _RUNS.add(self)
        # The earlier passes' folders go now, not when they were abandoned: DataLoader workers
        # read their queued samples (persistent workers do so in iter(loader), before this
        # pass begins), and those reads must find their files.
        self.drop_replaced()

        def report(stats: Stats, elapsed: float, finished: bool) -> None:
            self.report(stats, elapsed, finished, epoch())

        yield from self.passes.run(
            order, windows, self.options, shuffle, self.position, epoch, report, self.cache, skips, early
        )

    def drop_replaced(self) -> None:
        """Remove the folders of earlier passes; what their readers handed back for the epoch
        cache, and hits nobody read, go to the cache first."""
        if self.cache is not None:
            for where in self.passes.replaced:
                self.cache.collect(where.path)
        self.passes.remove_replaced()

    def report(self, stats: Stats, elapsed: float, finished: bool, epoch: int) -> None:
        """Log what a pass did, and "data starvation" where the loader waited for it."""
        self._reporter.report(stats, elapsed, finished, epoch, self.options)

    def metrics(self, epoch: int, samples: int) -> Metrics:
        m = self.passes.metrics(epoch, self.position.yielded, samples, self.options.budget)
        if self.cache is None:
            return m
        return dataclasses.replace(m, epoch_cache_hits=self.cache.hits, epoch_cache_bytes=self.cache.held)

    def close(self) -> None:
        """Stop staging, kill s5cmd, remove the staging directory (and leave the epoch cache).
        Safe to call twice."""
        if self.cache is not None:
            stager = self.passes.active
            self.passes.close_active()
            for where in self.passes.replaced:
                self.cache.collect(where.path)  # what was handed back, and hits not read
            if stager is not None and self.cache.cache.keep:
                # staged and not read: a run that resumes from the kept cache takes them there
                self.cache.keep_staged(stager.area.path, stager.ready_indices())
            self.cache.close()
        self.passes.close()
        self.area.remove()

    def _abort(self) -> None:
        """On SIGTERM: kill s5cmd and remove the staging directory, taking no lock."""
        self.passes.abort()
        if self.cache is not None:
            self.cache.close()
        self.area.remove()

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()  # the running pass stays behind (see StagingPasses)


# The runs of this process that staged (held weakly), for collect_abandoned.
_RUNS: weakref.WeakSet[StagingRun] = weakref.WeakSet()


def collect_abandoned() -> None:
    """Run Python's cycle collector when a run of this process has a pass under way.

    A sampler whose DataLoader raised (a transform failing in a worker) is not freed when the
    program drops it: torch re-raises the worker's error from a frame that holds it, so the
    error, its traceback, the loader's iterator and through it the sampler form a reference
    cycle, and its pass goes on staging until the cycle collector runs, which can be long. A
    new run (a notebook's next try) collects such cycles first, so their samplers close
    instead of piling up staged files; a pass still in use loses nothing (its sampler is
    reachable).
    """
    if any(run.passes.active is not None for run in list(_RUNS)):
        gc.collect()


def _forget_after_fork() -> None:
    _RUNS.clear()  # a forked DataLoader worker owns none of its parent's runs


os.register_at_fork(after_in_child=_forget_after_fork)
