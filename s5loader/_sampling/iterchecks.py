"""The checks of :class:`~s5loader.S5IterableDataset`'s options, made in the process that makes it
(before any DataLoader worker starts): the options themselves, the staging options against the
data set and the disk, and a shuffle buffer over tar shards against the rank's budget
(:func:`check_buffer`), here and at each ``set_epoch``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._index.blocks import block_count
from .._staging.epochcache import EpochCache
from .._util.dist import rank_info
from .._util.uri import format_size
from ..config import StagingOptions
from ..dataset import S5Dataset
from ..exceptions import BudgetError, ConfigError
from .cacherun import open_iterable_cache
from .iterparts import rank_order
from .order import Order, check_seed, check_shuffle
from .resume import block_stamp, check_blocks
from .setup import fit_budget
from .staging import layout
from .units import units_of

SUGGEST_EPOCHS = 8  # epochs whose orders a suggested shuffle_buffer or budget is checked against


def check_options(
    dataset: S5Dataset,
    options: StagingOptions,
    shuffle: bool | str,
    seed: int,
    shuffle_buffer: int,
    drop_last: bool,
    num_replicas: int | None,
    rank: int | None,
) -> tuple[StagingOptions, str, EpochCache | None]:
    """Check :class:`~s5loader.S5IterableDataset`'s options in the process that makes it;
    return the staging options (the budget less where the staging root has less room), the
    staging root and, with ``epoch_cache``, the epoch cache's folder, opened (see
    :func:`open_iterable_cache`). A shuffle buffer over tar shards is checked against the budget
    for the first epoch (:func:`check_buffer`).

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
    if options.keep_staged:
        raise ConfigError(
            "keep_staged is S5Sampler's alone; S5IterableDataset has epoch_cache for later epochs"
        )
    r, world = rank_info(num_replicas, rank)  # a bad explicit split fails here, not in a worker
    # The budget is checked now, in the main process, as the sampler's is (the same checks, the
    # same messages).
    options, root = fit_budget(dataset, options, None)
    cache = open_iterable_cache(
        dataset,
        options.epoch_cache,
        (shuffle, seed, shuffle_buffer, drop_last),
        num_replicas,
        rank,
        root,
        options.keep_epoch_cache,
    )
    try:
        order = Order("block" if shuffle == "block" else bool(shuffle), seed, world, r, drop_last)
        check_buffer(dataset, order, shuffle_buffer, 0, options, root)
    except BaseException:
        if cache is not None:  # nothing these checks opened outlives their error
            cache.close()
        raise
    return options, root, cache


def check_count(name: str, value: int | None, least: int) -> int | None:
    """``None`` or an int of at least ``least``, named ``name`` in the error.

    Raises:
        ConfigError: anything else.
    """
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
        raise ConfigError(f"{name} must be None or an int >= {least}, got {value!r}")
    return value


def check_worker_count(told: int | None, running: int, source: str) -> None:
    """The ``num_workers`` an :class:`~s5loader.S5IterableDataset` was made with (``None``:
    any) against the workers its DataLoader ``running`` runs (1 without workers).

    Raises:
        ConfigError: the counts differ.
    """
    if told is not None and max(1, told) != running:
        raise ConfigError(
            f"S5IterableDataset over {source or 'the data set'} was made with "
            f"num_workers={told}, but its DataLoader runs {running} worker(s) (num_workers=0 "
            "runs one, in the main process): give both the same count"
        )


def check_buffer(
    dataset: S5Dataset,
    order: Order,
    shuffle_buffer: int,
    epoch: int,
    options: StagingOptions,
    root: str,
    start: int = 0,
) -> None:
    """Check that a shuffle buffer over tar shards leaves the shards the rank's order needs at
    once within the budget.

    A shard stays staged from its first sample to its last; a sample the buffer holds back
    keeps its shard staged after the order has moved on to other shards, so the buffer costs
    staging space over tar shards (over raw objects it costs none: nothing is checked). The
    rank's order of ``epoch`` is laid out as its run will stage it (staged below ``root``),
    from position ``start``, and the bytes it needs at once
    are counted as its pass counts them.

    Raises:
        BudgetError: the order needs more than the budget at once; the message names
            ``shuffle_buffer``, the budget, the largest buffer that fits it and the budget that
            holds this buffer.
    """
    units = units_of(dataset)
    if shuffle_buffer <= 1 or units.peak_bytes([], False) is None:
        return
    peaks: dict[tuple[int, int | None, int, int], int] = {}

    def peak(budget: int, k: int, e: int = epoch) -> int:
        """The most bytes the rank's order of epoch ``e`` needs at once with ``budget`` and a
        buffer of ``k``."""
        window, cost = layout(dataset, budget, order.shuffle, root)
        key = (window, cost.room if cost is not None else None, k, e)  # what the order depends on
        if key not in peaks:
            mine = rank_order(units, order, e, k, None, window, cost)[0]
            peaks[key] = units.peak_bytes(mine[start:], cost is not None) or 0
        return peaks[key]

    budget = options.budget
    need = peak(budget, shuffle_buffer)
    if need <= budget or peak(budget, 0) > budget:
        return  # it fits, or not even without a buffer: the pass's own check says why
    window = layout(dataset, budget, order.shuffle, root)[0]
    raise _too_big(dataset, order, shuffle_buffer, epoch, budget, need, window, peak)


def _too_big(
    dataset: S5Dataset,
    order: Order,
    shuffle_buffer: int,
    epoch: int,
    budget: int,
    need: int,
    window: int,
    peak: Callable[[int, int, int], int],
) -> BudgetError:
    """:func:`check_buffer`'s error: the bytes the order ``need``s at once against the budget,
    and what would fit (``peak(budget, buffer, epoch)``: the bytes an order needs at once)."""
    n = len(dataset)
    # What is suggested must also fit the next epochs' draws (each draws anew): as many as
    # about a million samples' worth of orders, at most SUGGEST_EPOCHS.
    epochs = range(epoch, epoch + max(1, min(SUGGEST_EPOCHS, 1_000_000 // max(1, n // order.num_replicas))))
    fits = _largest_buffer(lambda k: all(peak(budget, k, e) <= budget for e in epochs), shuffle_buffer)
    holds = _budget_for(
        lambda b: all(peak(b, shuffle_buffer, e) <= b for e in epochs), need, dataset.total_bytes
    )
    mixes = (
        f"; shuffle=True already mixes samples across the shards the budget holds open ({window} here)"
        if order.shuffle is True
        else ""
    )
    smaller = f"shuffle_buffer={fits} or less" if fits > 1 else "shuffle_buffer=0 (no buffer)"
    raise_to = f", or raise the budget to at least {format_size(_at_least(holds))}" if holds else ""
    return BudgetError(
        f"shuffle_buffer={shuffle_buffer} over the tar shards of {dataset.source or 'the data set'} "
        "needs more staged than the budget holds: a sample the buffer holds back keeps its shard staged "
        f"after the order has moved on, so rank {order.rank}'s order of epoch {epoch} needs "
        f"{format_size(need)} of shards staged at once, more than the budget of {format_size(budget)}"
        f"{mixes}. Give {smaller}{raise_to}"
    )


def _largest_buffer(fits: Callable[[int], bool], most: int) -> int:
    """The largest buffer below ``most`` that ``fits`` (1 fits: no buffer), by bisection."""
    lo, hi = 1, most - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _budget_for(fits: Callable[[int], bool], need: int, total: int) -> int | None:
    """The smallest budget found that ``fits``: doubling from ``need`` (a larger budget keeps
    more shards open, which the buffer's samples then keep longer) up to the data set's
    ``total``, at which a shard order keeps every shard open, then halving the step back
    down to a thirty-second of it. None where none fits."""
    low, budget = need, need
    while not fits(budget):
        if budget >= total:
            return None
        low, budget = budget, min(2 * budget, total)
    while budget - low > budget // 32:
        mid = (low + budget) // 2
        low, budget = (low, mid) if fits(mid) else (mid, budget)
    return budget


def _at_least(n: int) -> int:
    """``n`` rounded up to a tenth of the unit :func:`format_size` writes it in, so that the
    figure a message prints is not below it."""
    unit = 1
    while n >= unit * 1024 and unit < 1024**4:
        unit *= 1024
    step = max(1, unit // 10)
    return -(-n // step) * step


class BlockStamp:
    """How an iterable's state of a ``shuffle="block"`` order says its blocks were cut, and the
    check of a state loaded (see :func:`~s5loader._sampling.resume.check_blocks`): the data
    set's blocks are planned only for a state from before states said so."""

    def __init__(self, dataset: S5Dataset, options: StagingOptions) -> None:
        self.dataset = dataset
        self.size = units_of(dataset).block_size(options)

    def stamp(self, state: dict[str, Any], shuffle: bool | str) -> dict[str, Any]:
        """``state``, with how its blocks were cut where its order is a block order."""
        if shuffle == "block":
            state.update(block_stamp(self.size))
        return state

    def check(self, raw: dict[str, Any], checked: dict[str, Any]) -> dict[str, Any]:
        """``checked`` (``raw`` read back), once a block epoch saved mid-way fits these blocks.

        Raises:
            StateError: its blocks were cut otherwise.
        """
        grown = lambda: block_count(self.dataset.samples, self.size, self.dataset._listing)[1]  # noqa: E731
        check_blocks(raw, checked["shuffle"], checked["complete"], self.size, grown)
        return checked
