"""A data set of raw objects as the staging run sees it: :class:`ObjectUnits` (each sample its own
unit, a block of samples fetched by one wildcard line), a pass over them (:class:`ObjectPass`),
and what every pass's units answer (:class:`PassUnits`). See :mod:`.units`."""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import NamedTuple, Protocol

from .._engine import Stager
from .._index.blocks import BlockPlan
from .._shards.holding import Freeing
from .._shards.shardpass import Hits
from .._staging.epochcache import index_fingerprint
from .._staging.layout import StagingLayout
from ..config import StagingOptions
from ..dataset import S5Dataset, StagedIndex
from .early import EARLY, Early, EarlyHandOut, early_hand_out
from .order import Order, block_window

# s5cmd's own default of workers: the most a pass's first call of raw objects runs
FIRST_CALL_WORKERS = 256


class Lifted(NamedTuple):
    """A staged sample as a folder (see :meth:`ObjectUnits.lift`): the folder, the sample's key,
    its bytes, and whether they were written anew (else the staged files themselves)."""

    folder: str
    key: str
    size: int
    fresh: bool


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
    def first_workers(self) -> int | None:
        """The most s5cmd workers of the engine's first call (``None``: ``s5cmd_workers``)."""
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
    # a worker for each copy of the first call: its HEADs and GETs go out in one round
    first_workers: int | None = FIRST_CALL_WORKERS
    streams_first = False

    def __init__(self, order: Sequence[int], keep: bool, early: bool = False) -> None:
        self.engine_order = order
        self.keep = keep
        self.hands_out_early = early
        self.early: EarlyHandOut | None = None

    def engine_options(self, options: StagingOptions) -> StagingOptions:
        return options

    def engine_kept(self, hits: Hits | None) -> Container[int] | None:
        return hits  # an epoch cache's hits: staged already, not fetched

    def unit_of(self, index: int) -> int:
        return index

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
    holds_batches = True  # the budget must hold a batch of the largest samples

    def __init__(self, dataset: S5Dataset) -> None:
        self.dataset = dataset

    def check(self, options: StagingOptions) -> None:
        """Raise for options this kind of data set cannot stage."""

    def window(self, budget: int, shuffle: bool | str) -> int:
        """``shuffle="block"``'s window (samples shuffled together; see :func:`block_window`)."""
        ds = self.dataset
        return block_window(budget, ds.total_bytes / max(1, len(ds)))

    def block_size(self, options: StagingOptions) -> int:
        return options.block_size

    def order_units(self, blocks: BlockPlan) -> list[list[int]]:
        """What a ``shuffle="block"`` order permutes: the key-prefix blocks of samples."""
        return blocks.units

    def check_batch(self, order: Sequence[int], batch: int, budget: int, cost: Freeing | None = None) -> None:
        """Raise :class:`BudgetError` when the units of one DataLoader batch of ``order`` cannot
        be staged at once (a batch is read only once all of it is handed out); raw objects are
        checked against the largest samples when the sampler is made."""

    def per_rank(self, shuffle: bool | str) -> bool:
        """Whether positions in an order of ``shuffle`` count samples of a rank's part (a block
        order), not of one global order that ranks deal among themselves."""
        return shuffle == "block"

    def plan(
        self,
        order: Order,
        epoch: int,
        start: int,
        blocks: BlockPlan,
        window: int,
        cost: Freeing | None = None,
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

    def frees_on_read(self, shuffle: bool | str, budget: int | None = None) -> bool:
        """Whether an order of these units counts the bytes each sample read gives back (see
        :meth:`ShardUnits.order_cost`): never for raw objects, whose samples go whole."""
        return False

    def cache_units(
        self,
    ) -> tuple[Callable[[Sequence[int]], list[int]] | None, Callable[[int], bool] | None]:
        """How the epoch cache sees these units: the unit of each sample of an order (``None``:
        each sample is its own) and which units it may keep (``None``: all)."""
        return None, None

    def unit_of(self, index: int) -> int:
        """The unit (what the engine stages) that holds sample ``index``: the sample itself."""
        return index

    def peak_bytes(self, order: Sequence[int], frees: bool) -> int | None:
        """The most bytes of units that ``order`` needs staged at once, where that depends on
        the order (over tar shards: a shard stays from its first sample to its last); None for
        raw objects, whose samples go as they are read."""
        return None

    def delivery_window(self, budget: int) -> int:
        """The bytes of lifted samples (:meth:`lift`) the daemon bounds apart from its engine's
        budget: none for raw objects, whose folders move, and which the engine's budget counts
        until the consumer deletes them."""
        return 0

    def sample_estimate(self) -> int:
        """A sample in bytes, for the delivery window (unused where there is none)."""
        return 0

    def fingerprint(self) -> str:
        """A digest of what these units are (see :func:`~s5loader._staging.epochcache.index_fingerprint`)."""
        return index_fingerprint(self.dataset.samples)

    def lift(self, staged: StagedIndex, scratch: str) -> Lifted:
        """A staged sample as a folder of its own, for a consumer that takes folders (the
        prefetch daemon): a raw object's sample is its staged folder already (moved, not copied)."""
        sample = self.dataset.samples[staged]
        return Lifted(StagingLayout(staged.folder).sample_dir(staged), sample.key, sample.size, False)

    def order_cost(self, budget: int | None = None) -> Freeing | None:
        """What an order that counts what its samples give back needs to know (see
        :meth:`ShardUnits.order_cost`); None: raw objects count nothing."""
        return None

    def open_pass(
        self,
        order: Sequence[int],
        folder: str,
        keep: bool,
        options: StagingOptions,
        shuffle: bool | str | None,
        frees: bool = False,
        hits: Hits | None = None,
        early: bool = False,
    ) -> PassUnits:
        """The units of a pass of ``order`` (``frees``: over tar shards, the order counts the
        bytes its samples free as they are read, see :meth:`ShardUnits.order_cost`; ``hits``:
        the epoch cache's; ``early``: samples not staged yet go out at once, see :mod:`.early`)."""
        return ObjectPass(order, keep, early)
