"""The checks of :class:`~s5loader.S5IterableDataset`'s options, made in the process that makes
it (before any DataLoader worker starts) where it can: the options themselves, the split of the
budget between the DataLoader's workers, and a shuffle buffer over tar shards against each
worker's share (:func:`check_workers_buffer`)."""

from __future__ import annotations

from typing import Any

from .._util.dist import rank_info
from .._util.uri import format_size, parse_size
from ..config import StagingOptions
from ..dataset import S5Dataset
from ..exceptions import BudgetError, ConfigError
from ..staging.epochcache import EpochCache
from .cacherun import open_iterable_cache
from .order import Order, check_seed, check_shuffle
from .setup import fit_budget
from .units import units_of
from .workerorder import check_buffer, worker_frees


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
    num_workers: int | None = None,
) -> tuple[int, str, EpochCache | None, int | None]:
    """Check :class:`~s5loader.S5IterableDataset`'s options in the process that makes it;
    return the budget (less where the staging root has less room), the staging root, with
    ``epoch_cache`` the epoch cache's folder, opened (see :func:`open_iterable_cache`), and
    ``num_workers``. Given ``num_workers``, the budget's split between them and the first
    epoch's shuffle buffer over tar shards are checked too (:func:`check_workers_buffer`).

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
    try:
        if check_workers(dataset, options.budget, num_workers) is not None:
            r, world = rank_info(num_replicas, rank)
            order = Order(shuffle, seed, world, r, drop_last, units_of(dataset).worker_runs)
            check_workers_buffer(dataset, order, shuffle_buffer, 0, options.budget, num_workers or 0,
                                 options.calls_in_flight, cache is not None, root)
    except BaseException:
        if cache is not None:  # nothing these checks opened outlives their error
            cache.close()
        raise
    return options.budget, root, cache, num_workers


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


def check_workers_buffer(
    dataset: S5Dataset, order: Order, shuffle_buffer: int, epoch: int, budget: int, num_workers: int,
    calls_in_flight: int, cached: bool, root: str,
) -> None:
    """:func:`check_buffer` for each of ``num_workers`` DataLoader workers (0: one, this process),
    each staging its part of ``epoch`` within ``budget // num_workers`` below ``root``
    (``cached``: with an epoch cache), from the process that makes the dataset.

    Raises:
        BudgetError: as :func:`check_buffer`.
    """
    nw = max(1, num_workers)
    frees = worker_frees(dataset, order.shuffle, cached, root)
    check_buffer(dataset, order, shuffle_buffer, epoch, budget // nw, nw, range(nw), calls_in_flight, frees)
