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

from collections.abc import Callable, Container, Sequence
from typing import Protocol

from .._index.blocks import BlockPlan
from .._shards.passes import Hits, ShardPass
from .._shards.tar import is_gzip
from .._util.uri import format_size
from ..config import StagingOptions
from ..dataset import S5Dataset
from ..engine import Stager
from ..exceptions import BudgetError
from .order import Order, block_window, open_shards

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

    def engine_kept(self, hits: Hits | None) -> Container[int] | None: ...

    def unit_of(self, index: int) -> int:
        """The unit the engine staged sample ``index`` in."""
        ...

    def engine_windows(self, windows: list[int] | None) -> list[int] | None: ...

    def start(self, stager: Stager, options: StagingOptions) -> None: ...

    def take(self, pos: int, stager: Stager) -> bool: ...

    def finish(self, stager: Stager) -> None: ...

    def close(self) -> None: ...

    def stop(self) -> None: ...


class ObjectPass:
    """A pass over raw objects: the engine stages the order itself, a sample is yielded once
    its files are staged (a consumer then holds it until it releases it)."""

    first_call = 32
    streams_first = False

    def __init__(self, order: Sequence[int], keep: bool) -> None:
        self.engine_order = order
        self.keep = keep

    def engine_options(self, options: StagingOptions) -> StagingOptions:
        return options

    def engine_kept(self, hits: Hits | None) -> Container[int] | None:
        return hits  # an epoch cache's hits: staged already, not fetched

    def unit_of(self, index: int) -> int:
        return index

    def engine_windows(self, windows: list[int] | None) -> list[int] | None:
        return windows

    def start(self, stager: Stager, options: StagingOptions) -> None:
        pass

    def take(self, pos: int, stager: Stager) -> bool:
        if not stager.wait(pos):
            return False  # skipped
        if not self.keep:
            stager.yielded(self.engine_order[pos])
        return True

    def finish(self, stager: Stager) -> None:
        pass

    def close(self) -> None:
        pass

    def stop(self) -> None:
        pass


class ObjectUnits:
    """A data set of raw objects: a unit is a sample's objects, a block of samples sharing a key
    prefix is fetched with one wildcard line, and a DataLoader batch of samples is held at once."""

    name = "sample"
    holds_batches = True  # the budget must hold a batch of the largest samples

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

    def per_rank(self, shuffle: bool | str) -> bool:
        """Whether positions in an order of ``shuffle`` count samples of a rank's part (a block
        order), not of one global order that ranks deal among themselves."""
        return shuffle == "block"

    def plan(
        self, order: Order, epoch: int, start: int, blocks: BlockPlan, window: int,
        cost: Callable[[int], tuple[float, float]] | None = None,
    ) -> tuple[list[int], list[int] | None]:
        """This rank's order of ``epoch`` from ``start`` on, and (``shuffle="block"``) where
        its windows begin: a block order of the key-prefix ``blocks``, else the permutation
        (or key order) of all samples, dealt to the ranks."""
        n = len(self.dataset)
        if order.shuffle == "block":
            return order.block_order(n, epoch, start, self.order_units(blocks), window)
        return order.indices(n, epoch, start), None

    def s5cmd_workers(self, options: StagingOptions) -> int:
        return options.s5cmd_workers

    def frees_on_read(self, shuffle: bool | str, cached: bool) -> bool:
        """Whether an order of these units counts the bytes each sample read gives back (see
        :meth:`ShardUnits.order_cost`): never for raw objects, whose samples go whole."""
        return False

    def cache_units(self) -> tuple[Callable[[int], int] | None, Callable[[int], bool] | None]:
        """How the epoch cache sees these units: the unit of a sample (``None``: each sample is
        its own) and which units it may keep (``None``: all)."""
        return None, None

    def unit_of(self, index: int) -> int:
        """The unit (what the engine stages) that holds sample ``index``: the sample itself."""
        return index

    def peak_bytes(self, order: Sequence[int], frees: bool) -> int | None:
        """The most bytes of units that ``order`` needs staged at once, where that depends on
        the order (over tar shards: a shard stays from its first sample to its last); None for
        raw objects, whose samples go as they are read."""
        return None

    def order_cost(self) -> Callable[[int], tuple[float, float]] | None:
        """What a sample's unit holds and frees, for an order that counts it (see
        :meth:`ShardUnits.order_cost`); None: raw objects count nothing."""
        return None

    def open_pass(
        self, order: Sequence[int], folder: str, keep: bool, options: StagingOptions, shuffle: bool | str | None,
        frees: bool = False, hits: Hits | None = None,
    ) -> PassUnits:
        """The units of a pass of ``order`` (``frees``: over tar shards, the order counts the
        bytes its samples free as they are read, see :meth:`ShardUnits.order_cost`; ``hits``:
        the epoch cache's)."""
        return ObjectPass(order, keep)


class ShardUnits(ObjectUnits):
    """A data set of tar shards: a unit is a shard, staged whole by one ``cp --raw`` line and
    counted whole in the budget; a shard order keeps as many shards open as the budget holds,
    and an iterable's worker takes a contiguous run of shards, which it alone stages."""

    name = "tar shard"
    holds_batches = False  # the budget counts shards, never samples

    def check(self, options: StagingOptions) -> None:
        """Raise :class:`BudgetError` for a shard larger than the budget (it could never be
        staged)."""
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

    def frees_on_read(self, shuffle: bool | str, cached: bool) -> bool:
        """A shard order (``shuffle=True``) counts what its samples free as they are read, unless an
        epoch cache may keep the shards whole (a shard punched as it is read could not be kept)."""
        return shuffle is True and not cached

    def block_size(self, options: StagingOptions) -> int:
        return 1  # a shard is fetched with one cp --raw line: no wildcard lines

    def order_units(self, blocks: BlockPlan) -> list[list[int]]:
        """What a ``shuffle="block"`` order permutes: the shards (each its samples)."""
        assert self.dataset.shards is not None
        return self.dataset.shards.shard_units

    def per_rank(self, shuffle: bool | str) -> bool:
        """Every order of shards counts positions in a rank's part: each rank reads runs of whole
        shards."""
        return True

    def cache_units(self) -> tuple[Callable[[int], int] | None, Callable[[int], bool] | None]:
        """The epoch cache keeps whole shards; not gzip-compressed ones, which are staged
        decompressed in place and would no longer match their listing."""
        shards = self.dataset.shards
        assert shards is not None
        return self.unit_of, lambda s: not is_gzip(shards[s].uri)

    def unit_of(self, index: int) -> int:
        """The shard that holds sample ``index``."""
        assert self.dataset.shards is not None
        return self.dataset.shards.locate(index)[0]

    def peak_bytes(self, order: Sequence[int], frees: bool) -> int | None:
        """The most bytes of shards ``order`` needs staged at once (see
        :meth:`ShardPass.peak_bytes <s5loader._shards.passes.ShardPass.peak_bytes>`)."""
        return ShardPass(self.dataset, order, "", False, "raise", frees).peak_bytes()[0]

    def plan(
        self, order: Order, epoch: int, start: int, blocks: BlockPlan, window: int,
        cost: Callable[[int], tuple[float, float]] | None = None,
    ) -> tuple[list[int], list[int] | None]:
        """This rank's order over the shards from ``start`` on: a block order whose first shard is
        read from its front (it streams), else a shard order that keeps ``window`` shards open
        (more with ``cost``, see :meth:`Order.shard_order`)."""
        n = len(self.dataset)
        if order.shuffle == "block":
            return order.block_order(n, epoch, start, self.order_units(blocks), window, front_first=True)
        return order.shard_order(n, epoch, start, self.order_units(blocks), window, cost=cost), None

    def s5cmd_workers(self, options: StagingOptions) -> int:
        """At most :data:`SHARD_WORKERS`, so that a call's shards land one after another (its
        first ones early, each fetched in parallel parts when large) instead of all together at
        its end; the first batch and a pass's first calls wait less (a 6,000-sample pass over
        10 MB shards through 20 ms round trips took 5.0 s instead of 6.4 here, medians of 3)."""
        return min(options.s5cmd_workers, SHARD_WORKERS)

    def open_pass(
        self, order: Sequence[int], folder: str, keep: bool, options: StagingOptions, shuffle: bool | str | None,
        frees: bool = False, hits: Hits | None = None,
    ) -> PassUnits:
        shards = ShardPass(self.dataset, order, folder, keep, options.on_error, frees, hits)
        if shuffle is not None:
            shards.check_budget(options.budget, shuffle)
        return shards


def units_of(dataset: S5Dataset) -> ObjectUnits:
    """The kind of units ``dataset`` stages: :class:`ShardUnits` over tar shards, else
    :class:`ObjectUnits`."""
    return ShardUnits(dataset) if dataset.shards is not None else ObjectUnits(dataset)


def open_pass(
    dataset: S5Dataset, order: Sequence[int], folder: str, keep: bool, options: StagingOptions,
    shuffle: bool | str | None, frees: bool = False, hits: Hits | None = None,
) -> PassUnits:
    """The units of a pass of ``order`` staged into ``folder`` (``shuffle``: the order's, for
    the budget check; ``None``: no check, for command files written without a run).

    Raises:
        BudgetError: over shards, the order needs more shards at once than the budget holds.
    """
    return units_of(dataset).open_pass(order, folder, keep, options, shuffle, frees, hits)
