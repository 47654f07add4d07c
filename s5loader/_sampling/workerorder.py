"""One DataLoader worker's part of an :class:`~s5loader.S5IterableDataset`'s epoch, in the order it
stages and yields it (:func:`worker_order`: a contiguous run over tar shards mixed across the
shards its budget holds open, the shuffle buffer), and the check that a shuffle buffer over tar
shards leaves what that order needs staged at once within the budget of the run that stages it
(:func:`check_buffer`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from .._shards.passes import ShardPass
from .._util.platform import HOLE_BLOCK, punches_holes
from .._util.uri import format_size
from ..dataset import S5Dataset
from ..exceptions import BudgetError
from .order import Order
from .units import ShardUnits, units_of

SUGGEST_EPOCHS = 8  # epochs whose orders a suggested shuffle_buffer or budget is checked against


def worker_frees(dataset: S5Dataset, shuffle: bool | str, cached: bool, root: str) -> bool:
    """Whether a worker's shard order counts the bytes its samples free as they are read:
    over tar shards with ``shuffle=True`` and no epoch cache (``cached``), a worker reads
    what it stages, so each sample read is punched out at once where the file system below
    ``root`` can, and a next shard opens as soon as there is room (see
    :meth:`Order.shard_order <s5loader._sampling.order.Order.shard_order>`)."""
    return dataset.shards is not None and shuffle is True and not cached and punches_holes(root, HOLE_BLOCK)


def worker_window(
    dataset: S5Dataset, budget: int, calls_in_flight: int, shuffle: bool | str, frees: bool
) -> tuple[int, Callable[[int], tuple[float, float]] | None]:
    """The window of a worker's order within ``budget`` (a block order's samples; over tar
    shards, the shards a shard order keeps open) and, with ``frees``, the shard costs its order
    counts (see :meth:`ShardUnits.order_cost <s5loader._sampling.units.ShardUnits.order_cost>`)."""
    units = units_of(dataset)
    window = units.window(budget, calls_in_flight, "block" if shuffle == "block" else True)
    cost = units.order_cost() if frees and isinstance(units, ShardUnits) else None
    return window, cost


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
    cost: Callable[[int], tuple[float, float]] | None = None,
) -> list[int]:
    """One DataLoader worker's part of a rank's epoch, in the order it yields it.

    The rank's part is :meth:`Order.indices` (every rank the same count). Worker ``w`` of
    ``num_workers`` takes every ``num_workers``-th sample from the ``w``-th on, or, with
    ``shuffle="block"`` or ``runs`` (tar shards), the ``w``-th of ``num_workers`` contiguous
    runs (blocks and shards stay with one worker, which stages them alone). With
    ``shuffle="block"`` the run is cut from the rank's units before the windows, and windowed
    on its own (:meth:`Order.block_order`), so no window straddles two workers; over tar shards
    with ``shuffle`` True or False it is cut from :meth:`Order.shard_order`'s rank part
    and mixed across ``window`` open shards (more, as samples read free room, with ``cost``:
    see :meth:`Order.shard_order`). Then the shuffle buffer (see
    :class:`S5IterableDataset`) reorders it.
    """
    if order.shuffle == "block":
        # a contiguous run of the rank's blocks (shards), in windows of the worker's own
        mine = order.block_order(n, epoch, 0, units or [[i] for i in range(n)], window, run=(worker, num_workers))[0]
    elif order.sharded:
        # a contiguous run of the rank's shards, mixed across the shards the worker has open
        mine = order.shard_order(n, epoch, 0, units or [], window, run=(worker, num_workers), cost=cost)
    else:
        part = order.indices(n, epoch, 0)
        mine = part[len(part) * worker // num_workers : len(part) * (worker + 1) // num_workers] if runs else part[worker::num_workers]
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


def check_buffer(
    dataset: S5Dataset,
    order: Order,
    shuffle_buffer: int,
    epoch: int,
    budget: int,
    num_workers: int,
    workers: Sequence[int],
    calls_in_flight: int,
    frees: bool,
    start: int = 0,
) -> None:
    """Check that a shuffle buffer over tar shards leaves the shards each staging run needs at
    once within the budget of that run.

    A shard stays staged from its first sample to its last; a sample the buffer holds back
    keeps its shard staged after the order has moved on to other shards, so the buffer costs
    staging space over tar shards (over raw objects it costs none: nothing is checked). Each of
    ``workers`` (of ``num_workers`` that split the rank's part, each staging its own run within
    ``budget``) has its part of ``epoch`` laid out as it will stage it, from position ``start``,
    and the shards it needs at once are counted as its pass counts them.

    Args:
        budget: the bytes one staging run holds (a worker's share of the dataset's budget).
        frees: the order counts the bytes read samples free (see ``worker_frees``).

    Raises:
        BudgetError: a worker's order needs more than ``budget`` at once; the message names
            ``shuffle_buffer``, the budget, the largest buffer that fits it and the budget that
            holds this buffer.
    """
    if dataset.shards is None or shuffle_buffer <= 1:
        return
    n, units = len(dataset), dataset.shards.shard_units
    peaks: dict[tuple[int, int, int], tuple[int, int]] = {}

    def peak(share: int, k: int, e: int = epoch) -> tuple[int, int]:
        """The most bytes any of ``workers`` needs at once in epoch ``e`` with ``share`` and a
        buffer of ``k``, and that worker."""
        window, cost = worker_window(dataset, share, calls_in_flight, order.shuffle, frees)
        if (window, k, e) not in peaks:
            most = (-1, 0)
            for w in workers:
                mine = worker_order(order, n, e, w, num_workers, k, units=units, window=window, runs=True, cost=cost)
                most = max(most, (ShardPass(dataset, mine[start:], "", False, "raise", frees).peak_bytes()[0], w))
            peaks[window, k, e] = most
        return peaks[window, k, e]

    need, worker = peak(budget, shuffle_buffer)
    if need <= budget or peak(budget, 0)[0] > budget:
        return  # it fits, or not even without a buffer: the pass's own check says why
    # What is suggested must also fit the next epochs' draws (each draws anew): as many as
    # about a million samples' worth of orders, at most SUGGEST_EPOCHS.
    epochs = range(epoch, epoch + max(1, min(SUGGEST_EPOCHS, 1_000_000 // max(1, n // order.num_replicas))))
    fits = _largest_buffer(lambda k: all(peak(budget, k, e)[0] <= budget for e in epochs), shuffle_buffer)
    holds = _budget_for(
        lambda share: all(peak(share, shuffle_buffer, e)[0] <= share for e in epochs), need, dataset.total_bytes
    )
    split = (
        f"the {format_size(budget)} each of {num_workers} DataLoader workers has of the budget of "
        f"{format_size(budget * num_workers)}"
        if num_workers > 1 else f"the budget of {format_size(budget)}"
    )
    window = worker_window(dataset, budget, calls_in_flight, order.shuffle, frees)[0]
    mixes = (
        f"; shuffle=True already mixes samples across the shards the budget holds open ({window} here)"
        if order.shuffle is True else ""
    )
    smaller = f"shuffle_buffer={fits} or less" if fits > 1 else "shuffle_buffer=0 (no buffer)"
    raise_to = f", or raise the budget to at least {format_size(_at_least(holds * num_workers))}" if holds else ""
    raise BudgetError(
        f"shuffle_buffer={shuffle_buffer} over the tar shards of {dataset.source or 'the data set'} needs more "
        f"staged than the budget holds: a sample the buffer holds back keeps its shard staged after the "
        f"order has moved on, so worker {worker}'s part of epoch {epoch} needs {format_size(need)} of "
        f"shards staged at once, more than {split}{mixes}. Give {smaller}{raise_to}"
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
    low, share = need, need
    while not fits(share):
        if share >= total:
            return None
        low, share = share, min(2 * share, total)
    while share - low > share // 32:
        mid = (low + share) // 2
        low, share = (low, mid) if fits(mid) else (mid, share)
    return share


def _at_least(n: int) -> int:
    """``n`` rounded up to a tenth of the unit :func:`format_size` writes it in, so that the
    figure a message prints is not below it."""
    unit = 1
    while n >= unit * 1024 and unit < 1024**4:
        unit *= 1024
    step = max(1, unit // 10)
    return -(-n // step) * step
