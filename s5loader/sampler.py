"""S5Sampler: orders the samples, stages them ahead with s5cmd, and yields their indices."""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler, Sampler

from ._engine import Stats
from ._engine.counters import Metrics
from ._sampling.order import WINDOW_CAP, ShuffleQuality, block_window, shuffle_quality  # noqa: F401 (re-exported)
from ._sampling.pieces import part_len
from ._sampling.resume import sampler_state
from ._sampling.setup import check_loader_batch, loader_batch_size, staging_options
from ._sampling.staging import Staging
from ._util.platform import require_linux
from ._util.uri import format_size
from .config import StagingOptions
from .dataset import S5Dataset
from .exceptions import ConfigError

log = logging.getLogger(__name__)


class S5Sampler(Sampler[int]):
    """A drop-in Sampler (and ``DistributedSampler``) that stages samples with s5cmd.

    Each epoch it orders the indices (a permutation per ``seed + epoch`` when ``shuffle``),
    takes this rank's part, and stages it into a directory of its own with background
    ``s5cmd run`` calls of ``samples_per_call`` samples, ``calls_in_flight`` of them at once, never
    holding more than ``budget`` bytes staged and not yet read. It yields each index in order once
    its sample is staged, but to a DataLoader (with ``on_error="raise"``) at once, and the
    :class:`S5Dataset` that reads it waits for it: a batch waits only for its own samples. The
    :class:`S5Dataset` reads and deletes the files.

    Args:
        dataset: the :class:`S5Dataset` to stage for.
        options: the staging options (:class:`~s5loader.StagingOptions`: ``budget``,
            ``samples_per_call``, ``calls_in_flight``, ``s5cmd_workers``, ``block_size``,
            ``staging_dir``, ``stall_timeout``, ``retries``, ``retry_backoff``, ``on_error``,
            ``verify``, ``keep_staged``, ``shrink_budget``, ``epoch_cache``,
            ``keep_epoch_cache``), the same object for every front end; default: its defaults.
        shuffle: ``True``: a new permutation of all samples each epoch (call :meth:`set_epoch`);
            ``"block"``: permute blocks of up to ``block_size`` samples (see
            :class:`~s5loader.StagingOptions` for when a block takes twice as many) that share a key prefix,
            gather them into windows of whole blocks, and shuffle the samples within each window; a
            window holds as many samples as three windows fit in ``budget`` (at most
            8192), so a batch draws from many blocks, and s5cmd fetches each block of 13 objects or
            more with one wildcard request; ``False``: key order. Over tar shards
            (:meth:`S5Dataset.from_shards`) each rank takes a contiguous run of the shards (permuted
            with ``True`` and ``"block"``), so a shard is fetched by one rank; with ``True`` the
            budget works as a shuffle buffer: shards open as soon as what the open ones still hold
            (read samples give their bytes back) leaves room, and each next sample comes from an open
            shard at random (see :meth:`Order.shard_order
            <s5loader._sampling.order.Order.shard_order>`); a budget that holds few shards, which
            mixes class-sorted shards poorly, is a warning at ``iter()`` naming the budget that mixes
            like a 1000-sample shuffle buffer.
        seed: the permutation's seed; the same seed and epoch give the same order everywhere.
        num_replicas, rank: the distributed split; defaults from torch.distributed, else
            ``WORLD_SIZE`` / ``RANK``, else one process.
        drop_last: drop the tail so ranks get equal parts, instead of padding by repetition.
        batch_size: the DataLoader's ``batch_size``, if you pass it here too (a sampler does not
            see its DataLoader): a budget that cannot hold one batch of the largest samples is
            then a :class:`BudgetError` at once instead of after ``stall_timeout``.
        **staging: any field of :class:`~s5loader.StagingOptions`, overriding ``options``'
            (``S5Sampler(ds, budget="8GiB", shuffle="block")``). ``buffers`` and ``numworkers``,
            the former names of ``calls_in_flight`` and ``s5cmd_workers``, are still accepted
            for one release, with a ``DeprecationWarning``.

    In short: each sampler stages into a directory of its own below ``staging_dir`` (``None``
    picks ``/dev/shm`` when it has room for the budget, else the system temp directory),
    removed by :meth:`close`, garbage collection, exit or SIGTERM; it never holds more than
    ``budget`` bytes staged and not yet read (the budget must hold at least a batch and the
    DataLoader's prefetch); ``epoch_cache`` bytes of read samples, chosen from the start of the
    next epoch's order, stay staged for it, shared by the node's local ranks (see the guide's
    "Epoch cache"); ``on_error="skip"`` logs and counts a sample that cannot be fetched in
    :attr:`stats` instead of raising.

    Raises:
        ConfigError: an invalid option.
        BudgetError: a sample larger than the budget, a budget larger than the free space, or
            (with ``batch_size``) a budget smaller than a batch.
        PlatformError: not Linux.
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
        buffers: int | None = None,
        numworkers: int | None = None,
        **staging: Any,
    ) -> None:
        require_linux("S5Sampler")
        if not isinstance(dataset, S5Dataset):
            raise ConfigError(f"S5Sampler needs an S5Dataset, got {type(dataset).__name__}")
        options = staging_options(
            options,
            staging,
            "S5Sampler",
            buffers=("calls_in_flight", buffers),
            numworkers=("s5cmd_workers", numworkers),
        )
        self.dataset = dataset
        self._staging = Staging(
            dataset,
            options,
            shuffle=shuffle,
            seed=seed,
            num_replicas=num_replicas,
            rank=rank,
            drop_last=drop_last,
            batch_size=batch_size,
        )
        self._run = self._staging.run
        self._epochs = self._staging.epochs
        self._warned = False
        self.keep_staged = self._run.options.keep_staged
        self.epoch = 0
        self._pos = self._run.position  # where this rank is in self.epoch (see state_dict)

    # -- the Sampler protocol -----------------------------------------------------------
    @property
    def staging_dir(self) -> str:
        """This sampler's own staging directory (created on first iteration)."""
        return self._run.area.path

    @property
    def budget(self) -> int:
        return self._options.budget

    @property
    def _options(self) -> StagingOptions:
        return self._run.options

    @property
    def num_replicas(self) -> int:
        return self._epochs.order.num_replicas

    @property
    def rank(self) -> int:
        return self._epochs.order.rank

    def __len__(self) -> int:
        return part_len(len(self.dataset), self._epochs.order.num_replicas, self._epochs.order.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` for the next pass (as ``DistributedSampler``).

        It may come before or after :meth:`load_state_dict` (``StatefulDataLoader`` applies a
        loaded state lazily, at the next ``iter(loader)``): a state saved mid-epoch continues
        its own epoch; a state saved after an epoch's last sample leaves the next pass to the
        epoch set here.
        """
        if epoch != self.epoch:
            self._pos.restart()
        self.epoch = int(epoch)
        self._pos.epoch_set = True

    def __iter__(self) -> Iterator[int]:
        """The indices of the next pass, each once its sample is staged; to a DataLoader's own
        BatchSampler at once, as :meth:`batches` does. Its batch size is looked up in the frame
        that asks for the iterator, the only place a sampler given as ``DataLoader(ds,
        sampler=sampler, batch_size=n)`` can learn it (see
        :func:`~s5loader._sampling.setup.loader_batch_size`)."""
        return self._start(loader_batch_size(self, sys._getframe(1)))

    def batches(self, batch_size: int, drop_last: bool = False) -> BatchSampler:
        """A BatchSampler for ``DataLoader(ds, batch_sampler=sampler.batches(n))``: the explicit
        way to give the sampler the DataLoader's batch size, where a wrapper or torchdata's
        ``StatefulDataLoader`` hides it (its ``state_dict`` is this sampler's). The batches are
        those of ``DataLoader(ds, sampler=sampler, batch_size=n, drop_last=drop_last)``; a budget
        smaller than one is a :class:`~s5loader.BudgetError` at ``iter()``, and an index not
        staged yet goes out at once (its reader waits), so a batch waits only for itself."""
        return LoaderBatches(self, batch_size, drop_last)

    def _start(self, batch: int | None) -> Iterator[int]:
        """:meth:`__iter__` with the batch size of the DataLoader that cuts the indices, if any."""
        if batch is not None:  # a budget smaller than a batch: an error now, not a stall
            check_loader_batch(self.dataset, self.budget, batch)
        few = None if self._warned else self._epochs.few_shards(self.budget)
        self._warned = True
        if few:  # a budget that holds few shards: said once
            warnings.warn(few, UserWarning, stacklevel=3)
        return self._epochs.stage(lambda: self.epoch, self._pos, batch, self.budget)

    def _epoch_order(self, epoch: int, start: int = 0) -> list[int]:
        return self._epochs.plan(epoch, start)[0]

    def _epoch_plan(self, epoch: int, start: int = 0) -> tuple[list[int], list[int] | None]:
        """This rank's order from ``start`` on, and (``shuffle="block"``) where its windows begin."""
        return self._epochs.plan(epoch, start)

    @property
    def window(self) -> int:
        """The most samples of a ``shuffle="block"`` window (see ``shuffle``); over tar shards
        with ``shuffle`` True or False, the shards open at once where read samples give nothing
        back (a ``shuffle=True`` order that counts what they give back opens more)."""
        return self._epochs.window

    def shuffle_quality(self, epoch: int | None = None, span: int = 256) -> ShuffleQuality:
        """How well this rank's order of ``epoch`` (default: the current one) mixes blocks (over
        tar shards: shards), computed from the order alone: nothing is fetched.

        Args:
            epoch: the epoch whose order is measured.
            span: the run length measured, e.g. the batch size.

        Returns:
            the mean number of distinct blocks (shards) among ``span`` consecutive samples (a
            sample outside any block counts as a block of its own), among the first ``span``
            (the first batch) and among 64 consecutive samples (over shards of one class each:
            the classes a batch of 64 mixes), and the mean distance a sample moves from its key
            order, as a share of the data set (about 1/3 for a full shuffle, 0 for none). A full
            shuffle draws about ``span`` blocks per run when blocks are many; key order about
            ``span`` / the block size.
        """
        return self._epochs.quality(self.epoch if epoch is None else epoch, span)

    @property
    def stats(self) -> Stats | None:
        """What the last finished (or current) pass did: samples, bytes, calls, retries,
        skipped URIs and the time the loader waited for staging."""
        return self._run.passes.stats()

    def metrics(self) -> Metrics:
        """Live figures of the current pass, cheap enough to call every training step (no
        lock, no system call but a clock read; safe from any thread).

        Between passes: the last pass's figures as it ended; before the first: zeros and the
        budget. The fields are described in :class:`~s5loader._engine.counters.Metrics`:
        bytes staged and the budget, samples ready ahead of the loader, calls and objects in
        flight, MB/s and samples/s over the last few seconds, the time the loader waited for
        staging, retries, skips, the epoch and the position in it.
        """
        return self._run.metrics(self.epoch, len(self))

    def write_command_files(self, directory: str, epoch: int | None = None) -> list[str]:
        """Write the s5cmd command files this rank would run for an epoch, without running them.

        The files stage into ``directory`` as the sampler stages into its own directory (the
        same wildcard lines for whole blocks and multi-object samples, ``cp --raw`` lines for
        the rest, ``samples_per_call`` samples' worth per file (over shards, of shards), cut
        at window starts with ``shuffle="block"``, without the small first calls), so
        ``s5cmd run FILE`` reproduces the sampler's fetching with no Python involved; files
        fetched by wildcard lines stay in their ``.cN/`` scratch folders.

        Returns:
            the paths of the command files, in order.
        """
        return self._epochs.command_files(directory, self.epoch if epoch is None else epoch)

    # -- resume (torchdata's Stateful protocol) --------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the epoch, the samples consumed in it, and whether it is complete.

        A state taken after the epoch's last sample was handed out (``"complete": True``)
        means "epoch ``epoch`` is done": loading it makes the next pass a whole epoch, the one
        :meth:`set_epoch` names.
        """
        return self._epochs.state(self.epoch, self._pos)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`, staging only what is left.

        A state saved mid-epoch continues that epoch where it stopped, whatever
        :meth:`set_epoch` said. A state saved after an epoch's last sample makes the next
        pass a whole epoch: the one given to :meth:`set_epoch` (before or after this call),
        else the epoch after the saved one. So resuming a loop that saves
        ``loader.state_dict()`` after each epoch and calls ``set_epoch(epoch + 1)`` yields
        exactly the epoch an uninterrupted run yields. A state from a different number of
        ranks continues the same global order at the position all ranks had reached together;
        where each rank reads a part of its own (tar shards, ``shuffle="block"``), each rank
        takes its part of what the epoch had left (see :mod:`s5loader._sampling.elastic`).

        ``state`` may also be a whole ``StatefulDataLoader.state_dict()``: its sampler's state
        is taken from it, so a loader of another ``num_workers`` or ``batch_size`` (which
        ``StatefulDataLoader`` itself refuses to load) resumes the epoch: load it here and
        iterate a new loader without loading its state.

        Raises:
            StateError: the state does not fit (another data set size, negative counts, an
                unknown version, a missing key).
        """
        self.epoch = self._epochs.load(sampler_state(state), self.epoch, self._pos)

    # -- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop staging, kill s5cmd, remove the staging directory. Safe to call twice."""
        self._staging.close()

    def __enter__(self) -> S5Sampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        o = self._epochs.order
        return (
            f"S5Sampler({self.dataset!r}, shuffle={o.shuffle}, seed={o.seed}, rank={o.rank}/"
            f"{o.num_replicas}, budget={format_size(self.budget)}, staging_dir={self.staging_dir!r})"
        )


class LoaderBatches(BatchSampler):
    """The batches of an :class:`S5Sampler` for a DataLoader's ``batch_sampler=`` (made by
    :meth:`S5Sampler.batches`): the sampler iterated with the batch size given, as a
    DataLoader's own BatchSampler iterates it; resumable through the sampler's state."""

    sampler: S5Sampler

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for idx in self.sampler._start(self.batch_size):
            batch.append(idx)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The sampler's :meth:`~S5Sampler.state_dict` (torchdata's Stateful protocol)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The sampler's :meth:`~S5Sampler.load_state_dict`."""
        self.sampler.load_state_dict(state)
