"""The parts of :class:`~s5loader.S5IterableDataset`: the checks of its options, one worker's
pass through an epoch (:class:`_Pass`, its order and length, the shuffle buffer), the staging
engine of a worker (:class:`_WorkerSampler`) and the resume state."""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ._dist import rank_info
from ._order import Order
from ._uri import format_size, parse_size
from .config import StagingOptions
from .dataset import S5Dataset, StagedIndex
from .engine.budget import check_sample_fits
from .exceptions import BudgetError, ConfigError, StateError
from .sampler import S5Sampler
from .staging.area import choose_root, disk_footprint

if TYPE_CHECKING:
    from .iterable import S5IterableDataset

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
) -> tuple[int, str]:
    """Check :class:`~s5loader.S5IterableDataset`'s options in the process that makes it;
    return the budget (less where the staging root has less room) and the staging root.

    Raises:
        ConfigError, BudgetError: as :class:`~s5loader.S5IterableDataset`.
    """
    if not isinstance(dataset, S5Dataset):
        raise ConfigError(f"S5IterableDataset needs an S5Dataset, got {type(dataset).__name__}")
    if shuffle not in (True, False, "block") or shuffle is None:
        raise ConfigError(f"shuffle must be True, False or 'block', got {shuffle!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"seed must be an int, got {seed!r}")
    if not isinstance(shuffle_buffer, int) or isinstance(shuffle_buffer, bool) or shuffle_buffer < 0:
        raise ConfigError(f"shuffle_buffer must be an int >= 0 (0: no buffer), got {shuffle_buffer!r}")
    if not isinstance(drop_last, bool):
        raise ConfigError(f"drop_last must be a bool, got {drop_last!r}")
    if num_replicas is not None or rank is not None:
        rank_info(num_replicas, rank)  # a bad explicit split fails here, not in a worker
    budget_bytes = parse_size(budget, "budget")
    # Checks every engine option now, in the main process, with the messages of the engine.
    StagingOptions(budget=budget_bytes, **engine_options)
    largest = dataset.samples[dataset.samples.largest()]
    check_sample_fits(largest, budget_bytes)
    need = min(budget_bytes, dataset.total_bytes)
    root, room = choose_root(staging_dir, need, shrink_budget, disk_footprint(dataset.samples.size))
    if room < need:
        check_sample_fits(largest, room, f"only {format_size(room)} fit in {root}")
        budget_bytes = room
    return budget_bytes, root


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
        order = Order(loaded["shuffle"], loaded["seed"], world, rank, loaded["drop_last"])
        buffer, epoch, start = loaded["shuffle_buffer"], loaded["epoch"], loaded["yielded"]
    length = worker_length(order, n, worker, num_workers, runs)
    if loaded is not None and loaded["complete"]:
        # The saved epoch is over for this worker: this pass yields nothing (its remainder)
        # and the next one is the epoch after it (or the one set_epoch named).
        epoch, start = loaded["epoch"], length
    return _Pass(epoch, order, buffer, rank, world, worker, num_workers, length, min(start, length))


def check_share(dataset: S5Dataset, budget: int, num_workers: int) -> int:
    """Each worker's share of ``budget``.

    Raises:
        BudgetError: the largest sample does not fit in a share.
    """
    share = budget // num_workers
    largest = dataset.samples[dataset.samples.largest()]
    if largest.size > share:
        raise BudgetError(
            f"the budget of {format_size(budget)} split between {num_workers} DataLoader "
            f"workers leaves {format_size(share)} each, less than sample {largest.key!r} "
            f"({', '.join(f.uri for f in largest.fields[:3])}, {format_size(largest.size)}); "
            "raise the budget or use fewer workers"
        )
    return share


class _WorkerSampler(S5Sampler):
    """The staging engine of one worker: an :class:`S5Sampler` whose pass is that worker's
    part of the epoch (from a position), not its rank's whole part."""

    def __init__(self, owner: S5IterableDataset, p: _Pass, **options: Any) -> None:
        super().__init__(
            owner.dataset, shuffle=p.order.shuffle, seed=p.order.seed, num_replicas=p.num_replicas,
            rank=p.rank, drop_last=p.order.drop_last, **options,
        )
        self._pass_spec = p
        self._owner = owner

    def run(self, p: _Pass) -> Generator[StagedIndex, None, None]:
        """Stage and yield ``p``'s samples from its position on."""
        self._pass_spec = p
        self._order = p.order
        self.epoch = p.epoch
        self._pos.start = p.yielded
        self._pos.epoch_done = False
        return self._iterate()  # type: ignore[return-value]

    def position(self, p: _Pass) -> int:
        """``p``'s position after the last sample handed out (skipped samples included)."""
        return self._pos.start + self._pos.yielded

    def _epoch_plan(self, epoch: int, start: int = 0) -> tuple[list[int], list[int] | None]:
        # a worker's part has no windows of its own: the engine cuts its calls freely
        p = self._pass_spec
        units = self._units() if p.order.shuffle == "block" else None
        order = worker_order(
            p.order, len(self.dataset), epoch, p.worker, p.num_workers, p.shuffle_buffer,
            units=units, window=self._window, runs=self._owner._runs,
        )
        return order[start:], None

    def drop_finished(self) -> None:
        """Remove the folders of finished passes: every sample in them was read in this process."""
        self._passes.remove_replaced()


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
) -> list[int]:
    """One DataLoader worker's part of a rank's epoch, in the order it yields it.

    The rank's part is :meth:`Order.indices` (every rank the same count). Worker ``w`` of
    ``num_workers`` takes every ``num_workers``-th sample from the ``w``-th on, or, with
    ``shuffle="block"`` or ``runs`` (tar shards), the ``w``-th of ``num_workers`` contiguous
    runs (blocks and shards stay with one worker, which stages them alone). Then the shuffle
    buffer (see :class:`S5IterableDataset`) reorders it.
    """
    part = order.indices(n, epoch, 0, units=units, window=window)
    if order.shuffle == "block" or runs:
        lo, hi = len(part) * worker // num_workers, len(part) * (worker + 1) // num_workers
        mine = part[lo:hi]
    else:
        mine = part[worker::num_workers]
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
    if not isinstance(state, dict):
        raise StateError(f"expected a dict from S5IterableDataset.state_dict(), got {type(state).__name__}")
    missing = [k for k in _STATE_KEYS if k not in state]
    if missing:
        raise StateError(f"the state lacks {', '.join(missing)}; was it made by S5IterableDataset.state_dict()?")
    if state["version"] != STATE_VERSION:
        raise StateError(f"unknown state version {state['version']!r} (this s5loader writes {STATE_VERSION})")
    for k in ("epoch", "yielded", "num_replicas", "rank", "num_workers", "worker", "dataset_len", "seed",
              "shuffle_buffer"):
        v = state[k]
        if not isinstance(v, int) or isinstance(v, bool) or (k != "seed" and v < 0):
            raise StateError(f"state[{k!r}] must be a non-negative int, got {v!r}")
    if state["shuffle"] not in (True, False, "block") or state["shuffle"] is None:
        raise StateError(f"state['shuffle'] must be True, False or 'block', got {state['shuffle']!r}")
    for k in ("drop_last", "complete"):
        if not isinstance(state[k], bool):
            raise StateError(f"state[{k!r}] must be a bool, got {state[k]!r}")
    if state["num_replicas"] < 1 or state["rank"] >= state["num_replicas"]:
        raise StateError(f"state has rank {state['rank']} of {state['num_replicas']}")
    if state["num_workers"] < 1 or state["worker"] >= state["num_workers"]:
        raise StateError(f"state has worker {state['worker']} of {state['num_workers']}")
    if state["dataset_len"] != dataset_len:
        raise StateError(f"the state is for a data set of {state['dataset_len']} samples; this one has {dataset_len}")
    out = {k: state[k] for k in _STATE_KEYS}
    out["shuffle"] = "block" if state["shuffle"] == "block" else bool(state["shuffle"])
    return out
