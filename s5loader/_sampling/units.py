"""What a data set stages, as the set-up, the engine and the pass loop ask it: its units.

A data set of raw objects stages samples (each its objects, or a block's by one wildcard line);
a data set of tar shards stages whole shards and opens each for the readers. Everything that
differs between the two is asked of one object, never checked by hand:

* :func:`units_of` gives the data set's kind (:class:`ObjectUnits` or :class:`ShardUnits`): the
  checks of the options against it, the order's window (a block order's window, or the shards
  a shard order keeps open), the block size and s5cmd's workers of its runs, whether a batch
  must fit the budget, and how an iterable's workers split a rank's part;
* its ``open_pass`` gives the units of one pass (:class:`ObjectPass` or
  :class:`~s5loader._shards.passes.ShardPass`), so the pass loop
  (:meth:`StagingPasses.run <s5loader._sampling.passes.StagingPasses.run>`) has one path: which
  order the engine stages, with which options, what it must not fetch, where calls may be cut,
  how big the first call is, and whether the sample at a position can be yielded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from .._index.blocks import BlockPlan
from .._shards.passes import ShardPass
from .._util.uri import format_size
from ..config import StagingOptions
from ..dataset import S5Dataset
from ..engine import Stager
from ..exceptions import BudgetError, ConfigError
from .early import EARLY, Early, EarlyHandOut, early_hand_out
from .order import block_window, open_shards

SHARD_WORKERS = 4  # tar shards of a call downloading at once


class PassUnits(Protocol):
    """The units of one pass (see the module docstring)."""

    @property
    def engine_order(self) -> Sequence[int]:
        """What the engine stages, in order."""
        ...

    @property
    def first_call(self) -> int:
        """Units in the engine's first call (then twice, four times as many...)."""
        ...

    @property
    def streams_first(self) -> bool:
        """The first unit is read while it downloads, outside the engine: the engine starts
        once it gave its first sample, so the first batch does not share the link with calls."""
        ...

    def engine_options(self, options: StagingOptions) -> StagingOptions: ...

    def engine_kept(self, hits: set[int] | None) -> set[int] | None: ...

    def engine_windows(self, windows: list[int] | None) -> list[int] | None: ...

    def start(self, stager: Stager, options: StagingOptions) -> None: ...

    def take(self, pos: int, stager: Stager) -> bool | Early:
        """Whether the sample at ``pos`` is handed out (False: skipped); :data:`EARLY` when
        it is handed out before it is staged, its reader to wait for it."""
        ...

    def finish(self, stager: Stager) -> None: ...

    def close(self) -> None: ...

    def stop(self) -> None: ...


class ObjectPass:
    """A pass over raw objects: the engine stages the order itself, a sample is yielded once
    its files are staged (a consumer then holds it until it releases it), or for a DataLoader's
    reader (``early``) at once, before (:mod:`.early`)."""

    first_call = 32
    streams_first = False

    def __init__(self, order: Sequence[int], keep: bool, early: bool = False) -> None:
        self.engine_order = order
        self.keep = keep
        self.hands_out_early = early
        self.early: EarlyHandOut | None = None

    def engine_options(self, options: StagingOptions) -> StagingOptions:
        return options

    def engine_kept(self, hits: set[int] | None) -> set[int] | None:
        return hits  # an epoch cache's hits: staged already, not fetched

    def engine_windows(self, windows: list[int] | None) -> list[int] | None:
        return windows

    def start(self, stager: Stager, options: StagingOptions) -> None:
        self.early = early_hand_out(stager, options, self.keep) if self.hands_out_early else None

    def take(self, pos: int, stager: Stager) -> bool | Early:
        if self.early is not None and self.early.take(pos, self.engine_order[pos]):
            return EARLY
        if not stager.wait(pos):
            return False  # skipped
        if not self.keep:
            stager.yielded(self.engine_order[pos])
        return True

    def finish(self, stager: Stager) -> None:
        if self.early is not None:
            self.early.finish()

    def close(self) -> None:
        if self.early is not None:
            self.early.close()

    def stop(self) -> None:
        pass


class ObjectUnits:
    """A data set of raw objects: a unit is a sample's objects, a block of samples sharing a key
    prefix is fetched with one wildcard line, and a DataLoader batch of samples is held at once."""

    name = "sample"
    sharded = False  # the order is a permutation of samples (Order.indices)
    holds_batches = True  # the budget must hold a batch of the largest samples
    worker_runs = False  # an iterable's workers take every num_workers-th sample of the rank's part

    def __init__(self, dataset: S5Dataset) -> None:
        self.dataset = dataset

    def check(self, options: StagingOptions) -> None:
        """Raise for options this kind of data set cannot stage."""

    def window(self, budget: int, calls_in_flight: int, shuffle: bool | str) -> int:
        """``shuffle="block"``'s window (samples shuffled together; see :func:`block_window`)."""
        ds = self.dataset
        return block_window(budget, ds.total_bytes / max(1, len(ds)), calls_in_flight)

    def block_size(self, options: StagingOptions) -> int:
        return options.block_size

    def order_units(self, blocks: BlockPlan) -> list[list[int]]:
        """What a ``shuffle="block"`` order permutes: the key-prefix blocks of samples."""
        return blocks.units

    def s5cmd_workers(self, options: StagingOptions) -> int:
        return options.s5cmd_workers

    def open_pass(
        self, order: Sequence[int], folder: str, keep: bool, options: StagingOptions, shuffle: bool | str | None,
        frees: bool = False, early: bool = False,
    ) -> PassUnits:
        """The units of a pass of ``order`` (``frees``: over tar shards, the order counts the
        bytes its samples free as they are read, see :meth:`ShardUnits.order_cost`; ``early``:
        samples not staged yet go out at once, see :mod:`.early`)."""
        return ObjectPass(order, keep, early)


class ShardUnits(ObjectUnits):
    """A data set of tar shards: a unit is a shard, staged whole by one ``cp --raw`` line and
    counted whole in the budget; a shard order keeps as many shards open as the budget holds,
    and an iterable's worker takes a contiguous run of shards, which it alone stages."""

    name = "tar shard"
    sharded = True  # shuffle True / False give shard orders (Order.shard_order)
    holds_batches = False  # the budget counts shards, never samples
    worker_runs = True

    def check(self, options: StagingOptions) -> None:
        """Raise :class:`ConfigError` for an epoch cache, :class:`BudgetError` for a shard larger
        than the budget (it could never be staged)."""
        if options.epoch_cache:
            raise ConfigError("epoch_cache is not supported over tar shards (S5Dataset.from_shards) yet")
        samples = self.dataset.samples
        big = samples[samples.largest()]
        if big.size > options.budget:
            raise BudgetError(
                f"the shard {big.fields[0].uri} is {format_size(big.size)}, larger than the budget of "
                f"{format_size(options.budget)}; a shard is staged whole: raise the budget or write smaller shards"
            )

    def window(self, budget: int, calls_in_flight: int, shuffle: bool | str) -> int:
        """``shuffle="block"``: as for objects; else the shards a shard order keeps open."""
        if shuffle == "block":
            return super().window(budget, calls_in_flight, shuffle)
        shards = self.dataset.samples
        return open_shards(budget, shards[shards.largest()].size, self.dataset.total_bytes, len(shards))

    def order_cost(self) -> Callable[[int], tuple[float, float]]:
        """For a shard order whose samples are freed as they are read (see
        :meth:`Order.shard_order <s5loader._sampling.order.Order.shard_order>`): the shard of
        sample ``i`` as (what it holds when staged, what each sample read frees), in shards of
        the size :meth:`window` counts."""
        shards, samples = self.dataset.shards, self.dataset.samples
        assert shards is not None
        return shards.order_cost(samples[samples.largest()].size)

    def block_size(self, options: StagingOptions) -> int:
        return 1  # a shard is fetched with one cp --raw line: no wildcard lines

    def order_units(self, blocks: BlockPlan) -> list[list[int]]:
        """What a ``shuffle="block"`` order permutes: the shards (each its samples)."""
        assert self.dataset.shards is not None
        return self.dataset.shards.shard_units

    def s5cmd_workers(self, options: StagingOptions) -> int:
        """At most :data:`SHARD_WORKERS`, so that a call's shards land one after another (its
        first ones early, each fetched in parallel parts when large) instead of all together at
        its end; the first batch and a pass's first calls wait less (a 6,000-sample pass over
        10 MB shards through 20 ms round trips took 5.0 s instead of 6.4 here, medians of 3)."""
        return min(options.s5cmd_workers, SHARD_WORKERS)

    def open_pass(
        self, order: Sequence[int], folder: str, keep: bool, options: StagingOptions, shuffle: bool | str | None,
        frees: bool = False, early: bool = False,
    ) -> PassUnits:
        shards = ShardPass(self.dataset, order, folder, keep, options.on_error, frees)
        if shuffle is not None:
            shards.check_budget(options.budget, shuffle)
        return shards


def units_of(dataset: S5Dataset) -> ObjectUnits:
    """The kind of units ``dataset`` stages: :class:`ShardUnits` over tar shards, else
    :class:`ObjectUnits`."""
    return ShardUnits(dataset) if dataset.shards is not None else ObjectUnits(dataset)


def open_pass(
    dataset: S5Dataset, order: Sequence[int], folder: str, keep: bool, options: StagingOptions,
    shuffle: bool | str | None, frees: bool = False, early: bool = False,
) -> PassUnits:
    """The units of a pass of ``order`` staged into ``folder`` (``shuffle``: the order's, for
    the budget check; ``None``: no check, for command files written without a run).

    Raises:
        BudgetError: over shards, the order needs more shards at once than the budget holds.
    """
    return units_of(dataset).open_pass(order, folder, keep, options, shuffle, frees, early)
