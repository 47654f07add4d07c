"""S5IterableDataset: samples streamed in order, no sampler needed, equal counts on every rank.

Each epoch's order is the one :class:`~s5loader.S5Sampler` would use (the same permutation, the
same split across ranks, padded or cut so every rank gets the same count). Each rank stages its
order once, within its whole budget: its first DataLoader worker hosts the staging run and sends
each staged sample to the worker that reads it (see :mod:`s5loader._sampling.feed`); the workers
take turns along the rank's order.
"""

from __future__ import annotations

import logging
import math
import secrets
import weakref
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from torch.utils.data import IterableDataset

from ._engine.counters import Metrics
from ._sampling.cacheplan import pin_to_nodes
from ._sampling.feed import Hello, connect, local, rendezvous_name
from ._sampling.iterchecks import BlockStamp, check_buffer, check_count, check_options, check_worker_count
from ._sampling.iterparts import STATE_VERSION as STATE_VERSION
from ._sampling.iterparts import _Pass, check_state, freeze_inherited, read_feed, start_pass
from ._sampling.iterparts import buffer_shuffle as buffer_shuffle
from ._sampling.iterparts import worker_length as worker_length
from ._sampling.iterrest import RankRest, read_state
from ._sampling.order import Order
from ._sampling.rankhost import Hosting, read_board
from ._staging.area import StagingArea
from ._staging.epochcache import EpochCache
from ._util.dist import pytorch_worker_info, rank_info
from ._util.platform import require_linux
from ._util.uri import format_size
from .config import Access, StagingOptions
from .dataset import S5Dataset, Transform
from .exceptions import ConfigError, StateError

log = logging.getLogger(__name__)


class S5IterableDataset(IterableDataset[Any]):
    """An iterable dataset over an :class:`S5Dataset`: no sampler, equal samples per rank.

    Each epoch, the samples are ordered as :class:`~s5loader.S5Sampler` orders them (a
    permutation per ``seed + epoch``, ``"block"`` order, a shard order over tar shards, or key
    order), split across the ranks so that every rank gets the same number of samples (padded
    by repetition, or cut with ``drop_last``, as ``DistributedSampler``). So every rank yields
    the same count, and with the same ``batch_size`` and ``num_workers`` the same number of
    batches: no rank waits for another at the epoch's end.

    Each rank stages its order once, as a sampler does: one staging run (one s5cmd pool, one
    budget, one streamed first shard, one boto3 client) in the rank's first DataLoader worker
    (in the process itself with ``num_workers=0``), into a folder inside this dataset's staging
    directory, never holding more than ``budget`` staged and not yet read. The workers take
    turns along the rank's order, ``chunk`` samples at a time (``batch_size``, else one):
    worker ``w`` of ``k`` reads the positions ``p`` with ``(p // chunk) % k == w``, each as
    soon as it is staged, and deletes its files as it reads it (a shard's sample, punched out:
    see the guide's "Shuffling"). With ``batch_size`` given, the loader yields the rank's order
    exactly, and the budget need hold about one batch ahead; without it, about one batch per
    worker.

    Args:
        dataset: the samples (an :class:`S5Dataset`; its ``transform`` applies).
        shuffle: ``True``, ``False`` or ``"block"``, as for :class:`~s5loader.S5Sampler`.
        seed: the seed of the permutation and of the shuffle buffer.
        shuffle_buffer: ``0`` (default): no buffer. ``k > 1``: the rank's order of the epoch
            passes through a buffer of ``k`` samples, as WebDataset's ``shuffle(k)``: the
            first ``k`` samples fill it; then each next sample out is drawn uniformly at random
            from the buffer and its place taken by the next sample in; at the end the buffer
            empties in random order. A sample thus comes out at most ``k - 1`` places before
            its position in the unbuffered order, or any number of places after it; the draw is
            seeded by ``(seed, epoch, rank)``. The draw is made on the indices before staging,
            so the engine stages samples in the order they come out: the buffer costs no
            memory, and a resumed epoch continues the same draw. Over tar shards it mixes
            samples of the shards around them, which must then be staged together.
        batch_size: the ``batch_size`` of the DataLoader that will read this dataset, if you
            pass it here too: the workers then take turns a batch at a time, so the loader
            yields the rank's order exactly (a resumed state needs the same ``batch_size``).
            ``None`` (default): a sample at a time.
        num_workers: the ``num_workers`` of the DataLoader that will read this dataset; given,
            a DataLoader with another count is a ``ConfigError``. ``None``: any.
        drop_last: cut the tail so ranks get equal parts, instead of padding by repetition.
        num_replicas, rank: the distributed split; defaults (found when iterating) from
            torch.distributed, else ``WORLD_SIZE`` / ``RANK``, else one process.
        options, **staging: the staging options, as for :class:`~s5loader.S5Sampler` (one
            :class:`~s5loader.StagingOptions`, its fields as keyword arguments overriding it):
            ``budget`` is the most bytes staged and not yet read by this rank at any instant
            and must hold the largest sample (over tar shards, the largest shard);
            ``staging_dir`` (``None``: ``/dev/shm`` when it has room for the budget, else the
            system temp directory) holds a directory of this dataset's own, removed by
            :meth:`close`, garbage collection or exit. ``keep_staged`` is the sampler's alone.

    Raises:
        ConfigError: an invalid option.
        BudgetError: a sample larger than the budget, or a budget larger than the free space.
        PlatformError: not Linux.
    """

    def __init__(
        self,
        dataset: S5Dataset,
        options: StagingOptions | None = None,
        *,
        shuffle: bool | str = True,
        seed: int = 0,
        shuffle_buffer: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
        num_workers: int | None = None,
        batch_size: int | None = None,
        **staging: Any,
    ) -> None:
        require_linux("S5IterableDataset")
        self._options, root, self._cache = check_options(
            dataset,
            StagingOptions.merge(options, staging, "S5IterableDataset"),
            shuffle,
            seed,
            shuffle_buffer,
            drop_last,
            num_replicas,
            rank,
        )
        self._num_workers = check_count("num_workers", num_workers, 0)
        self._chunk = check_count("batch_size", batch_size, 1) or 1
        self.dataset = dataset
        self.shuffle: bool | str = shuffle if shuffle == "block" else bool(shuffle)
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.drop_last = drop_last
        self.budget = self._options.budget
        self._num_replicas = num_replicas
        self._rank = rank
        self.epoch = 0
        self._epoch_set = False
        self._loaded: dict[str, Any] | None = None  # a loaded state, applied by the next __iter__
        self._blocks = BlockStamp(self.dataset, self._options)  # how a "block" state's blocks were cut
        self._rest: RankRest | None = None  # or a loaded loader state's rest of its epoch
        self._pass: _Pass | None = None
        # Names the rendezvous of a rank's workers with their host (see rendezvous_name).
        self._uid = secrets.token_hex(6)
        self._key = secrets.token_hex(16)  # proves a hello comes from this loader (see .wire)
        self._iterations = 0
        # One directory for the whole dataset, made now by the process that owns it (the
        # DataLoader's workers make their folders inside it and never remove it).
        self._area = StagingArea(root)
        self._area.create()
        # With or without close(): the directory, and the epoch cache with its last user, go when
        # this dataset is collected or at the process's exit, as the sampler's do.
        # the rank's staging run, in the process that hosts it
        self._hosting = Hosting(
            dataset, replace(self._options, staging_dir=self._area.path), self.shuffle, self._cache
        )
        self._finalizer: Any = weakref.finalize(self, _release, self._hosting, self._area, self._cache)

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
            prefix,
            endpoint_url=endpoint_url,
            access=access,
            group_by=group_by,
            transform=transform,
            label=label,
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
        # each epoch draws its buffer anew: over tar shards, check what it keeps staged
        check_buffer(self.dataset, self._order(), self.shuffle_buffer, epoch, self._options, self._area.path)
        if self._rest is not None and self._rest.epoch != epoch:
            self._rest = None  # a loaded rest of an earlier epoch is over (see load_state_dict)
        self.epoch = epoch
        self._epoch_set = True

    def _order(self, rank: int | None = None, world: int | None = None) -> Order:
        # pinned to the nodes with an epoch cache on several (see cacheplan.pin_to_nodes)
        if rank is None or world is None:
            rank, world = rank_info(self._num_replicas, self._rank)
        order = Order(self.shuffle, self.seed, world, rank, self.drop_last)
        return pin_to_nodes(order, bool(self._options.epoch_cache))

    def __iter__(self) -> Iterator[Any]:
        # The pass is fixed here, not at the first next(): StatefulDataLoader takes a state
        # right after iter(), and one iterator may be dropped unused (a finished one restored).
        freeze_inherited()
        p = self._start_pass()
        self._pass = p
        self._iterations += 1
        name = rendezvous_name(self._uid, p.rank, self._iterations)
        if p.worker == 0:
            messages = local(self._hosting.host(p).open(name, p, self._key))
        else:
            hello = Hello(p.worker, p.num_workers, p.epoch, p.yielded, p.plan, self._key)
            messages = connect(name, hello, root=self._area.path)
        return read_feed(self.dataset, p, messages)

    def _start_pass(self, take: bool = True) -> _Pass:  # take: apply a loaded state, once
        rank, world, worker, nw = pytorch_worker_info(self._num_replicas, self._rank)
        check_worker_count(self._num_workers, nw, self.dataset.source)
        loaded, rest = self._loaded, self._rest
        if take:
            self._loaded = self._rest = None
        return start_pass(
            loaded,
            self._order(rank, world),
            self.shuffle_buffer,
            self.epoch,
            len(self.dataset),
            worker,
            nw,
            self._chunk,
            self.dataset.source or "the data set",
            rest,
        )

    def metrics(self) -> Metrics:
        """Live figures of this rank's staging (see :meth:`S5Sampler.metrics
        <s5loader.S5Sampler.metrics>`), from any thread of the training process: read from the
        run itself where this process hosts it (``num_workers=0``), else as the hosting worker
        last wrote them (at most every half second, and when a pass ends); before any, zeros
        and the budget."""
        here = self._hosting.metrics(self.epoch, len(self))
        if here is not None:
            return here
        rank, _ = rank_info(self._num_replicas, self._rank)
        return read_board(self._area.path, rank) or Metrics(
            epoch=self.epoch, samples=len(self), budget=self.budget
        )

    # -- resume (torchdata's Stateful protocol) ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this worker (or process, without workers) is in its share of the epoch.

        ``StatefulDataLoader`` calls it in each worker and keeps one state per worker. A state
        says the epoch, the samples of this worker's share handed out so far, and whether that
        share is complete.
        """
        if self._loaded is not None:
            return dict(self._loaded)
        p = self._pass if self._rest is None else None  # a pending rest is what a state says
        return self._blocks.stamp((p or self._start_pass(take=False)).state(len(self.dataset)), self.shuffle)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` at the next ``iter()``: a state saved mid-epoch
        makes the next pass the rest of that epoch, exactly what an uninterrupted run would
        still have yielded, with the same ranks, DataLoader workers and ``batch_size``; one saved
        after this worker's last sample, an empty pass, then the epoch :meth:`set_epoch` named,
        else the next. On other ranks, workers or ``batch_size``, give it a rank's whole
        ``StatefulDataLoader.state_dict()`` and iterate a new loader without loading that state:
        the pass is this rank's part of what the epoch had left (:mod:`s5loader._sampling.iterrest`).

        Raises:
            StateError: the state does not fit this data set, or is not such a state.
        """

        try:
            check = lambda s: self._blocks.check(s, check_state(s, len(self.dataset)))  # noqa: E731
            self._loaded, self._rest, self.epoch = read_state(state, check, self.epoch, self._epoch_set)
        except StateError as exc:
            raise StateError(f"cannot resume {self.dataset.source or 'the data set'}: {exc}") from exc

    # -- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop staging, kill s5cmd, remove the staging directory and leave the epoch cache (the
        last user removes it). Safe to call twice."""
        _release(self._hosting, self._area, self._cache)

    def __enter__(self) -> S5IterableDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pass"] = None
        state["_finalizer"] = None
        return state

    def __repr__(self) -> str:
        return (
            f"S5IterableDataset({self.dataset!r}, shuffle={self.shuffle}, seed={self.seed}, "
            f"shuffle_buffer={self.shuffle_buffer}, budget={format_size(self.budget)}, "
            f"staging_dir={self._area.path!r})"
        )


def _release(hosting: Hosting, area: StagingArea, cache: EpochCache | None) -> None:
    """Stop this process's staging host, leave the epoch cache (the last user removes it) and
    remove the dataset's directory."""
    hosting.close()
    if cache is not None:
        cache.close()
    area.remove()
