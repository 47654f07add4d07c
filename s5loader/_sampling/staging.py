"""One rank's staging of a data set: :class:`Staging`, the object every front end adapts.

What follows from (data set, options, order, rank, node) is worked out here once: the units the
data set stages (samples or tar shards), the window of its order (a block order's samples, or
the shards a shard order keeps open), what a shard order counts the bytes its read samples give
back with, the call size (whole windows for ``shuffle="block"``), the budget the staging root has
room for, the staging root, the epoch cache and its plan over the node's ranks, and the figures.
How a staged sample is handed on is a parameter (:class:`~.passes.HandOff`), not hooks set on
the run from outside.

The front ends are adapters over it: :class:`~s5loader.S5Sampler` yields its indices to a
DataLoader; :class:`~s5loader.S5IterableDataset`'s hosting worker feeds them to the rank's
workers (:mod:`.rankhost`); the prefetch daemon moves each staged sample into its cache
(:mod:`s5loader._daemon.stream`). A plain generator needs nothing more than :meth:`Staging.stage`
(see the guide's "A generator over Staging").
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Any

from .._engine.counters import Metrics
from .._engine.stager import close_off_engine
from .._shards.holding import Freeing
from .._staging.epochcache import EpochCache, index_fingerprint
from .._staging.reader import StagedIndex
from .._util.dist import cache_node_ranks
from .._util.platform import require_linux
from .._util.uri import format_size
from ..config import StagingOptions
from ..dataset import S5Dataset
from ..exceptions import ConfigError
from .cacheplan import pin_to_nodes
from .cacherun import cache_id, new_cache_run, weakly
from .epochs import EpochOrders
from .order import Order
from .passes import READERS, HandOff
from .pieces import part_len
from .run import StagingRun
from .setup import configure, whole_windows
from .units import can_free, freeing_cost, units_of

__all__ = ["READERS", "HandOff", "Staging", "layout"]


def layout(
    dataset: S5Dataset, budget: int, shuffle: bool | str, root: str, whole: bool = False
) -> tuple[int, Freeing | None]:
    """The window of an order of ``dataset`` staged within ``budget`` below ``root`` (a block
    order's samples; a shard order's open shards) and, where that order counts the bytes its
    samples give back as they are read (over tar shards with ``shuffle=True`` that do not fit the
    budget, on a file system that punches holes, unless shards are kept ``whole``), what it counts
    them with (see :meth:`ShardUnits.order_cost <s5loader._sampling.units.ShardUnits.order_cost>`)."""
    window = units_of(dataset).window(budget, shuffle)
    return window, freeing_cost(dataset, shuffle, budget, root, whole)


class Staging:
    """Stages one rank's order of a data set, epoch by epoch, within a byte budget.

    The object behind :class:`~s5loader.S5Sampler`, :class:`~s5loader.S5IterableDataset` and
    ``s5loader prefetch``, usable on its own: :meth:`stage` yields the indices of an epoch's
    order once each sample is staged, and ``dataset[index]`` reads the staged files and deletes
    them, which frees their bytes in the budget at once::

        with Staging(ds, budget="2GiB", shuffle=True, seed=0) as staging:
            for epoch in range(3):
                for index in staging.stage(epoch):
                    sample = ds[index]

    Args:
        dataset: the :class:`~s5loader.S5Dataset` to stage.
        options, shuffle, seed, num_replicas, rank, drop_last, batch_size, **staging: as for
            :class:`~s5loader.S5Sampler`, checked the same way, with the same errors.

    Only one pass runs at a time: a new :meth:`stage` stops the one before it, and a sample
    of a stopped pass that was not read is fetched directly when read. :meth:`close` (or the
    end of a ``with`` block, garbage collection, exit, SIGTERM) stops staging and removes the
    staging directory.

    Raises:
        ConfigError, BudgetError, PlatformError: as :class:`~s5loader.S5Sampler`.
    """

    def __init__(
        self,
        dataset: S5Dataset,
        options: StagingOptions | None = None,
        *,
        shuffle: bool | str = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        batch_size: int | None = None,
        **staging: Any,
    ) -> None:
        require_linux("Staging")
        if not isinstance(dataset, S5Dataset):
            raise ConfigError(f"Staging needs an S5Dataset, got {type(dataset).__name__}")
        merged = StagingOptions.merge(options, staging, "Staging")
        order, window, checked, root = configure(
            dataset,
            merged,
            shuffle=shuffle,
            seed=seed,
            num_replicas=num_replicas,
            rank=rank,
            drop_last=drop_last,
            batch_size=batch_size,
        )
        # with an epoch cache on several nodes, each node's samples stay with it across epochs
        order = pin_to_nodes(order, bool(checked.epoch_cache))
        self._setup(dataset, checked, order, root, checked.keep_staged, READERS, window, None, False)
        if checked.epoch_cache:
            self.use_cache(self._named_cache(root))
        dataset._plain.watch(self.run.area.path)  # a plain int of a staged sample is reported
        self._warned = False  # a budget that holds few shards to mix is said at the first stage()
        self._finalizer: Any = weakref.finalize(self, close_off_engine, self.run.close)  # a pass stops first

    @classmethod
    def within(
        cls,
        dataset: S5Dataset,
        options: StagingOptions,
        order: Order,
        root: str,
        *,
        hand_off: HandOff = READERS,
        window: int | None = None,
        frees: bool | None = None,
        whole: bool = False,
        counts: bool | None = None,
    ) -> Staging:
        """A front end's staging, with ``options`` checked already (their budget fits below
        ``root``): ``hand_off`` says how staged samples leave it, ``window`` keeps a saved
        window, ``frees`` says whether read samples of tar shards give their bytes back (default:
        where the order counts them), ``whole`` keeps shards whole (an epoch cache keeps them),
        ``counts`` whether the order counts what read samples give back (default: the rule of
        :func:`layout`; the daemon's saved runs follow a rule of their own). The front end
        closes it."""
        self = cls.__new__(cls)
        self._setup(dataset, options, order, root, False, hand_off, window, frees, whole, counts)
        self._warned = True  # a front end says it its own way
        self._finalizer = None
        return self

    def _setup(
        self,
        dataset: S5Dataset,
        options: StagingOptions,
        order: Order,
        root: str,
        keep: bool,
        hand_off: HandOff,
        window: int | None,
        frees: bool | None,
        whole: bool,
        counts: bool | None = None,
    ) -> None:
        self.dataset = dataset
        self.units = units_of(dataset)
        budget, shuffle = options.budget, order.shuffle
        found, cost = layout(dataset, budget, shuffle, root, keep or whole)
        if counts is not None:
            cost = self.units.order_cost(budget) if counts else None
        window = found if window is None else window
        self.run = StagingRun(
            dataset,
            whole_windows(options, shuffle, window),
            root,
            keep,
            frees=cost is not None if frees is None else frees,
            hand_off=hand_off,
        )
        self.epochs = EpochOrders(order, window, self.run, cost, can_free(dataset, root, keep))

    def _named_cache(self, root: str) -> EpochCache:
        """The epoch cache folder below ``root`` that this job's local ranks share (named after
        the index, the order's settings and the node)."""
        o, opts = self.order, self.options
        ranks = cache_node_ranks(o.rank, o.num_replicas)
        fingerprint = index_fingerprint(self.dataset.samples)
        job = (o.shuffle, o.seed, o.num_replicas, o.drop_last, self.window, ranks[0], len(ranks))
        return EpochCache(root, cache_id(fingerprint, *job), fingerprint, opts.keep_epoch_cache)

    def use_cache(self, cache: EpochCache, orders: Callable[[int], list[list[int]]] | None = None) -> None:
        """Keep read samples in the epoch cache ``cache`` for the next epoch, within
        ``options.epoch_cache``: what to keep is planned over ``orders`` (each epoch's whole order
        of every local rank of the node, in rank order; default: :meth:`node_orders`)."""
        o = self.order
        mine = cache_node_ranks(o.rank, o.num_replicas).index(o.rank)
        opts = self.options
        plan = weakly(self.node_orders) if orders is None else orders  # no cycle through the run
        self.run.cache = new_cache_run(self.dataset, cache, opts.epoch_cache, plan, mine, opts.verify)

    # -- what follows from the order ----------------------------------------------------
    @property
    def order(self) -> Order:
        """The order: shuffle, seed, this rank among the ranks, the nodes it is pinned to."""
        return self.epochs.order

    @property
    def window(self) -> int:
        """A ``shuffle="block"`` window's most samples, or the shards a shard order keeps open."""
        return self.epochs.window

    @property
    def cost(self) -> Freeing | None:
        """What a shard order counts the bytes its read samples give back with (None: nothing)."""
        return self.epochs.cost

    @property
    def options(self) -> StagingOptions:
        """The staging options as checked: the budget the root has room for, the call size."""
        return self.run.options

    @property
    def staging_dir(self) -> str:
        """This staging's own directory (created by the first pass)."""
        return self.run.area.path

    def __len__(self) -> int:
        """The samples of this rank's order of an epoch."""
        o = self.order
        return part_len(len(self.dataset), o.num_replicas, o.drop_last)

    def plan(self, epoch: int, start: int = 0) -> tuple[list[int], list[int] | None]:
        """This rank's order of ``epoch`` from ``start`` on, and (``shuffle="block"``) where
        its windows begin."""
        return self.epochs.plan(epoch, start)

    def node_orders(self, epoch: int) -> list[list[int]]:
        """The whole order of ``epoch`` of each rank of this node (the epoch cache plans on them)."""
        return self.epochs.local_orders(epoch)

    # -- staging ------------------------------------------------------------------------
    def stage(self, epoch: int = 0, start: int = 0) -> Iterator[StagedIndex]:
        """Stage this rank's order of ``epoch`` from position ``start`` on in a new pass and yield
        each index once its sample is staged; ``dataset[index]`` reads and deletes it. The pass
        before it stops now, when this is called. ``start`` counts positions of the order, a
        sample skipped under ``on_error="skip"`` included: :attr:`position` says where a stopped
        loop got to (without skips, the samples it took).

        Raises:
            ConfigError: ``epoch`` or ``start`` is not an int >= 0, or ``start`` is past the order.
        """
        for name, value in (("epoch", epoch), ("start", start)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
        if start > len(self):
            raise ConfigError(f"start={start} is past the {len(self)} samples of this rank's order")
        few = None if self._warned else self.epochs.few_shards(self.options.budget, "Staging")
        self._warned = True
        if few:  # a budget that holds few shards to mix: said once, as the sampler says it
            warnings.warn(few, UserWarning, stacklevel=2)
        self.run.passes.close_active()
        position = self.run.position
        position.restart(start)
        return self._staged(self.epochs.stage(lambda: epoch, position, None, self.options.budget))

    def _staged(self, staged: Iterator[StagedIndex]) -> Iterator[StagedIndex]:
        yield from staged  # a generator of this object: a loop over it keeps the staging alive

    @property
    def position(self) -> int:
        """The position in its epoch's order that the last pass reached: the samples it handed
        out and skipped, from the start it was given."""
        p = self.run.position
        return p.start + p.yielded

    def stage_order(
        self,
        order: list[int],
        windows: list[int] | None,
        epoch: Callable[[], int],
        skips: bool = False,
        shuffle: bool | str | None = None,
    ) -> Generator[StagedIndex | None, None, None]:
        """Stage a front end's own ``order`` (of :meth:`plan`, or of what a resumed epoch left,
        laid out with its ``shuffle``, default the staging's) in a new pass; see
        :meth:`StagingRun.stage <s5loader._sampling.run.StagingRun.stage>`."""
        laid_out = self.order.shuffle if shuffle is None else shuffle
        return self.run.stage(order, windows, laid_out, epoch, skips)

    def metrics(self, epoch: int, samples: int) -> Metrics:
        """The running pass's figures (see :class:`~s5loader._engine.counters.Metrics`), with
        the epoch cache's."""
        return self.run.metrics(epoch, samples)

    def close(self) -> None:
        """Stop staging, kill s5cmd, remove the staging directory. Safe to call twice."""
        self.run.close()

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_finalizer": None}  # the running pass stays (see StagingPasses)

    def __repr__(self) -> str:
        o = self.order
        return (
            f"Staging({self.dataset!r}, shuffle={o.shuffle}, seed={o.seed}, rank={o.rank}/{o.num_replicas}, "
            f"budget={format_size(self.options.budget)}, staging_dir={self.staging_dir!r})"
        )
