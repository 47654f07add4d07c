"""The parts of :class:`~s5loader.S5IterableDataset`: one worker's pass through an epoch
(:class:`_Pass`: its order, length and position), the staging of a worker
(:class:`WorkerStaging`, a :class:`~s5loader._sampling.run.StagingRun` of its own) and the
resume state. The worker's order is in :mod:`.workerorder`, the checks of the options in
:mod:`.iterchecks`."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, replace
from typing import Any

from ..config import StagingOptions
from ..dataset import S5Dataset, StagedIndex
from ..exceptions import StateError
from ..staging.epochcache import EpochCache
from .cacheplan import node_ranks
from .cacherun import CacheRun
from .order import Order
from .resume import check_fields
from .run import StagingRun
from .workerorder import check_buffer, worker_frees, worker_length, worker_order, worker_window

STATE_VERSION = 1
_STATE_KEYS = (
    "version", "epoch", "seed", "shuffle", "shuffle_buffer", "drop_last", "num_replicas", "rank",
    "num_workers", "worker", "dataset_len", "yielded", "complete",
)


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


def resumed_epoch(loaded: dict[str, Any], epoch: int, epoch_set: bool) -> int:
    """The epoch after loading the state ``loaded``: a state saved mid-epoch resumes its epoch;
    one saved after its epoch ended, the epoch ``set_epoch`` named (``epoch_set``), else the next."""
    if not loaded["complete"]:
        return int(loaded["epoch"])
    return epoch if epoch_set else int(loaded["epoch"]) + 1


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
        checked: a shuffle buffer over tar shards was checked against this worker's share
            before the workers started; else each pass checks it (:func:`check_buffer`).
    """

    def __init__(
        self, dataset: S5Dataset, options: StagingOptions, root: str, runs: bool, shuffle: bool | str,
        cache: EpochCache | None = None, checked: bool = False,
    ) -> None:
        self.dataset = dataset
        self.cache = cache
        self.runs = runs
        self.checked = checked
        self.frees = frees = worker_frees(dataset, shuffle, cache is not None, root)
        self.window, self.cost = worker_window(dataset, options.budget, options.calls_in_flight, shuffle, frees)
        if shuffle == "block":  # a call holds whole windows, so that each block is one request
            options = replace(options, samples_per_call=max(options.samples_per_call, self.window))
        self.staging = StagingRun(dataset, options, root, frees=frees)

    def run(self, p: _Pass) -> Generator[StagedIndex, None, None]:
        """Stage and yield ``p``'s samples from its position on.

        Raises:
            BudgetError: not ``checked``: a shuffle buffer over tar shards keeps more staged at
                once than the worker's share holds (see :func:`check_buffer`).
        """
        run = self.staging
        if not self.checked:
            opts = run.options
            check_buffer(self.dataset, p.order, p.shuffle_buffer, p.epoch, opts.budget, p.num_workers, [p.worker],
                         opts.calls_in_flight, self.frees, p.yielded)
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
