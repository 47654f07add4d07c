"""Setting up an :class:`~s5loader.S5Sampler`: checking its options into an order and one
:class:`~s5loader.config.StagingOptions`, and sizing the budget against the data set and the
disk before anything is staged: the largest sample (or tar shard) must fit, ``keep_staged``
must hold the whole data set, the staging root must have room, and (when the batch size is
known) a batch must fit."""

from __future__ import annotations

import warnings
from dataclasses import replace
from types import FrameType
from typing import Any

import numpy as np
from torch.utils.data import BatchSampler

from .._engine.budget import check_sample_fits
from .._staging.area import choose_root, disk_footprint
from .._util.dist import rank_info
from .._util.uri import format_size
from ..config import StagingOptions
from ..dataset import S5Dataset
from ..exceptions import BudgetError, ConfigError
from .order import Order, check_seed, check_shuffle
from .units import units_of


def configure(
    dataset: S5Dataset,
    options: StagingOptions,
    *,
    shuffle: bool | str,
    seed: int,
    num_replicas: int | None,
    rank: int | None,
    drop_last: bool,
    batch_size: int | None,
) -> tuple[Order, int, StagingOptions, str]:
    """Check :class:`S5Sampler`'s own options against the staging ``options``: its order, its
    ``shuffle="block"`` window (over tar shards with ``shuffle`` True or False: the shards open
    at once), the staging options with the budget the staging root has room for, and that root."""
    shuffle = check_shuffle(shuffle)
    check_seed(seed)
    if batch_size is not None and (
        not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1
    ):
        raise ConfigError(f"batch_size must be a positive int or None, got {batch_size!r}")
    r, world = rank_info(num_replicas, rank)
    units = units_of(dataset)
    order = Order(shuffle, seed, world, r, bool(drop_last))
    # From the options, not the space found: every rank must cut the same windows.
    window = units.window(options.budget, shuffle)
    options, root = fit_budget(dataset, whole_windows(options, shuffle, window), batch_size)
    return order, window, options, root


def whole_windows(options: StagingOptions, shuffle: bool | str, window: int) -> StagingOptions:
    """The staging options of an order: under ``shuffle="block"`` a call holds whole windows,
    so that each block of it is one request (a wildcard line) in every front end."""
    if shuffle == "block":
        return replace(options, samples_per_call=max(options.samples_per_call, window))
    return options


def staging_options(
    options: StagingOptions | None, overrides: dict[str, Any], who: str, **renames: tuple[str, Any]
) -> StagingOptions:
    """A front end's one :class:`StagingOptions`: ``options`` with its keyword arguments
    (``overrides``) applied; ``renames`` maps a former keyword to (its new name, the value given),
    still accepted for one release with a ``DeprecationWarning``."""
    overrides = dict(overrides)
    for old, (new, value) in renames.items():
        if value is not None:
            if new in overrides:
                raise ConfigError(f"{old}= is the former name of {new}=; give only {new}={overrides[new]!r}")
            warnings.warn(f"{who}({old}=...) is deprecated; use {new}=", DeprecationWarning, stacklevel=4)
            overrides[new] = value
    return StagingOptions.merge(options, overrides, who)


def fit_budget(
    dataset: S5Dataset, options: StagingOptions, batch_size: int | None
) -> tuple[StagingOptions, str]:
    """The options with the budget the staging root has room for, and that root.

    The epoch cache (``options.epoch_cache``, capped at the data set's size) counts once for
    the node's ranks in the space check.

    Raises:
        ConfigError: options the data set's units cannot stage (:meth:`ObjectUnits.check`).
        BudgetError: a sample (or shard) larger than the budget, a budget (and epoch cache)
            larger than the free space, ``keep_staged`` with a budget smaller than the data
            set, or a budget smaller than a batch.
    """
    budget = options.budget
    largest = dataset.samples[dataset.samples.largest()]
    units = units_of(dataset)
    units.check(options)
    check_sample_fits(largest, budget)
    total = dataset.total_bytes
    if options.keep_staged and total > budget:
        raise BudgetError(
            f"keep_staged=True needs a budget that holds the whole data set "
            f"({format_size(total)}); the budget is {format_size(budget)}"
        )
    footprint = disk_footprint(dataset.samples.size)
    if options.epoch_cache > total:  # a cache never holds more than the data set
        options = replace(options, epoch_cache=total)
    root, room = choose_root(
        options.staging_dir, min(budget, total), options.shrink_budget, footprint, options.epoch_cache
    )
    if room < min(budget, total):
        if options.keep_staged or largest.size > room:
            raise BudgetError(
                f"only {format_size(room)} fit in {root}, too little for "
                + (
                    "the whole data set with keep_staged"
                    if options.keep_staged
                    else f"sample {largest.key!r}"
                )
            )
        options = replace(options, budget=room)
    if batch_size is not None and units.holds_batches:
        _check_batch_fits(dataset, batch_size, options.budget)
    return options, root


def loader_batch_size(sampler: object, caller: FrameType | None) -> int | None:
    """The batch size of the DataLoader's BatchSampler that asked ``sampler`` for its iterator
    (``caller``: the frame that called ``iter(sampler)``), else ``None``.

    This is the fallback for ``DataLoader(ds, sampler=sampler, batch_size=n)``, the drop-in use
    of a sampler: ``Sampler.__iter__`` takes no argument, and the DataLoader makes its own
    BatchSampler, which calls ``iter(sampler)`` from its ``__iter__`` with itself as ``self``;
    its frame is the only place the sampler can learn that a DataLoader batches it, and by how
    much. Anything else between them (a wrapping sampler or batch sampler, torchdata's
    ``StatefulDataLoader``, whose batch iterator calls ``iter(sampler)``) is not recognised:
    the sampler then yields each index once its sample is staged, and no batch is checked
    against the budget. :meth:`S5Sampler.batches <s5loader.S5Sampler.batches>` gives the batch
    size explicitly.
    """
    owner = caller.f_locals.get("self") if caller is not None else None
    if not (isinstance(owner, BatchSampler) and owner.sampler is sampler):
        return None
    return int(owner.batch_size)


def check_loader_batch(dataset: S5Dataset, budget: int, batch_size: int) -> None:
    """Check that ``budget`` holds one DataLoader batch of ``batch_size`` samples of
    ``dataset`` where its units hold whole batches (raw objects; over tar shards the order's
    own check counts the shards of each batch).

    Raises:
        BudgetError: the budget is smaller than the loader's batch of the largest samples.
    """
    if units_of(dataset).holds_batches:
        _check_batch_fits(dataset, batch_size, budget)


def _check_batch_fits(dataset: S5Dataset, batch_size: int, budget: int) -> None:
    """A DataLoader waits for a whole batch of indices before any sample of it is read, so a
    budget that cannot hold ``batch_size`` samples can stall; fail now with the numbers."""
    n = min(batch_size, len(dataset))
    sizes = dataset.samples.sizes()
    biggest = [int(v) for v in sorted(np.partition(sizes, len(sizes) - n)[len(sizes) - n :], reverse=True)]
    need = sum(biggest)
    if need > budget:
        raise BudgetError(
            f"the budget of {format_size(budget)} does not hold one batch: batch_size={batch_size} of "
            f"the largest samples of {dataset.source or 'the data set'} take {format_size(need)} "
            f"(the largest is {format_size(biggest[0])}); the budget must hold at least one batch: "
            f"raise it to at least {format_size(need)} or lower batch_size"
        )
