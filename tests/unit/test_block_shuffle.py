"""shuffle="block" without a server: windows of whole blocks sized by the budget, their
determinism, completeness and resume, and the quality figure.

Private modules (``s5loader._sampling``) are imported on purpose: their own behaviour is what
these tests check."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s5loader._sampling.order import FIRST_WINDOW, Order, shuffle_quality
from s5loader.sampler import WINDOW_CAP, block_window


def blocks_of(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def windows_of(order: list[int], starts: list[int]) -> list[list[int]]:
    return [order[a:b] for a, b in zip(starts, [*starts[1:], len(order)], strict=True)]


def test_same_seed_same_order_and_epochs_differ() -> None:
    units = blocks_of(500, 8)
    a = Order("block", 7, 1, 0, False).block_order(500, 3, 0, units, 64)
    assert a == Order("block", 7, 1, 0, False).block_order(500, 3, 0, units, 64)
    assert a[0] != Order("block", 7, 1, 0, False).block_order(500, 4, 0, units, 64)[0]
    assert a[0] != Order("block", 8, 1, 0, False).block_order(500, 3, 0, units, 64)[0]


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 300),
    world=st.integers(1, 8),
    drop_last=st.booleans(),
    epoch=st.integers(0, 3),
    block=st.integers(1, 20),
    window=st.integers(1, 120),
    seed=st.integers(0, 2**31),
)
def test_every_sample_once_per_epoch_in_windows_of_whole_blocks(
    n: int, world: int, drop_last: bool, epoch: int, block: int, window: int, seed: int
) -> None:
    units = blocks_of(n, block)
    parts = [
        Order("block", seed, world, r, drop_last).block_order(n, epoch, 0, units, window)
        for r in range(world)
    ]
    assert len({len(order) for order, _ in parts}) == 1  # equal counts on every rank
    flat = [i for order, _ in parts for i in order]
    if drop_last:
        assert len(flat) == len(set(flat)) == (n // world) * world
    else:
        assert set(flat) == set(range(n)) and len(flat) == -(-n // world) * world
    # the global order (one rank) is windows of whole blocks, none larger than the window
    # unless it is a single block
    order, starts = Order("block", seed, 1, 0, drop_last).block_order(n, epoch, 0, units, window)
    assert starts[0] == 0 and starts == sorted(set(starts))
    unit_of = {i: k for k, u in enumerate(units) for i in u}
    for win in windows_of(order, starts):
        members = {unit_of[i] for i in win}
        assert sorted(win) == sorted(i for k in members for i in units[k])
        assert len(win) <= window or len(members) == 1


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 200),
    world=st.integers(1, 8),
    drop_last=st.booleans(),
    block=st.integers(1, 12),
    window=st.integers(1, 80),
    data=st.data(),
)
def test_resume_at_any_position_is_the_uninterrupted_tail(
    n: int, world: int, drop_last: bool, block: int, window: int, data: st.DataObject
) -> None:
    units = blocks_of(n, block)
    rank = data.draw(st.integers(0, world - 1))
    o = Order("block", 5, world, rank, drop_last)
    full, starts = o.block_order(n, 2, 0, units, window)
    start = data.draw(st.integers(0, len(full)))
    rest, rest_starts = o.block_order(n, 2, start, units, window)
    assert rest == full[start:]
    # the same window starts, seen from the resumed position
    assert rest_starts == ([0] if rest else []) + [s - start for s in starts if s > start]
    assert o.indices(n, 2, start, units=units, window=window) == rest


def test_first_windows_grow_from_a_small_one() -> None:
    units = blocks_of(3000, 4)
    for rank in range(3):
        order, starts = Order("block", 2, 3, rank, False).block_order(3000, 0, 0, units, 500)
        sizes = [b - a for a, b in zip(starts, [*starts[1:], len(order)], strict=True)]
        limits = [min(FIRST_WINDOW << k, 500) for k in range(len(sizes))]
        assert all(size <= limit for size, limit in zip(sizes[:-1], limits, strict=False))
        assert sizes[0] <= FIRST_WINDOW and max(sizes) > 400


def test_window_is_what_the_budget_holds_up_to_the_cap() -> None:
    # 100 kB samples, 2 GiB: thousands of samples per window
    w = block_window(2 << 30, 100_000)
    assert 4000 < w <= WINDOW_CAP and 3 * w * 100_000 <= 2 << 30
    assert block_window(1 << 40, 1000) == WINDOW_CAP
    # a small budget shrinks the window so that three windows still fit
    assert block_window(30_000, 1000) == 10
    assert block_window(10, 1000) == 1


def test_a_window_spans_many_blocks_when_the_budget_allows() -> None:
    n, size = 100_000, 64
    units = blocks_of(n, size)
    w = block_window(2 << 30, 100_000)
    order, starts = Order("block", 0, 1, 0, False).block_order(n, 0, 0, units, w)
    # past the first windows, which grow from FIRST_WINDOW samples (they sum to less than 2w)
    full_windows = [win for a, win in zip(starts, windows_of(order, starts), strict=True) if a >= 2 * w][:-1]
    assert len(full_windows) >= 10
    assert all(len({i // size for i in win}) >= w // size - 1 for win in full_windows)
    assert min(len({i // size for i in win}) for win in full_windows) >= 100
    # a batch of 256 draws from ~100 blocks, against 4 in key order and ~240 in a full shuffle
    unit_of = [i // size for i in range(n)]
    block = shuffle_quality(order, unit_of).units_per_span
    full = shuffle_quality(Order(True, 0, 1, 0, False).indices(n, 0), unit_of).units_per_span
    none = shuffle_quality(list(range(n)), unit_of).units_per_span
    assert none == 4 and 90 < block < full and full > 230


def test_shuffle_quality_figures() -> None:
    unit_of = [i // 4 for i in range(16)]
    q = shuffle_quality(list(range(16)), unit_of, span=8)
    assert (q.span, q.units_per_span, q.displacement) == (8, 2.0, 0.0)
    rev = shuffle_quality(list(range(15, -1, -1)), unit_of, span=8)
    assert rev.units_per_span == 2.0 and rev.displacement == pytest.approx(
        sum(abs(15 - 2 * p) for p in range(16)) / 256
    )
    assert shuffle_quality([0, 4, 8, 12, 1, 5, 9, 13], unit_of, span=4).units_per_span == 4.0
    assert shuffle_quality([], unit_of).units_per_span == 0.0
    with pytest.raises(ValueError):
        shuffle_quality([0], unit_of, span=0)
