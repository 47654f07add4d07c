"""Setting up an :class:`~s5loader.S5Sampler`: checking its options into an order and one
:class:`~s5loader.config.StagingOptions`, and sizing the budget against the data set and the
disk before anything is staged: the largest sample (or tar shard) must fit, ``keep_staged``
must hold the whole data set, the staging root must have room, and (when the batch size is
known) a batch must fit."""

from __future__ import annotations

import warnings
from dataclasses import replace
from types import FrameType

import numpy as np
from torch.utils.data import BatchSampler

from .._util.dist import rank_info
from .._util.uri import format_size, parse_size
from ..config import StagingOptions
from ..dataset import S5Dataset
from ..engine.budget import check_sample_fits
from ..exceptions import BudgetError, ConfigError
from ..staging.area import choose_root, disk_footprint
from .order import Order, check_seed, check_shuffle
from .units import units_of


def configure(
    dataset: S5Dataset,
    *,
    shuffle: bool | str,
    seed: int,
    samples_per_call: int,
    block_size: int,
    calls_in_flight: int,
    staging_dir: str | None,
    budget: int | str,
    keep_staged: bool,
    shrink_budget: bool,
    stall_timeout: float,
    retries: int,
    on_error: str,
    verify: bool,
    num_replicas: int | None,
    rank: int | None,
    drop_last: bool,
    s5cmd_workers: int,
    batch_size: int | None,
    buffers: int | None,
    numworkers: int | None,
    epoch_cache: int | str = 0,
) -> tuple[Order, int, StagingOptions, str]:
    """Check :class:`S5Sampler`'s options: its order, its ``shuffle="block"`` window (over tar
    shards with ``shuffle`` True or False: the shards open at once), the staging options with
    the budget the staging root has room for, and that root."""
    shuffle = check_shuffle(shuffle)
    check_seed(seed)
    calls_in_flight = renamed("buffers", buffers, "calls_in_flight", calls_in_flight, 2)
    s5cmd_workers = renamed("numworkers", numworkers, "s5cmd_workers", s5cmd_workers, 256)
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
        raise ConfigError(f"batch_size must be a positive int or None, got {batch_size!r}")
    r, world = rank_info(num_replicas, rank)
    units = units_of(dataset)
    order = Order(shuffle, seed, world, r, bool(drop_last), units.sharded)
    budget_bytes = parse_size(budget, "budget")
    # From the options, not the space found: every rank must cut the same windows.
    window = units.window(budget_bytes, calls_in_flight, shuffle)
    if shuffle == "block" and isinstance(samples_per_call, int) and not isinstance(samples_per_call, bool) \
            and samples_per_call > 0:  # an invalid value still fails in StagingOptions
        samples_per_call = max(samples_per_call, window)
    options = StagingOptions(
        budget=budget_bytes,
        samples_per_call=samples_per_call,
        calls_in_flight=calls_in_flight,
        s5cmd_workers=s5cmd_workers,
        block_size=block_size,
        stall_timeout=stall_timeout,
        retries=retries,
        on_error=on_error,
        verify=verify,
        keep_staged=bool(keep_staged),
        shrink_budget=bool(shrink_budget),
        staging_dir=staging_dir,
        epoch_cache=parse_size(epoch_cache, "epoch_cache") if epoch_cache else 0,
    )
    options, root = fit_budget(dataset, options, batch_size)
    return order, window, options, root


def renamed(old: str, old_value: int | None, new: str, new_value: int, default: int) -> int:
    """The value of a renamed keyword: the old name still works for one release, with a
    DeprecationWarning; both at once is a ConfigError."""
    if old_value is None:
        return new_value
    if new_value != default:
        raise ConfigError(f"{old}= is the former name of {new}=; give only {new}={new_value!r}")
    warnings.warn(f"S5Sampler({old}=...) is deprecated; use {new}=", DeprecationWarning, stacklevel=4)
    return old_value


def fit_budget(
    dataset: S5Dataset, options: StagingOptions, batch_size: int | None
) -> tuple[StagingOptions, str]:
    """The options with the budget the staging root has room for, and that root.

    The epoch cache (``options.epoch_cache``, capped at the data set's size) counts once for
    the node's ranks in the space check.

    Raises:
        ConfigError: options the data set's units cannot stage (:meth:`ObjectUnits.check`).
        BudgetError: a sample (or shard) larger than the budget, a budget (and epoch cache)
            larger than the free space, ``keep_staged`` with a budget smaller than the data set, or a budget smaller
            than a batch.
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
                + ("the whole data set with keep_staged" if options.keep_staged else f"sample {largest.key!r}")
            )
        options = replace(options, budget=room)
    if batch_size is not None and units.holds_batches:
        _check_batch_fits(dataset, batch_size, options.budget)
    return options, root


def check_loader_batch(sampler: object, dataset: S5Dataset, budget: int, caller: FrameType | None) -> bool:
    """When a DataLoader's BatchSampler iterates ``sampler`` (``caller`` is the frame that
    asked for the iterator), check that ``budget`` holds one of its batches of ``dataset``.

    Returns:
        whether a DataLoader's BatchSampler iterates it.

    Raises:
        BudgetError: the budget is smaller than the loader's batch of the largest samples.
    """
    owner = caller.f_locals.get("self") if caller is not None else None
    if not (isinstance(owner, BatchSampler) and owner.sampler is sampler):
        return False
    if units_of(dataset).holds_batches:
        _check_batch_fits(dataset, int(owner.batch_size), budget)
    return True


def _check_batch_fits(dataset: S5Dataset, batch_size: int, budget: int) -> None:
    """A DataLoader waits for a whole batch of indices before any sample of it is read, so a
    budget that cannot hold ``batch_size`` samples can stall; fail now with the numbers."""
    n = min(batch_size, len(dataset))
    sizes = dataset.samples.sizes()
    biggest = [int(v) for v in sorted(np.partition(sizes, len(sizes) - n)[len(sizes) - n:], reverse=True)]
    need = sum(biggest)
    if need > budget:
        raise BudgetError(
            f"the budget of {format_size(budget)} does not hold one batch: batch_size={batch_size} of "
            f"the largest samples of {dataset.source or 'the data set'} take {format_size(need)} "
            f"(the largest is {format_size(biggest[0])}); the budget must hold at least one batch: "
            f"raise it to at least {format_size(need)} or lower batch_size"
        )
