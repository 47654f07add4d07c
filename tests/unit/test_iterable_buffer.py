"""A shuffle buffer over tar shards against a worker's share of the budget: checked in the
process that makes the S5IterableDataset (and at each set_epoch), naming shuffle_buffer, the
budget, the largest buffer that fits and the budget that holds this one; no server needed (the
shards are described, never fetched)."""

from __future__ import annotations

import os
import re

import pytest

from s5loader import Access, BudgetError, S5Dataset, S5IterableDataset
from s5loader._index.sample import Field, Sample
from s5loader._sampling.order import Order
from s5loader._sampling.workerorder import worker_frees, worker_order, worker_window
from s5loader._shards import index as _shards
from s5loader._shards.dataset import ShardSet
from s5loader._shards.passes import ShardPass
from s5loader._util.uri import parse_size

SHARD = 1_000_000


def shard_set(count: int = 40, per_shard: int = 50) -> S5Dataset:
    """``count`` shards of ``per_shard`` samples, :data:`SHARD` bytes each (described only)."""
    access = Access()
    shards = [_shards.Shard(f"s3://b/train/{i:03d}.tar", SHARD, "", per_shard) for i in range(count)]
    return S5Dataset([], access=access, source="s3://b/train/", shards=ShardSet(shards, access, "s3://b/train/"))


def suggestions(message: str) -> tuple[int, str]:
    found = re.search(r"shuffle_buffer=(\d+) or less, or raise the budget to at least ([\d.]+ \w+)", message)
    assert found, message
    return int(found[1]), found[2].replace(" ", "")


@pytest.mark.parametrize("shuffle", [True, False, "block"])
def test_a_buffer_the_share_cannot_hold_is_refused_when_the_dataset_is_made(shuffle: bool | str, tmp_path) -> None:
    ds = shard_set()
    with pytest.raises(BudgetError) as caught:
        S5IterableDataset(ds, shuffle=shuffle, shuffle_buffer=100, budget=10 * SHARD, num_workers=2,
                          staging_dir=str(tmp_path))
    message = str(caught.value)
    assert "shuffle_buffer=100" in message and "s3://b/train/" in message
    assert "budget of 9.5 MiB" in message and "4.8 MiB each of 2 DataLoader workers" in message
    assert os.listdir(tmp_path) == []  # the staging directory it made is gone with the error
    # what it suggests is so, for this epoch and the next ones
    fits, holds = suggestions(message)
    assert 1 < fits < 100
    for buffer, budget in ((fits, 10 * SHARD), (100, parse_size(holds))):
        with S5IterableDataset(ds, shuffle=shuffle, shuffle_buffer=buffer, budget=budget, num_workers=2,
                               staging_dir=str(tmp_path)) as it:
            for epoch in range(1, 8):
                it.set_epoch(epoch)


def test_set_epoch_checks_the_epochs_own_draw(tmp_path) -> None:
    ds = shard_set()
    budget, buffer = 10 * SHARD, 4  # fits epoch 0's draw, not every later one
    with S5IterableDataset(ds, shuffle=True, shuffle_buffer=buffer, budget=budget, num_workers=2,
                           staging_dir=str(tmp_path)) as it:
        refused = []
        for epoch in range(1, 12):
            try:
                it.set_epoch(epoch)
            except BudgetError as exc:
                assert f"part of epoch {epoch} needs" in str(exc)
                refused.append(epoch)
        assert refused
        # each refused epoch is one whose pass a worker could not stage within its share
        order = Order(True, 0, 1, 0, False, sharded=True)
        frees = worker_frees(ds, True, False, str(tmp_path))  # as the workers will stage
        window, cost = worker_window(ds, budget // 2, 2, True, frees)
        for epoch in range(1, 12):
            peaks = [
                ShardPass(ds, worker_order(order, len(ds), epoch, w, 2, buffer, units=ds.shards.shard_units,
                                           window=window, runs=True, cost=cost), "", False, "raise", frees).peak_bytes()[0]
                for w in range(2)
            ]
            assert (max(peaks) > budget // 2) == (epoch in refused)
        assert it.epoch not in refused


def test_a_buffer_over_raw_objects_costs_no_staging_space(tmp_path) -> None:
    samples = [Sample(f"k{i}", (Field("bin", f"s3://b/k{i}.bin", 1000, ""),)) for i in range(500)]
    with S5IterableDataset(S5Dataset(samples), shuffle=True, shuffle_buffer=400, budget=4000, num_workers=2,
                           staging_dir=str(tmp_path)):
        pass


def test_without_num_workers_nothing_is_checked_before_the_workers_start(tmp_path) -> None:
    with S5IterableDataset(shard_set(), shuffle=True, shuffle_buffer=100, budget=10 * SHARD,
                           staging_dir=str(tmp_path)) as it:
        it.set_epoch(1)  # each worker checks its own part when it starts (tests/test_iterable.py)
