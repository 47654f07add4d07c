"""The order over tar shards (``Order.shard_order``): ranks take whole runs of shards, so a shard
is fetched by one rank; with ``shuffle=True`` samples mix across the shards a rank has open
from the first sample on, never more shards open than asked; the same seed gives the same
order; every sample comes once per epoch over the ranks.

Private modules (``s5loader._sampling``) are imported on purpose: their own behaviour is what
these tests check."""

from __future__ import annotations

import pytest

from s5loader._sampling.order import Order, open_shards, shuffle_quality
from s5loader._sampling.resume import Position, check_state, make_state, resume
from s5loader._sampling.units import ObjectUnits, ShardUnits
from s5loader.exceptions import StateError


def shards(counts: list[int]) -> tuple[list[list[int]], list[int]]:
    """Units of consecutive sample indices, ``counts[s]`` in shard ``s``, and each sample's shard."""
    units, unit_of, k = [], [], 0
    for s, c in enumerate(counts):
        units.append(list(range(k, k + c)))
        unit_of += [s] * c
        k += c
    return units, unit_of


def most_open(order: list[int], unit_of: list[int]) -> int:
    """The most shards open at once: a shard is open from its first sample to its last."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for pos, i in enumerate(order):
        first.setdefault(unit_of[i], pos)
        last[unit_of[i]] = pos
    events = sorted([(p, 1) for p in first.values()] + [(p + 0.5, -1) for p in last.values()])
    held = peak = 0
    for _, d in events:
        held += d
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_class_sorted_shards_mix_from_the_first_sample_with_k_open(k: int) -> None:
    units, unit_of = shards([100] * 8)  # one class per shard
    order = Order(True, 7, 1, 0, False).shard_order(800, 0, 0, units, k)
    assert sorted(order) == list(range(800))
    assert most_open(order, unit_of) == k
    assert len({unit_of[i] for i in order[:32]}) == k  # the first batch already draws from k shards
    q = shuffle_quality(order, unit_of, 64)
    assert q.units_per_span >= min(k, 8) - 0.5


def test_without_shuffle_shards_come_in_order_each_whole() -> None:
    units, _ = shards([5, 3, 4])
    assert Order(False, 0, 1, 0, False).shard_order(12, 0, 0, units, 2) == list(range(12))


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_take_disjoint_whole_shards_and_every_sample_once(shuffle: bool, world: int) -> None:
    units, unit_of = shards([50] * 8)
    parts = [Order(shuffle, 3, world, r, False).shard_order(400, 5, 0, units, 2) for r in range(world)]
    assert sorted(i for p in parts for i in p) == list(range(400))
    assert {len(p) for p in parts} == {400 // world}
    owned = [{unit_of[i] for i in p} for p in parts]
    assert sum(map(len, owned)) == 8  # no shard is read by two ranks


@pytest.mark.parametrize("drop_last", [False, True])
def test_uneven_shards_give_equal_parts_and_share_only_the_shards_cut_by_a_part_edge(drop_last: bool) -> None:
    counts = [1, 6, 2, 5, 3, 9, 4]  # 30 samples
    units, unit_of = shards(counts)
    world = 4
    parts = [Order(True, 1, world, r, drop_last).shard_order(30, 2, 0, units, 2) for r in range(world)]
    assert {len(p) for p in parts} == {7 if drop_last else 8}
    seen = [i for p in parts for i in p]
    if drop_last:
        assert len(set(seen)) == 28
    else:
        assert set(seen) == set(range(30)) and len(seen) == 32  # padded by repetition
    owned = [{unit_of[i] for i in p} for p in parts]
    assert (
        sum(map(len, owned)) - len(set().union(*owned)) <= world
    )  # the shards a part edge cuts (and the pad)


def test_the_same_seed_and_epoch_give_the_same_order_and_start_continues_it() -> None:
    units, _ = shards([30] * 6)
    o = Order(True, 11, 2, 1, False)
    a = o.shard_order(180, 4, 0, units, 2)
    assert a == o.shard_order(180, 4, 0, units, 2)
    assert a != o.shard_order(180, 5, 0, units, 2)
    assert o.shard_order(180, 4, 37, units, 2) == a[37:]


def test_workers_take_contiguous_runs_of_the_rank_part_each_mixed() -> None:
    units, unit_of = shards([40] * 8)
    o = Order(True, 2, 1, 0, False)
    runs = [o.shard_order(320, 0, 0, units, 2, run=(w, 4)) for w in range(4)]
    assert sorted(i for r in runs for i in r) == list(range(320))
    owned = [{unit_of[i] for i in r} for r in runs]
    assert sum(map(len, owned)) == 8  # 8 shards over 4 workers: two each, none shared
    assert all(most_open(r, unit_of) <= 2 for r in runs)


@pytest.mark.parametrize("run", [(0, 1), (0, 4), (3, 4)])
def test_a_block_order_reads_its_first_big_shard_from_the_front_in_growing_windows(
    run: tuple[int, int],
) -> None:
    # 100 MB shards (1000 samples) in a worker's (or rank's) part: the first shard is read while
    # it downloads, so its first windows are its first 32, 64, ... samples, each shuffled
    units, unit_of = shards([1000] * 4)
    order, wins = Order("block", 5, 1, 0, False).block_order(
        4000, 0, 0, units, 1754, run=run, front_first=True
    )
    first = units[unit_of[order[0]]]
    assert wins[:6] == [0, 32, 96, 224, 480, 992]
    for a, b in zip(wins[:5], wins[1:6], strict=True):
        assert sorted(order[a:b]) == first[a:b]  # the shard's own order, window by window
    assert order[:32] != first[:32]  # each window shuffled
    assert len(order) == 4000 // run[1] and sorted(order) == sorted(
        i for s in {unit_of[i] for i in order} for i in units[s]
    )
    # raw-object blocks are windows of whole blocks, as before: the first window is the block
    objects, wins = Order("block", 5, 1, 0, False).block_order(4000, 0, 0, units, 1754)
    assert wins[:2] == [0, 1000]


@pytest.mark.parametrize("open_units,run", [(1, (2, 4)), (3, (0, 1))])
def test_a_shard_order_reads_its_first_shard_from_the_front(open_units: int, run: tuple[int, int]) -> None:
    # the shard of the first sample streams: its samples, wherever the draws put them, come in
    # its own order by windows of 32, 64, ... samples, each shuffled; the others at random
    units, unit_of = shards([1000] * 8)
    order = Order(True, 4, 1, 0, False).shard_order(8000, 0, 0, units, open_units, run=run)
    assert sorted(order) == sorted(i for s in {unit_of[i] for i in order} for i in units[s])
    first = units[unit_of[order[0]]]
    mine = [i for i in order if unit_of[i] == unit_of[order[0]]]
    assert sorted(mine[:32]) == first[:32] and sorted(mine[32:96]) == first[32:96] and mine[:32] != first[:32]
    other = [i for i in order if unit_of[i] != unit_of[order[0]]][:32]
    if other:
        assert max(i % 1000 for i in other) > 96  # another shard: samples from all of it


def test_open_shards_follows_the_budget() -> None:
    assert open_shards(budget=10_000, largest=1_000, total=50_000, count=50) == 9  # one more being staged
    assert open_shards(budget=1_500, largest=1_000, total=50_000, count=50) == 1
    assert open_shards(budget=60_000, largest=1_000, total=50_000, count=50) == 50  # all fit


def test_a_shard_order_state_resumes_in_the_rank_part_and_only_with_the_same_ranks() -> None:
    shard_units, object_units = ShardUnits(None), ObjectUnits(None)  # type: ignore[arg-type]
    o = Order(True, 0, 2, 1, False)
    pos = Position(start=0, yielded=13)
    state = make_state(o, 3, 100, pos, 4, shard_units.name)
    assert state["units"] == "tar shard" and state["window"] == 4
    saved = check_state(state, 100, shard_units)
    assert saved.consumed == 13 and saved.units == "tar shard"  # a position in the rank's part, not x ranks
    here = Position()
    resumed, epoch = resume(saved, o, 0, here, 100, shard_units)
    assert (resumed, epoch, here.start) == (o, 3, 13)
    with pytest.raises(StateError, match="same number of ranks"):
        resume(saved, Order(True, 0, 4, 1, False), 0, Position(), 100, shard_units)
    with pytest.raises(StateError, match="staged tar shards; this one stages samples"):
        resume(saved, Order(True, 0, 2, 1, False), 0, Position(), 100, object_units)
    # a state of version 2 said so with "sharded": read the same
    old = {k: v for k, v in state.items() if k != "units"} | {"sharded": True}
    assert check_state(old, 100, shard_units) == saved


def test_the_rest_of_an_epoch_is_cut_among_the_new_ranks_each_sample_once() -> None:
    from collections import Counter

    from s5loader._sampling.elastic import check_chain, rest_of_epoch, split

    parts = {(2, 0): list(range(0, 30)), (2, 1): list(range(30, 60))}

    def part_of(ranks: int, rank: int) -> list[int]:
        return parts[ranks, rank]

    done = list(range(0, 8)) + list(range(30, 38))
    for world in (1, 3, 4):
        rest = [i for r in range(world) for i in rest_of_epoch(part_of, [(2, 8)], world, r, drop_last=False)]
        padded = -(-44 // world) * world
        assert len(rest) == padded and set(done + rest) == set(range(60))
        assert Counter(done + rest) - Counter(range(60)) == Counter(rest[: padded - 44]) - Counter()
    # two resumptions: 2 ranks to 4 (each at 5 of its 11), then to 1
    again = rest_of_epoch(part_of, [(2, 8), (4, 5)], 1, 0, drop_last=False)
    second = [i for r in range(4) for i in rest_of_epoch(part_of, [(2, 8)], 4, r, False)[:5]]
    assert Counter(done + second + again) == Counter(range(60))
    assert split([1, 2, 3], 2, drop_last=True) == [[1], [2]] and split([1, 2, 3], 2, False) == [
        [1, 2],
        [3, 1],
    ]
    with pytest.raises(StateError):
        check_chain([[0, 3]])
    with pytest.raises(StateError):
        rest_of_epoch(part_of, [(2, 31)], 1, 0, False)
