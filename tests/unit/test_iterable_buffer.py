"""A shuffle buffer over tar shards against the rank's budget: checked in the process that makes
the S5IterableDataset (and at each set_epoch), naming shuffle_buffer, the budget, the largest
buffer that fits and the budget that holds this one; no server needed (the shards are
described, never fetched).

Private modules (``s5loader._index``, ``s5loader._sampling``, ``s5loader._shards``) are imported
on purpose: their own behaviour is what these tests check."""

from __future__ import annotations

import os
import re

import pytest

from s5loader import Access, BudgetError, S5Dataset, S5IterableDataset, parse_size
from s5loader._index.sample import Field, Sample
from s5loader._sampling.iterparts import rank_order
from s5loader._sampling.order import Order
from s5loader._sampling.staging import layout
from s5loader._sampling.units import units_of
from s5loader._shards import index as _shards
from s5loader._shards.shardset import ShardSet

SHARD = 1_000_000


def shard_set(count: int = 40, per_shard: int = 50) -> S5Dataset:
    """``count`` shards of ``per_shard`` samples, :data:`SHARD` bytes each (described only)."""
    access = Access()
    shards = [_shards.Shard(f"s3://b/train/{i:03d}.tar", SHARD, "", per_shard) for i in range(count)]
    return S5Dataset(
        [], access=access, source="s3://b/train/", shards=ShardSet(shards, access, "s3://b/train/")
    )


def suggestions(message: str) -> tuple[int, str]:
    found = re.search(r"shuffle_buffer=(\d+) or less, or raise the budget to at least ([\d.]+ \w+)", message)
    assert found, message
    return int(found[1]), found[2].replace(" ", "")


@pytest.mark.parametrize("shuffle", [True, False, "block"])
def test_a_buffer_the_budget_cannot_hold_is_refused_when_the_dataset_is_made(
    shuffle: bool | str, tmp_path
) -> None:
    ds = shard_set()
    with pytest.raises(BudgetError) as caught:
        S5IterableDataset(
            ds, shuffle=shuffle, shuffle_buffer=200, budget=5 * SHARD, staging_dir=str(tmp_path)
        )
    message = str(caught.value)
    assert "shuffle_buffer=200" in message and "s3://b/train/" in message and "budget of 4.8 MiB" in message
    assert os.listdir(tmp_path) == []  # the staging directory it made is gone with the error
    # what it suggests is so, for this epoch and the next ones
    fits, holds = suggestions(message)
    assert 1 < fits < 200
    for buffer, budget in ((fits, 5 * SHARD), (200, parse_size(holds))):
        with S5IterableDataset(
            ds, shuffle=shuffle, shuffle_buffer=buffer, budget=budget, staging_dir=str(tmp_path)
        ) as it:
            for epoch in range(1, 8):
                it.set_epoch(epoch)


def test_set_epoch_checks_the_epochs_own_draw(tmp_path) -> None:
    ds, budget = shard_set(), 5 * SHARD
    units, order = units_of(ds), Order(True, 0, 1, 0, False)
    window, cost = layout(ds, budget, True, str(tmp_path))  # as the rank will stage

    def too_big(buffer: int, epoch: int) -> bool:
        mine = rank_order(units, order, epoch, buffer, None, window, cost)[0]
        return (units.peak_bytes(mine, cost is not None) or 0) > budget

    # a buffer that fits epoch 0's draw, not every later one
    buffer = next(k for k in range(2, 120) if not too_big(k, 0) and any(too_big(k, e) for e in range(1, 16)))
    with S5IterableDataset(
        ds, shuffle=True, shuffle_buffer=buffer, budget=budget, staging_dir=str(tmp_path)
    ) as it:
        refused = []
        for epoch in range(1, 16):
            try:
                it.set_epoch(epoch)
            except BudgetError as exc:
                assert f"order of epoch {epoch} needs" in str(exc)
                refused.append(epoch)
        assert refused == [e for e in range(1, 16) if too_big(buffer, e)]
        assert it.epoch not in refused


def test_a_buffer_over_raw_objects_costs_no_staging_space(tmp_path) -> None:
    samples = [Sample(f"k{i}", (Field("bin", f"s3://b/k{i}.bin", 1000, ""),)) for i in range(500)]
    with S5IterableDataset(
        S5Dataset(samples), shuffle=True, shuffle_buffer=400, budget=4000, staging_dir=str(tmp_path)
    ) as it:
        it.set_epoch(1)  # 400 buffered samples of 1000 bytes and a budget of 4000: no BudgetError
        assert it.epoch == 1
