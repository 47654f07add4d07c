"""S5IterableDataset: samples streamed in order, no sampler needed, equal counts on every rank.

Each epoch's order is the one :class:`~s5loader.S5Sampler` would use (the same permutation, the
same split across ranks, padded or cut so every rank gets the same count); the DataLoader
workers of a rank split that rank's part between them, and each worker stages its own part
with its own staging engine, under its share of the byte budget.
"""

from __future__ import annotations

import logging
import math
import multiprocessing.util
import os
import weakref
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from ._dist import pytorch_worker_info, rank_info
from ._order import Order
from ._platform import require_linux
from ._uri import format_size, parse_size
from .config import Access, StagingOptions
from .dataset import S5Dataset, StagedIndex, Transform
from .engine.budget import check_sample_fits
from .exceptions import BudgetError, ConfigError, StateError
from .sampler import S5Sampler
from .staging.area import StagingArea, choose_root, disk_footprint

log = logging.getLogger(__name__)

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


class S5IterableDataset(IterableDataset[Any]):
    """An iterable dataset over an :class:`S5Dataset`: no sampler, equal samples per rank.

    Each epoch, the samples are ordered as :class:`~s5loader.S5Sampler` orders them (a
    permutation per ``seed + epoch``, ``"block"`` order or key order), split across the
    ranks so that every rank gets the same number of samples (padded by repetition, or cut
    with ``drop_last``, as ``DistributedSampler``), and this rank's part is split between its
    DataLoader workers (every ``num_workers``-th sample; contiguous runs with
    ``shuffle="block"`` and over tar shards, so that blocks stay whole and a shard is staged
    by one worker). So every rank yields the same count, and
    with the same ``batch_size`` and ``num_workers`` the same number of batches: no rank waits
    for another in a collective at the end of an epoch.

    Each worker (the main process with ``num_workers=0``) runs a staging engine of its own:
    background ``s5cmd run`` calls stage its part, in the order it yields it, into a folder of
    its own inside this dataset's staging directory, within ``budget / num_workers`` bytes, so
    the workers of a rank together never hold more than ``budget`` staged. A sample's files
    are read and deleted as it is yielded.

    Args:
        dataset: the samples (an :class:`S5Dataset`; its ``transform`` applies).
        shuffle: ``True``, ``False`` or ``"block"``, as for :class:`~s5loader.S5Sampler`.
        seed: the seed of the permutation and of the shuffle buffer.
        shuffle_buffer: ``0`` (default): no buffer. ``k > 1``: each worker passes its part of
            the epoch through a buffer of ``k`` samples, as WebDataset's ``shuffle(k)``: the
            first ``k`` samples fill it; then each next sample out is drawn uniformly at random
            from the buffer and its place taken by the next sample in; at the end the buffer
            empties in random order. A sample thus comes out at most ``k - 1`` places before
            its position in the unbuffered order, or any number of places after it; the draw is
            seeded by ``(seed, epoch, rank, worker)``. The draw is made on the indices before staging,
            so the engine stages samples in the order they come out: the buffer costs no
            staging space, and a resumed epoch continues the same draw. Useful with
            ``shuffle=False`` or ``"block"`` (which already shuffles within each
            ``samples_per_call`` window).
        budget: most bytes staged and not yet read by this rank at any instant (``"2GiB"``,
            ``"500MB"`` or an int), shared equally by its DataLoader workers; each share must
            hold the largest sample.
        staging_dir: the staging root; ``None`` picks ``/dev/shm`` when it has room for the
            budget, else the system temp directory. This dataset stages into a directory of its
            own below it, one folder per worker, removed by :meth:`close`, garbage collection
            or exit.
        drop_last: cut the tail so ranks get equal parts, instead of padding by repetition.
        num_replicas, rank: the distributed split; defaults (found when iterating) from
            torch.distributed, else ``WORLD_SIZE`` / ``RANK``, else one process.
        samples_per_call, block_size, calls_in_flight, shrink_budget, stall_timeout, retries,
            on_error, verify, s5cmd_workers: as for :class:`~s5loader.S5Sampler` (checked by
            :class:`~s5loader.StagingOptions`).

    Raises:
        ConfigError: an invalid option.
        BudgetError: a sample larger than the budget, or a budget larger than the free space.
        PlatformError: not Linux.
    """

    def __init__(
        self,
        dataset: S5Dataset,
        *,
        shuffle: bool | str = True,
        seed: int = 0,
        shuffle_buffer: int = 0,
        budget: int | str = "2GiB",
        staging_dir: str | None = None,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
        samples_per_call: int = 1000,
        block_size: int = 64,
        calls_in_flight: int = 2,
        shrink_budget: bool = False,
        stall_timeout: float = 60.0,
        retries: int = 3,
        on_error: str = "raise",
        verify: bool = False,
        s5cmd_workers: int = 256,
    ) -> None:
        require_linux("S5IterableDataset")
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
        StagingOptions(
            budget=budget_bytes, samples_per_call=samples_per_call, calls_in_flight=calls_in_flight,
            s5cmd_workers=s5cmd_workers, block_size=block_size, stall_timeout=stall_timeout,
            retries=retries, on_error=on_error, verify=verify,
        )
        largest = dataset.samples[dataset.samples.largest()]
        check_sample_fits(largest, budget_bytes)
        need = min(budget_bytes, dataset.total_bytes)
        root, room = choose_root(staging_dir, need, shrink_budget, disk_footprint(dataset.samples.size))
        if room < need:
            check_sample_fits(largest, room, f"only {format_size(room)} fit in {root}")
            budget_bytes = room
        self.dataset = dataset
        self.shuffle: bool | str = shuffle if shuffle == "block" else bool(shuffle)
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.drop_last = drop_last
        self.budget = budget_bytes
        # over tar shards a worker takes a contiguous run of the epoch, so that its shards are
        # staged by it alone (interleaved samples would have every worker fetch every shard)
        self._runs = dataset.shards is not None
        self._num_replicas = num_replicas
        self._rank = rank
        self._engine_options: dict[str, Any] = {
            "samples_per_call": samples_per_call, "block_size": block_size, "calls_in_flight": calls_in_flight,
            "stall_timeout": stall_timeout, "retries": retries, "on_error": on_error,
            "verify": verify, "s5cmd_workers": s5cmd_workers,
        }
        self.epoch = 0
        self._epoch_set = False
        self._loaded: dict[str, Any] | None = None  # a loaded state, applied by the next __iter__
        self._pass: _Pass | None = None
        self._engine: _WorkerSampler | None = None
        self._engine_key: tuple[int, ...] | None = None
        # One directory for the whole dataset, made now by the process that owns it (the
        # DataLoader's workers make their folders inside it and never remove it).
        self._area = StagingArea(root)
        self._area.create()
        self._finalizer: Any = weakref.finalize(self, StagingArea.remove, self._area)

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def from_prefix(
        cls,
        prefix: str,
        *,
        endpoint_url: str | None = None,
        access: Access | None = None,
        group_by: str = "stem",
        transform: Transform | None = None,
        label: str | None = None,
        **options: Any,
    ) -> S5IterableDataset:
        """All objects under ``s3://bucket/prefix`` (as :meth:`S5Dataset.from_prefix`), streamed.

        ``options`` are those of :class:`S5IterableDataset` (``shuffle``, ``seed``,
        ``shuffle_buffer``, ``budget``, ``staging_dir``, ...).
        """
        ds = S5Dataset.from_prefix(
            prefix, endpoint_url=endpoint_url, access=access, group_by=group_by, transform=transform, label=label
        )
        return cls(ds, **options)

    @classmethod
    def from_shards(
        cls,
        source: str | list[str],
        *,
        index: str | None = None,
        endpoint_url: str | None = None,
        access: Access | None = None,
        transform: Transform | None = None,
        decode: bool = False,
        **options: Any,
    ) -> S5IterableDataset:
        """Tar shards in the WebDataset layout (as :meth:`S5Dataset.from_shards`), streamed.

        ``options`` are those of :class:`S5IterableDataset`.
        """
        ds = S5Dataset.from_shards(
            source, index=index, endpoint_url=endpoint_url, access=access, transform=transform, decode=decode
        )
        return cls(ds, **options)

    # -- the iterable protocol ----------------------------------------------------------
    def __len__(self) -> int:
        """Samples this rank yields per epoch (all its DataLoader workers together)."""
        _, world = rank_info(self._num_replicas, self._rank)
        n = len(self.dataset)
        return n // world if self.drop_last else math.ceil(n / world)

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` for the next pass (call it before each ``iter(loader)``).

        DataLoader workers get a copy of this dataset at ``iter(loader)``; with
        ``persistent_workers=True`` they keep theirs, so call it before the loader's first
        iteration only, or do without persistent workers.
        """
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ConfigError(f"epoch must be an int >= 0, got {epoch!r}")
        self.epoch = epoch
        self._epoch_set = True

    def __iter__(self) -> Iterator[Any]:
        # The pass is fixed here, not at the first next(): StatefulDataLoader takes a state
        # right after iter(), and one iterator may be dropped unused (a finished one restored).
        p = self._start_pass()
        self._pass = p
        return self._generate(p)

    def _start_pass(self) -> _Pass:
        rank, world, worker, nw = pytorch_worker_info(self._num_replicas, self._rank)
        loaded, self._loaded = self._loaded, None
        order = Order(self.shuffle, self.seed, world, rank, self.drop_last)
        buffer, epoch, start = self.shuffle_buffer, self.epoch, 0
        if loaded is not None and not loaded["complete"]:
            where = f"rank {rank} of {world}, worker {worker} of {nw}"
            saved = (
                f"rank {loaded['rank']} of {loaded['num_replicas']}, worker {loaded['worker']} of "
                f"{loaded['num_workers']}"
            )
            if saved != where:
                raise StateError(
                    f"a state of {self.dataset.source or 'the data set'} saved mid-epoch by {saved} "
                    f"cannot resume {where}: resume with the same number of ranks and DataLoader workers"
                )
            order = Order(loaded["shuffle"], loaded["seed"], world, rank, loaded["drop_last"])
            buffer, epoch, start = loaded["shuffle_buffer"], loaded["epoch"], loaded["yielded"]
        length = worker_length(order, len(self.dataset), worker, nw, self._runs)
        if loaded is not None and loaded["complete"]:
            # The saved epoch is over for this worker: this pass yields nothing (its remainder)
            # and the next one is the epoch after it (or the one set_epoch named).
            epoch, start = loaded["epoch"], length
        return _Pass(epoch, order, buffer, rank, world, worker, nw, length, min(start, length))

    def _generate(self, p: _Pass) -> Iterator[Any]:
        if p.complete:
            return
        engine = self._worker_engine(p)
        indices = engine.run(p)
        finished = False
        try:
            for idx in indices:
                sample = self.dataset[idx]
                # skipped samples (on_error="skip") count too, so a resumed pass lines up
                p.yielded = engine.position(p)
                yield sample
            p.yielded = p.length
            finished = True
        finally:
            indices.close()
            if finished:
                engine.drop_finished()

    def _worker_engine(self, p: _Pass) -> _WorkerSampler:
        key = (os.getpid(), p.rank, p.num_replicas, p.worker, p.num_workers)
        if self._engine is not None and self._engine_key == key:
            return self._engine
        if self._engine is not None and self._engine_key is not None and self._engine_key[0] == os.getpid():
            self._engine.close()
        share = self.budget // p.num_workers
        largest = self.dataset.samples[self.dataset.samples.largest()]
        if largest.size > share:
            raise BudgetError(
                f"the budget of {format_size(self.budget)} split between {p.num_workers} DataLoader "
                f"workers leaves {format_size(share)} each, less than sample {largest.key!r} "
                f"({', '.join(f.uri for f in largest.fields[:3])}, {format_size(largest.size)}); "
                "raise the budget or use fewer workers"
            )
        engine = _WorkerSampler(
            self, p, budget=share, staging_dir=self._area.path, **self._engine_options
        )
        self._engine, self._engine_key = engine, key
        if key[0] != self._area._owner:
            # A DataLoader worker runs no atexit handlers; multiprocessing's finalizers do run.
            multiprocessing.util.Finalize(None, engine.close, exitpriority=10)
        return engine

    # -- resume (torchdata's Stateful protocol) ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this worker (or process, without workers) is in its part of the epoch.

        ``StatefulDataLoader`` calls it in each worker and keeps one state per worker. A state
        says the epoch, the samples of this worker's part handed out so far, and whether that
        part is complete.
        """
        if self._loaded is not None:
            return dict(self._loaded)
        p = self._pass
        if p is None:
            rank, world, worker, nw = pytorch_worker_info(self._num_replicas, self._rank)
            p = _Pass(self.epoch, Order(self.shuffle, self.seed, world, rank, self.drop_last),
                      self.shuffle_buffer, rank, world, worker, nw, 1, 0)
        o = p.order
        return {
            "version": STATE_VERSION,
            "epoch": p.epoch,
            "seed": o.seed,
            "shuffle": o.shuffle,
            "shuffle_buffer": p.shuffle_buffer,
            "drop_last": o.drop_last,
            "num_replicas": p.num_replicas,
            "rank": p.rank,
            "num_workers": p.num_workers,
            "worker": p.worker,
            "dataset_len": len(self.dataset),
            "yielded": p.yielded,
            "complete": p.complete,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` at the next ``iter()``.

        A state saved mid-epoch makes the next pass the rest of that epoch, exactly the
        samples (in the same order) an uninterrupted run would still have yielded; it needs
        the same number of ranks and DataLoader workers. A state saved after this worker's
        last sample of an epoch makes the next pass empty (the rest of that epoch) and the
        one after it a whole epoch: the one :meth:`set_epoch` named, else the next.

        Raises:
            StateError: the state does not fit this data set, or is not such a state.
        """
        try:
            self._loaded = check_state(state, len(self.dataset))
        except StateError as exc:
            raise StateError(f"cannot resume {self.dataset.source or 'the data set'}: {exc}") from exc
        if self._loaded["complete"]:
            if not self._epoch_set:
                self.epoch = self._loaded["epoch"] + 1
        else:
            self.epoch = self._loaded["epoch"]

    # -- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop staging, kill s5cmd, remove the staging directory. Safe to call twice."""
        engine, self._engine = self._engine, None
        if engine is not None and self._engine_key is not None and self._engine_key[0] == os.getpid():
            engine.close()
        self._area.remove()

    def __enter__(self) -> S5IterableDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_engine"] = None  # threads and s5cmd children never cross a process boundary
        state["_engine_key"] = None
        state["_pass"] = None
        state["_finalizer"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (
            f"S5IterableDataset({self.dataset!r}, shuffle={self.shuffle}, seed={self.seed}, "
            f"shuffle_buffer={self.shuffle_buffer}, budget={format_size(self.budget)}, "
            f"staging_dir={self._area.path!r})"
        )


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
