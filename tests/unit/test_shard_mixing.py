"""A shard order that uses the budget as a shuffle buffer (``Order.shard_order`` with a cost): shards
open as soon as what the open ones hold leaves room, counted as the readers give bytes back; every
sample comes once, the same seed gives the same order, no stretch of it (nor a pass resumed from
any position) needs more than the budget, and it mixes class-sorted shards at least as a shuffle
buffer of the same bytes. No server: the shards are described, never fetched.

Private modules (``s5loader._sampling``, ``s5loader._shards``) are imported on purpose: their
own behaviour is what these tests check."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest

from s5loader._sampling.iterparts import buffer_shuffle
from s5loader._sampling.mixing import REFERENCE_BUFFER, buffer_units, mixing_budget, whole_units
from s5loader._sampling.order import Order, shuffle_quality
from s5loader._shards.holding import Freeing, Holding
from s5loader._shards.index import Shard
from s5loader._shards.shardpass import ShardPass
from s5loader._shards.shardset import ShardSet
from s5loader.config import Access

SAMPLE = 4608  # a sample of ~3 kB in a tar: two members, their headers and padding


def shard_set(counts: list[int], sample: int = SAMPLE, jitter: int = 0, seed: int = 0) -> ShardSet:
    rng = random.Random(seed)
    return ShardSet(
        [
            Shard(f"s3://b/{s:04d}.tar", c * sample + 10240 + (rng.randrange(jitter) if jitter else 0), "", c)
            for s, c in enumerate(counts)
        ],
        Access(),
    )


def unit_of(shards: ShardSet) -> list[int]:
    return [s for s in range(len(shards)) for _ in shards.shard_samples(s)]


def peak(shards: ShardSet, order: list[int]) -> int:
    """The most the pass of ``order`` holds at once, counted as the pass checks it."""
    return ShardPass(types.SimpleNamespace(shards=shards), order, "", False, "raise", True).peak_bytes()[0]


def test_every_sample_once_over_ranks_and_the_same_seed_gives_the_same_order() -> None:
    shards = shard_set([37, 250, 3, 120, 250, 250, 9, 250] * 3)
    n = shards.samples
    cost = Freeing(shards, room=4 * max(sh.disk for sh in shards))
    for world in (1, 3):
        for drop_last in (False, True):
            parts = [
                Order(True, 5, world, r, drop_last).shard_order(n, 2, 0, shards.shard_units, 1, cost=cost)
                for r in range(world)
            ]
            seen = [i for p in parts for i in p]
            assert len({len(p) for p in parts}) == 1
            if drop_last:
                assert len(set(seen)) == len(seen) == n - n % world
            else:
                assert (
                    set(seen) == set(range(n)) and len(seen) == -(-n // world) * world
                )  # padded by repetition
    o = Order(True, 5, 1, 0, False)
    a = o.shard_order(n, 2, 0, shards.shard_units, 1, cost=cost)
    assert a == o.shard_order(n, 2, 0, shards.shard_units, 1, cost=cost)
    assert a != o.shard_order(n, 3, 0, shards.shard_units, 1, cost=cost)
    assert o.shard_order(n, 2, 777, shards.shard_units, 1, cost=cost) == a[777:]


@pytest.mark.parametrize("jitter", [0, SAMPLE * 40])
def test_no_stretch_of_the_order_nor_a_pass_resumed_anywhere_needs_more_than_the_budget(jitter: int) -> None:
    shards = shard_set([250] * 40, jitter=jitter)
    largest = max(sh.disk for sh in shards)
    budget = 2000 * SAMPLE
    cost = Freeing(shards, room=budget - largest)  # as ShardUnits.order_cost(budget) gives
    order = Order(True, 1, 1, 0, False).shard_order(shards.samples, 0, 0, shards.shard_units, 1, cost=cost)
    assert peak(shards, order) <= budget - largest + 1  # the room, counted as the pass counts it
    # a resumed pass stages the shards open at that position whole, then gives back what was read
    for start in range(0, len(order), 97):
        assert peak(shards, order[start:]) <= budget, start


def test_what_an_order_holds_is_what_the_readers_give_back_at_least() -> None:
    # a visit's samples done form runs: the model gives each its samples' bytes, less a block at
    # each end inside the shard, and the tar's end with the run that reaches it
    shards = shard_set([100])
    held = Holding(shards)
    disk = shards[0].disk
    held.open(0, 0, range(10, 100))  # samples 0..9 are not needed: given back at once
    assert held.held == pytest.approx(disk - (10 * (disk - 10240) / 100 - 4096))
    for j in range(10, 100):
        held.done(0, j)
    assert held.held == pytest.approx(0)  # the whole tar back once every sample is done
    held.close(0)
    assert held.held == pytest.approx(0)


def test_each_shard_is_read_from_both_ends_and_the_first_from_its_front() -> None:
    shards = shard_set([250] * 12)
    cost = Freeing(shards, room=6 * shards[0].disk)
    order = Order(True, 3, 1, 0, False).shard_order(shards.samples, 0, 0, shards.shard_units, 1, cost=cost)
    owner = unit_of(shards)
    done: dict[int, list[int]] = {}
    for i in order:
        s, j = shards.locate(i)
        done.setdefault(s, []).append(j)
        got = sorted(done[s])
        k = next((x for x, y in enumerate(got) if x != y), len(got))  # a prefix ...
        assert got[k:] == list(range(250 - (len(got) - k), 250)), (s, got)  # ... and a suffix
    first = done[owner[order[0]]]
    assert first == list(range(250))  # the streamed shard: from its front


def webdataset_shuffle(
    stream: list[int], bufsize: int, rng: np.random.Generator, initial: int = 100
) -> list[int]:
    """WebDataset's ``shuffle(bufsize)`` (``webdataset.filters._shuffle``): the buffer takes two
    samples in for each one out until it is full, and gives samples out once it holds ``initial``."""
    buf: list[int] = []
    out: list[int] = []
    source = iter(stream)
    for x in source:
        buf.append(x)
        if len(buf) < bufsize:
            more = next(source, None)
            if more is not None:
                buf.append(more)
        if len(buf) >= initial:
            k = int(rng.integers(len(buf)))
            buf[k], buf[-1] = buf[-1], buf[k]
            out.append(buf.pop())
    while buf:
        k = int(rng.integers(len(buf)))
        buf[k], buf[-1] = buf[-1], buf[k]
        out.append(buf.pop())
    return out


def webdataset_like(shards: ShardSet, workers: int, buffer: int, batch: int, seed: int) -> list[int]:
    """What a DataLoader yields from WebDataset's ``shardshuffle`` + ``shuffle(buffer)`` with
    ``workers`` workers: each worker reads its shards in turn through a buffer of its own, and
    the loader takes a batch from each worker in turn."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(shards)).tolist()
    streams = [[i for s in order[w::workers] for i in shards.shard_samples(s)] for w in range(workers)]
    outs = [webdataset_shuffle(st, buffer, rng) for st in streams]
    batches = [[o[a : a + batch] for a in range(0, len(o), batch)] for o in outs]
    return [i for k in range(max(map(len, batches))) for b in batches if k < len(b) for i in b[k]]


def test_class_sorted_shards_mix_about_as_webdataset_at_the_same_memory() -> None:
    # 40 shards of one class each, 250 samples of ~4.6 kB; WebDataset with 2 workers, a buffer
    # of 1000 samples each and batches of 32; s5loader with a budget of those 2000 samples' bytes
    shards = shard_set([250] * 40)
    owner = unit_of(shards)
    budget = 2 * REFERENCE_BUFFER * SAMPLE
    cost = Freeing(shards, room=budget - shards[0].disk)
    for seed in range(3):
        o = Order(True, seed, 1, 0, False)
        mixed = shuffle_quality(
            o.shard_order(shards.samples, 0, 0, shards.shard_units, 1, cost=cost), owner, 64
        )
        wds = shuffle_quality(webdataset_like(shards, 2, REFERENCE_BUFFER, 32, seed), owner, 64)
        assert mixed.units_per_64 >= 0.9 * wds.units_per_64 and mixed.first_units > wds.first_units
        whole = o.shard_order(shards.samples, 0, 0, shards.shard_units, budget // shards[0].disk - 1)
        assert (
            mixed.units_per_64 > 2 * shuffle_quality(whole, owner, 64).units_per_64
        )  # what counting frees buys


@pytest.mark.parametrize("frees", [True, False])
@pytest.mark.parametrize("per_shard", [20, 100, 250, 1000, 3000])
def test_the_named_budget_mixes_at_least_like_a_1000_sample_buffer(frees: bool, per_shard: int) -> None:
    shards = shard_set([per_shard] * max(60, 12000 // per_shard))
    owner = unit_of(shards)
    largest = shards[0].disk
    budget = mixing_budget(per_shard, shards[0].size / per_shard, largest, frees)
    stream = [i for s in range(len(shards)) for i in shards.shard_samples(s)]
    for seed in range(2):
        o = Order(True, seed, 1, 0, False)
        if frees:
            order = o.shard_order(
                shards.samples, 0, 0, shards.shard_units, 1, cost=Freeing(shards, budget - largest)
            )
        else:
            order = o.shard_order(shards.samples, 0, 0, shards.shard_units, budget // largest - 1)
        buffered = shuffle_quality(
            buffer_shuffle(stream, REFERENCE_BUFFER, np.random.default_rng(seed)), owner, 64
        )
        assert shuffle_quality(order, owner, 64).units_per_64 >= buffered.units_per_64
    assert abs(buffer_units(per_shard) - buffered.units_per_64) < 1  # the estimate: the buffer once full
    assert whole_units(1) == 1 and 63 < whole_units(10**6) <= 64


def test_the_shards_of_an_order_at_once_are_those_of_each_sample() -> None:
    shards = shard_set([3, 1, 5, 2, 4])
    order = random.Random(1).sample(range(15), 15)
    each = [shards.locate(i)[0] for i in order]
    assert shards.units_of(order) == each == [unit_of(shards)[i] for i in order]
    assert shards.units_of([]) == []
