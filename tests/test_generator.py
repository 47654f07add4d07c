"""A fourth front end over :class:`s5loader.Staging`: the plain generator of the guide, run
against real s5cmd and real local S3 servers. It needs no setup of its own: the order, the
window, the budget and the epoch cache come from the staging object the other front ends adapt."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest
from support.shards import make_shards, put_indexed
from support.stores import Store, make_pairs, on_disk, staged_samples

from s5loader import ConfigError, S5Dataset, S5Sampler, Staging, parse_size


def samples(ds: S5Dataset, staging: Staging, epoch: int, start: int = 0) -> Iterator[dict[str, Any]]:
    """The guide's generator: each sample of ``epoch`` once it is staged; reading deletes it."""
    for index in staging.stage(epoch, start):
        yield ds[index]


def test_a_generator_over_staging_yields_each_sample_once_in_the_samplers_order_within_the_budget(
    store: Store, staging_root: str
) -> None:
    source = store.put(make_pairs(60, size=700))
    ds = S5Dataset.from_prefix(store.uri(), endpoint_url=store.endpoint)
    budget = "8KiB"  # about 6 samples of 1.4 kB: the generator waits for staging
    keys = sorted({k.rsplit(".", 1)[0] for k in source})
    opts = {"seed": 3, "staging_dir": staging_root, "budget": budget, "samples_per_call": 5}
    with Staging(ds, **opts) as staging:
        where = staging.staging_dir
        orders = []
        peak = 0
        for epoch in range(2):
            got = []
            for s in samples(ds, staging, epoch):
                peak = max(peak, on_disk(where))
                assert s["image"] == source[s["__key__"] + ".image"]
                assert s["label"] == source[s["__key__"] + ".label"]
                got.append(s["__key__"])
            assert sorted(got) == keys  # each sample once
            assert staged_samples(where) == []  # read means deleted
            orders.append(got)
        assert orders[0] != orders[1]  # an order per epoch
        assert 0 < peak <= parse_size(budget)
        m = staging.metrics(1, len(staging))
        assert m.get_requests == 120 and m.budget == parse_size(budget)
    assert not os.path.exists(where)  # close removes the staging directory
    # the same staging object is the sampler's: the same order, epoch by epoch
    with S5Sampler(ds, **opts) as sampler:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            assert [ds[i]["__key__"] for i in sampler] == orders[epoch]


def test_a_generator_stopped_part_way_goes_on_after_the_samples_it_took(
    moto: Store, staging_root: str
) -> None:
    moto.put(make_pairs(30, size=200))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    with Staging(ds, shuffle="block", seed=1, staging_dir=staging_root, budget="64KiB") as staging:
        whole = [s["__key__"] for s in samples(ds, staging, 0)]
        first = []
        for s in samples(ds, staging, 0):
            first.append(s["__key__"])
            if len(first) == 11:
                break  # the generator is dropped part-way; its pass stops with the next one
        assert staging.position == len(first) == 11
        rest = [s["__key__"] for s in samples(ds, staging, 0, start=staging.position)]
        assert first + rest == whole
        with pytest.raises(ConfigError, match="start=31 is past the 30 samples"):
            staging.stage(0, 31)
        where = staging.staging_dir
    assert not os.path.exists(where)


def test_a_generator_over_tar_shards_reads_each_sample_once(seaweed: Store, staging_root: str) -> None:
    shards, expected = make_shards(6, 10, size=2000)
    ds = S5Dataset.from_shards(put_indexed(seaweed, shards), endpoint_url=seaweed.endpoint)
    largest = max(map(len, shards.values()))
    with Staging(ds, seed=5, staging_dir=staging_root, budget=3 * largest) as staging:
        assert staging.window < 6  # the budget holds some of the shards: a shard order's window
        got = {}
        peak = 0
        with pytest.warns(UserWarning, match=r"Staging\(shuffle=True\) over the tar shards .* holds about 3"):
            for s in samples(ds, staging, 0):
                peak = max(peak, on_disk(staging.staging_dir))
                got[s["__key__"]] = {"bin": s["bin"], "cls": s["cls"]}
        assert got == expected
        assert peak <= 3 * largest


def test_a_staging_dropped_without_close_removes_its_directory(moto: Store, staging_root: str) -> None:
    moto.put(make_pairs(20, size=100))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    staging = Staging(ds, seed=2, staging_dir=staging_root, budget="64KiB")
    it = samples(ds, staging, 0)
    assert next(it)["__key__"]
    where = staging.staging_dir
    assert os.path.isdir(where)
    del it, staging
    gc.collect()
    assert not os.path.exists(where)


def test_a_loop_over_an_unnamed_staging_keeps_it_until_the_loop_ends(moto: Store, staging_root: str) -> None:
    source = moto.put(make_pairs(25, size=100))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    got = []
    for index in Staging(ds, seed=4, staging_dir=staging_root, budget="4KiB", samples_per_call=3).stage(0):
        gc.collect()  # nothing but the loop holds the staging: it must not be closed under it
        got.append(ds[index]["__key__"])
    assert sorted(got) == sorted({k.rsplit(".", 1)[0] for k in source})
    gc.collect()
    assert os.listdir(staging_root) == []  # collected after the loop: its directory is gone
