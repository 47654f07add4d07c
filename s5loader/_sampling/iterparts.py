"""The parts of :class:`~s5loader.S5IterableDataset`: the checks of its options, one worker's
pass through an epoch (:class:`_Pass`, its order and length, the shuffle buffer), the staging
of a worker (:class:`WorkerStaging`, a :class:`~s5loader._sampling.run.StagingRun` of its own) and the
resume state."""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .._util.dist import rank_info
from .._util.platform import HOLE_BLOCK, punches_holes
from .._util.uri import format_size, parse_size
from ..config import StagingOptions
from ..dataset import S5Dataset, StagedIndex
from ..exceptions import BudgetError, ConfigError, StateError
from ..staging.epochcache import EpochCache
from .cacheplan import node_ranks
from .cacherun import CacheRun, open_iterable_cache
from .order import Order, check_seed, check_shuffle
from .resume import check_fields
from .run import StagingRun
from .setup import fit_budget
from .units import ShardUnits, units_of

STATE_VERSION = 1
_STATE_KEYS = (
    "version", "epoch", "seed", "shuffle", "shuffle_buffer", "drop_last", "num_replicas", "rank",
    "num_workers", "worker", "dataset_len", "yielded", "complete",
)


def check_options(
    dataset: S5Dataset,
    shuffle: bool | str,
    seed: int,
    shuffle_buffer: int,
    drop_last: bool,
    num_replicas: int | None,
    rank: int | None,
    budget: int | str,
    staging_dir: str | None,
    shrink_budget: bool,
    engine_options: dict[str, Any],
    keep_epoch_cache: bool = False,
) -> tuple[int, str, EpochCache | None]:
    """Check :class:`~s5loader.S5IterableDataset`'s options in the process that makes it;
    return the budget (less where the staging root has less room), the staging root and, with
    ``epoch_cache``, the epoch cache's folder, opened (see :func:`open_iterable_cache`).

    Raises:
        ConfigError, BudgetError: as :class:`~s5loader.S5IterableDataset`.
    """
    if not isinstance(dataset, S5Dataset):
        raise ConfigError(f"S5IterableDataset needs an S5Dataset, got {type(dataset).__name__}")
    check_shuffle(shuffle)
    check_seed(seed)
    if not isinstance(shuffle_buffer, int) or isinstance(shuffle_buffer, bool) or shuffle_buffer < 0:
        raise ConfigError(f"shuffle_buffer must be an int >= 0 (0: no buffer), got {shuffle_buffer!r}")
    if not isinstance(drop_last, bool):
        raise ConfigError(f"drop_last must be a bool, got {drop_last!r}")
    if num_replicas is not None or rank is not None:
        rank_info(num_replicas, rank)  # a bad explicit split fails here, not in a worker
    # Every engine option and the budget are checked now, in the main process, as the
    # sampler's are (the same checks, the same messages).
    options = StagingOptions(
        budget=parse_size(budget, "budget"), staging_dir=staging_dir, shrink_budget=shrink_budget, **engine_options
    )
    options, root = fit_budget(dataset, options, None)
    cache = open_iterable_cache(
        dataset, options.epoch_cache, (shuffle, seed, shuffle_buffer, drop_last), num_replicas, rank, root,
        keep_epoch_cache,
    )
    return options.budget, root, cache


@dataclass
class _Pass:
    """One worker's walk through (the rest of) one epoch."""

    epoch: int
    order: Order
    shuffle_buffer: int
    rank: int
    num_replicas: int
    worker: int
    num_workers: int
    length: int  # samples of this worker's part of the epoch
    yielded: int  # position in that part: samples handed out (or skipped) so far

    @property
    def complete(self) -> bool:
        return self.yielded >= self.length

    def state(self, dataset_len: int) -> dict[str, Any]:
        """The resume state of this pass (see :meth:`S5IterableDataset.state_dict
        <s5loader.S5IterableDataset.state_dict>`)."""
        o = self.order
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": o.seed,
            "shuffle": o.shuffle,
            "shuffle_buffer": self.shuffle_buffer,
            "drop_last": o.drop_last,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "num_workers": self.num_workers,
            "worker": self.worker,
            "dataset_len": dataset_len,
            "yielded": self.yielded,
            "complete": self.complete,
        }


def start_pass(
    loaded: dict[str, Any] | None,
    order: Order,
    shuffle_buffer: int,
    epoch: int,
    n: int,
    worker: int,
    num_workers: int,
    runs: bool,
    source: str,
) -> _Pass:
    """Worker ``worker``'s pass: epoch ``epoch`` of ``order`` (over ``n`` samples) from its
    start, or the rest of the epoch a ``loaded`` state was saved in.

    Raises:
        StateError: a state saved mid-epoch by another rank or worker (of ``source``).
    """
    rank, world = order.rank, order.num_replicas
    buffer, start = shuffle_buffer, 0
    if loaded is not None and not loaded["complete"]:
        where = f"rank {rank} of {world}, worker {worker} of {num_workers}"
        saved = (
            f"rank {loaded['rank']} of {loaded['num_replicas']}, worker {loaded['worker']} of "
            f"{loaded['num_workers']}"
        )
        if saved != where:
            raise StateError(
                f"a state of {source} saved mid-epoch by {saved} "
                f"cannot resume {where}: resume with the same number of ranks and DataLoader workers"
            )
        order = Order(loaded["shuffle"], loaded["seed"], world, rank, loaded["drop_last"], order.sharded)
        buffer, epoch, start = loaded["shuffle_buffer"], loaded["epoch"], loaded["yielded"]
    length = worker_length(order, n, worker, num_workers, runs)
    if loaded is not None and loaded["complete"]:
        # The saved epoch is over for this worker: this pass yields nothing (its remainder)
        # and the next one is the epoch after it (or the one set_epoch named).
        epoch, start = loaded["epoch"], length
    return _Pass(epoch, order, buffer, rank, world, worker, num_workers, length, min(start, length))


def check_workers(dataset: S5Dataset, budget: int, num_workers: int | None) -> int | None:
    """Check ``S5IterableDataset(num_workers=)`` (None, or the DataLoader's int >= 0) and,
    when given, the budget's split between that many workers, in the process that asks.

    Raises:
        ConfigError: not such a count. BudgetError: as :func:`check_share`.
    """
    if num_workers is None:
        return None
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
        raise ConfigError(f"num_workers must be None or the DataLoader's num_workers (an int >= 0), got {num_workers!r}")
    check_share(dataset, budget, max(1, num_workers))
    return num_workers


def worker_share(dataset: S5Dataset, budget: int, told: int | None, num_workers: int) -> int:
    """A worker's share of ``budget`` among the ``num_workers`` its DataLoader runs, the
    count ``told`` to the dataset (if any) being that one.

    Raises:
        ConfigError: the DataLoader runs another count than ``told``. BudgetError: as
            :func:`check_share`.
    """
    if told is not None and max(1, told) != num_workers:
        raise ConfigError(
            f"S5IterableDataset over {dataset.source or 'the data set'} was made with "
            f"num_workers={told}, but its DataLoader runs {num_workers} worker(s) (num_workers=0 "
            "runs one, in the main process): give both the same count"
        )
    return check_share(dataset, budget, num_workers, told is not None)


def check_share(dataset: S5Dataset, budget: int, num_workers: int, told: bool = True) -> int:
    """Each worker's share of ``budget``: ``budget // num_workers``.

    Args:
        told: the worker count was given to the dataset (``num_workers=``), so this check runs
            before any worker starts; else the message says how to make it so.

    Raises:
        BudgetError: the largest sample (or tar shard) does not fit in a share; the message
            names the budget, the share, the sample and the budget that would do.
    """
    share = budget // num_workers
    largest = dataset.samples[dataset.samples.largest()]
    if largest.size > share:
        what = units_of(dataset).name
        where = ", ".join(f.uri for f in largest.fields[:3])
        early = "" if told else (
            "; pass num_workers= to S5IterableDataset to have this checked before the workers start"
        )
        raise BudgetError(
            f"the budget of {format_size(budget)} split between {num_workers} DataLoader "
            f"workers leaves {format_size(share)} each, less than the largest {what} "
            f"({where}, {format_size(largest.size)}): every worker stages whole {what}s of its "
            f"own, so raise the budget to at least {format_size(largest.size * num_workers)} "
            f"or use fewer workers{early}"
        )
    return share


class WorkerStaging:
    """The staging of one DataLoader worker: a :class:`~s5loader._sampling.run.StagingRun` over that
    worker's part of the epoch (from a position), within the worker's share of the budget.

    Args:
        dataset: the data set.
        options: the staging options with the worker's share as the budget.
        root: the folder the worker stages below (inside the iterable dataset's directory).
        runs: workers take contiguous runs of the rank's part (tar shards: each shard is
            staged by one worker), not every ``num_workers``-th sample.
        shuffle: the order's ``shuffle``.
        cache: the epoch cache's folder (owned by the iterable dataset), with ``epoch_cache``.
    """

    def __init__(
        self, dataset: S5Dataset, options: StagingOptions, root: str, runs: bool, shuffle: bool | str,
        cache: EpochCache | None = None,
    ) -> None:
        self.dataset = dataset
        self.cache = cache
        self.runs = runs
        # a block order windows the worker's own run with the window its share of the budget
        # holds (a shard order: the shards the worker's share holds open at once)
        units = units_of(dataset)
        block = shuffle == "block"
        self.window = units.window(options.budget, options.calls_in_flight, "block" if block else True)
        if block:  # a call holds whole windows, so that each block is one request
            options = replace(options, samples_per_call=max(options.samples_per_call, self.window))
        # Over tar shards, shuffle=True: this worker reads what it stages, so the bytes of each
        # sample read are freed at once (where the file system can) and the order counts them:
        # a next shard opens as soon as there is room for it (see Order.shard_order).
        frees = isinstance(units, ShardUnits) and shuffle is True and cache is None and punches_holes(root, HOLE_BLOCK)
        self.cost = units.order_cost() if frees and isinstance(units, ShardUnits) else None
        self.staging = StagingRun(dataset, options, root, frees=frees)

    def run(self, p: _Pass) -> Generator[StagedIndex, None, None]:
        """Stage and yield ``p``'s samples from its position on."""
        run = self.staging
        if self.cache is not None and run.cache is None:
            run.cache = self._cache_run(p, self.cache)
        run.passes.close_active()
        run.position.restart(p.yielded)
        units = self.units() if p.order.per_rank else None
        order = worker_order(
            p.order, len(self.dataset), p.epoch, p.worker, p.num_workers, p.shuffle_buffer,
            units=units, window=self.window, runs=self.runs, cost=self.cost,
        )
        return run.stage(order[p.yielded:], None, p.order.shuffle, lambda: p.epoch)

    def units(self) -> list[list[int]]:
        """The blocks a ``shuffle="block"`` order permutes: tar shards, else key-prefix blocks."""
        return self.staging.units.order_units(self.staging.blocks)

    def _cache_run(self, p: _Pass, cache: EpochCache) -> CacheRun:
        """This worker's use of the epoch cache it shares with the node's other local ranks
        and their workers: the keep-set is planned over all their orders."""
        consumers = [(r, w) for r in node_ranks(p.rank, p.num_replicas) for w in range(p.num_workers)]
        units = self.units() if p.order.per_rank else None
        n, ds = len(self.dataset), self.dataset

        def orders(epoch: int) -> list[list[int]]:
            return [
                worker_order(replace(p.order, rank=r), n, epoch, w, p.num_workers, p.shuffle_buffer,
                             units=units, window=self.window, runs=self.runs)
                for r, w in consumers
            ]

        opts = self.staging.options
        return CacheRun(ds.samples, ds.samples.sizes(), cache.sharer(), opts.epoch_cache, orders,
                        consumers.index((p.rank, p.worker)), opts.verify)

    def position(self) -> int:
        """The position after the last sample handed out (skipped samples included)."""
        return self.staging.position.start + self.staging.position.yielded

    def drop_finished(self) -> None:
        """Remove the folders of finished passes: every sample in them was read in this process."""
        self.staging.drop_replaced()

    def close(self) -> None:
        self.staging.close()


def worker_order(
    order: Order,
    n: int,
    epoch: int,
    worker: int,
    num_workers: int,
    shuffle_buffer: int = 0,
    units: list[list[int]] | None = None,
    window: int = 1000,
    runs: bool = False,
    cost: Callable[[int], tuple[float, float]] | None = None,
) -> list[int]:
    """One DataLoader worker's part of a rank's epoch, in the order it yields it.

    The rank's part is :meth:`Order.indices` (every rank the same count). Worker ``w`` of
    ``num_workers`` takes every ``num_workers``-th sample from the ``w``-th on, or, with
    ``shuffle="block"`` or ``runs`` (tar shards), the ``w``-th of ``num_workers`` contiguous
    runs (blocks and shards stay with one worker, which stages them alone). With
    ``shuffle="block"`` the run is cut from the rank's units before the windows, and windowed
    on its own (:meth:`Order.block_order`), so no window straddles two workers; over tar shards
    with ``shuffle`` True or False it is cut from :meth:`Order.shard_order`'s rank part
    and mixed across ``window`` open shards (more, as samples read free room, with ``cost``:
    see :meth:`Order.shard_order`). Then the shuffle buffer (see
    :class:`S5IterableDataset`) reorders it.
    """
    if order.shuffle == "block":
        # a contiguous run of the rank's blocks (shards), in windows of the worker's own
        mine = order.block_order(n, epoch, 0, units or [[i] for i in range(n)], window, run=(worker, num_workers))[0]
    elif order.sharded:
        # a contiguous run of the rank's shards, mixed across the shards the worker has open
        mine = order.shard_order(n, epoch, 0, units or [], window, run=(worker, num_workers), cost=cost)
    else:
        part = order.indices(n, epoch, 0)
        mine = part[len(part) * worker // num_workers : len(part) * (worker + 1) // num_workers] if runs else part[worker::num_workers]
    if shuffle_buffer > 1:
        rng = np.random.default_rng([order.seed & (2**64 - 1), epoch, order.rank, worker])
        mine = buffer_shuffle(mine, shuffle_buffer, rng)
    return mine


def worker_length(order: Order, n: int, worker: int, num_workers: int, runs: bool = False) -> int:
    """How many samples :func:`worker_order` gives ``worker`` (without computing the order)."""
    w = order.num_replicas
    part = n // w if order.drop_last else math.ceil(n / w)
    if order.shuffle == "block" or runs:
        return part * (worker + 1) // num_workers - part * worker // num_workers
    return len(range(worker, part, num_workers))


def buffer_shuffle(seq: list[int], k: int, rng: np.random.Generator) -> list[int]:
    """``seq`` through a shuffle buffer of ``k`` (see :class:`S5IterableDataset`)."""
    if k <= 1 or len(seq) <= 1:
        return list(seq)
    draws = rng.random(len(seq))
    buf: list[int] = []
    out: list[int] = []
    t = 0
    for x in seq:
        if len(buf) < k:
            buf.append(x)
            continue
        j = int(draws[t] * k)
        t += 1
        out.append(buf[j])
        buf[j] = x
    while buf:
        j = int(draws[t] * len(buf))
        t += 1
        buf[j], buf[-1] = buf[-1], buf[j]
        out.append(buf.pop())
    return out


def check_state(state: Any, dataset_len: int) -> dict[str, Any]:
    """Check an :meth:`S5IterableDataset.state_dict` for a data set of ``dataset_len`` samples.

    Raises:
        StateError: not such a state, another data set size, or a value out of range.
    """
    check_fields(
        state, "S5IterableDataset.state_dict()", _STATE_KEYS, (STATE_VERSION,),
        ("epoch", "yielded", "num_replicas", "rank", "num_workers", "worker", "dataset_len", "seed", "shuffle_buffer"),
        ("drop_last", "complete"), dataset_len,
    )
    if state["num_replicas"] < 1 or state["rank"] >= state["num_replicas"]:
        raise StateError(f"state has rank {state['rank']} of {state['num_replicas']}")
    if state["num_workers"] < 1 or state["worker"] >= state["num_workers"]:
        raise StateError(f"state has worker {state['worker']} of {state['num_workers']}")
    out = {k: state[k] for k in _STATE_KEYS}
    out["shuffle"] = "block" if state["shuffle"] == "block" else bool(state["shuffle"])
    return out
