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
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset

from ._sampling.iterchecks import check_options, check_workers_buffer, worker_share
from ._sampling.iterparts import STATE_VERSION as STATE_VERSION
from ._sampling.iterparts import WorkerStaging, _Pass, check_state, resumed_epoch, start_pass
from ._sampling.order import Order
from ._sampling.units import units_of
from ._sampling.workerorder import buffer_shuffle as buffer_shuffle
from ._sampling.workerorder import worker_length as worker_length
from ._sampling.workerorder import worker_order as worker_order
from ._util.dist import pytorch_worker_info, rank_info
from ._util.platform import require_linux
from ._util.uri import format_size
from .config import Access, StagingOptions
from .dataset import S5Dataset, Transform
from .exceptions import ConfigError, StateError
from .staging.area import StagingArea

log = logging.getLogger(__name__)


class S5IterableDataset(IterableDataset[Any]):
    """An iterable dataset over an :class:`S5Dataset`: no sampler, equal samples per rank.

    Each epoch, the samples are ordered as :class:`~s5loader.S5Sampler` orders them (a
    permutation per ``seed + epoch``, ``"block"`` order or key order), split across the
    ranks so that every rank gets the same number of samples (padded by repetition, or cut
    with ``drop_last``, as ``DistributedSampler``), and this rank's part is split between its
    DataLoader workers (every ``num_workers``-th sample; contiguous runs with
    ``shuffle="block"`` and over tar shards, so that blocks stay whole and a shard is staged
    by one worker). So every rank yields the same count, and with the same ``batch_size`` and
    ``num_workers`` the same number of batches: no rank waits for another at the epoch's end.

    Each worker (the main process with ``num_workers=0``) runs a staging engine of its own:
    background ``s5cmd run`` calls stage its part, in the order it yields it, into a folder of
    its own inside this dataset's staging directory, within ``budget / num_workers`` bytes, so
    the workers of a rank together never hold more than ``budget`` staged. A sample's files
    are read and deleted as it is yielded (a shard's, punched out: see the guide's "Shuffling").

    Args:
        dataset: the samples (an :class:`S5Dataset`; its ``transform`` applies).
        shuffle: ``True``, ``False`` or ``"block"``, as for :class:`~s5loader.S5Sampler`.
        seed: the seed of the permutation and of the shuffle buffer.
        shuffle_buffer: ``0`` (default): none. ``k > 1``: each worker's part goes through
            WebDataset's ``shuffle(k)``, drawn on the indices (seeded by ``(seed, epoch, rank,
            worker)``), so samples are staged in the order they come out and a resume continues
            the draw. Over tar shards a sample it holds back keeps its shard staged: with
            ``num_workers``, what each worker then needs at once is checked against its share
            here and at :meth:`set_epoch` (see the guide's "Iterable dataset").
        budget: most bytes staged and not yet read by this rank at any instant (``"2GiB"``,
            ``"500MB"`` or an int), shared equally by its DataLoader workers; each share must
            hold the largest sample (over tar shards: the largest shard).
        num_workers: the ``num_workers`` of the DataLoader that will read this dataset. Given,
            the budget's split between the workers is checked here, in the main process, before
            any worker starts (a DataLoader with another count is then a ``ConfigError``).
            ``None`` (default): each worker checks its share when it starts, and a share too
            small is a ``BudgetError`` raised through the DataLoader.
        staging_dir: the staging root; ``None`` picks ``/dev/shm`` when it has room for the
            budget, else the system temp directory. This dataset stages into a directory of its
            own below it, one folder per worker, removed by :meth:`close`, garbage collection
            or exit.
        drop_last: cut the tail so ranks get equal parts, instead of padding by repetition.
        num_replicas, rank: the distributed split; defaults (found when iterating) from
            torch.distributed, else ``WORLD_SIZE`` / ``RANK``, else one process.
        samples_per_call, block_size, calls_in_flight, shrink_budget, stall_timeout, retries,
            on_error, verify, s5cmd_workers, epoch_cache, keep_epoch_cache: as for
            :class:`~s5loader.S5Sampler` (checked by :class:`~s5loader.StagingOptions`).

    Raises:
        ConfigError: an invalid option.
        BudgetError: a sample larger than the budget (or a worker's share: see ``num_workers``
            and ``shuffle_buffer``), or a budget larger than the free space.
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
        num_workers: int | None = None,
        epoch_cache: int | str = 0, keep_epoch_cache: bool = False,
    ) -> None:
        require_linux("S5IterableDataset")
        engine_options: dict[str, Any] = {
            "samples_per_call": samples_per_call, "block_size": block_size, "calls_in_flight": calls_in_flight,
            "stall_timeout": stall_timeout, "retries": retries, "on_error": on_error,
            "verify": verify, "s5cmd_workers": s5cmd_workers, "epoch_cache": epoch_cache,
        }
        budget_bytes, root, self._cache, self._num_workers = check_options(
            dataset, shuffle, seed, shuffle_buffer, drop_last, num_replicas, rank, budget, staging_dir,
            shrink_budget, engine_options, keep_epoch_cache, num_workers,
        )
        self.dataset = dataset
        self.shuffle: bool | str = shuffle if shuffle == "block" else bool(shuffle)
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.drop_last = drop_last
        self.budget = budget_bytes
        # over tar shards a worker takes a contiguous run of the rank's shards, so that it alone
        # stages them (interleaved samples would have every worker fetch every shard)
        self._runs = units_of(dataset).worker_runs
        self._num_replicas = num_replicas
        self._rank = rank
        self._engine_options = engine_options
        self.epoch = 0
        self._epoch_set = False
        self._loaded: dict[str, Any] | None = None  # a loaded state, applied by the next __iter__
        self._pass: _Pass | None = None
        self._engine: WorkerStaging | None = None
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

        Raises:
            ConfigError: not an int >= 0. BudgetError: with ``num_workers``, over tar shards,
                ``shuffle_buffer`` keeps more staged in this epoch than a worker's share holds.
        """
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ConfigError(f"epoch must be an int >= 0, got {epoch!r}")
        if self._num_workers is not None:  # each epoch draws its buffer anew
            check_workers_buffer(self.dataset, self._order(), self.shuffle_buffer, epoch, self.budget, self._num_workers,
                                 self._engine_options["calls_in_flight"], self._cache is not None, self._area.path)
        self.epoch = epoch
        self._epoch_set = True

    def _order(self) -> Order:
        rank, world = rank_info(self._num_replicas, self._rank)
        return Order(self.shuffle, self.seed, world, rank, self.drop_last, self._runs)

    def __iter__(self) -> Iterator[Any]:
        # The pass is fixed here, not at the first next(): StatefulDataLoader takes a state
        # right after iter(), and one iterator may be dropped unused (a finished one restored).
        p = self._start_pass()
        self._pass = p
        return self._generate(p)

    def _start_pass(self) -> _Pass:
        _, _, worker, nw = pytorch_worker_info(self._num_replicas, self._rank)
        loaded, self._loaded = self._loaded, None
        return start_pass(
            loaded, self._order(), self.shuffle_buffer, self.epoch, len(self.dataset), worker, nw, self._runs,
            self.dataset.source or "the data set",
        )

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
                p.yielded = engine.position()
                yield sample
            p.yielded = p.length
            finished = True
        finally:
            indices.close()
            if finished:
                engine.drop_finished()

    def _worker_engine(self, p: _Pass) -> WorkerStaging:
        key = (os.getpid(), p.rank, p.num_replicas, p.worker, p.num_workers)
        if self._engine is not None and self._engine_key == key:
            return self._engine
        if self._engine is not None and self._engine_key is not None and self._engine_key[0] == os.getpid():
            self._engine.close()
        share = worker_share(self.dataset, self.budget, self._num_workers, p.num_workers)
        options = StagingOptions(budget=share, staging_dir=self._area.path, **self._engine_options)
        told = self._num_workers is not None  # then the buffer was checked before the workers started
        engine = WorkerStaging(self.dataset, options, self._area.path, self._runs, self.shuffle, self._cache, told)
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
            p = _Pass(self.epoch, self._order(), self.shuffle_buffer, rank, world, worker, nw, 1, 0)
        return p.state(len(self.dataset))

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
        self.epoch = resumed_epoch(self._loaded, self.epoch, self._epoch_set)

    # -- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop staging, kill s5cmd, remove the staging directory. Safe to call twice."""
        engine, self._engine = self._engine, None
        if engine is not None and self._engine_key is not None and self._engine_key[0] == os.getpid():
            engine.close()
        if self._cache is not None:
            self._cache.close()
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

    def __repr__(self) -> str:
        return (
            f"S5IterableDataset({self.dataset!r}, shuffle={self.shuffle}, seed={self.seed}, "
            f"shuffle_buffer={self.shuffle_buffer}, budget={format_size(self.budget)}, "
            f"staging_dir={self._area.path!r})"
        )
