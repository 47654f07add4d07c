"""The epoch cache over tar shards, through the real path: s5cmd against SeaweedFS behind a proxy
that counts GETs per shard; the sampler and the iterable dataset with DataLoader workers.

A private module (``s5loader._sampling``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.faults import FaultProxy
from support.shards import class_sorted_shards, leftovers, shard_gets
from support.stores import Peak, Store, on_disk
from torch.utils.data import DataLoader

from s5loader import S5Dataset, S5IterableDataset, S5Sampler
from s5loader._sampling import units

SHARDS, PER_SHARD, SIZE = 8, 10, 3000


def collate(batch):  # type: ignore[no-untyped-def]
    return batch


@pytest.fixture
def proxy(seaweed: Store) -> Iterator[FaultProxy]:
    p = FaultProxy(seaweed.endpoint)
    yield p
    p.close()


@pytest.fixture
def shards(seaweed: Store, proxy: FaultProxy) -> tuple[S5Dataset, dict[str, bytes], int]:
    source, tars, big = class_sorted_shards(seaweed, n_shards=SHARDS, per_shard=PER_SHARD, size=SIZE)
    return S5Dataset.from_shards(source, endpoint_url=proxy.endpoint), tars, big


def sampler_epoch(ds: S5Dataset, sampler: S5Sampler, e: int) -> list[str]:
    sampler.set_epoch(e)
    loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=2, collate_fn=collate)
    return [x["__key__"] for b in loader for x in b]


def iterable_epoch(it: S5IterableDataset, e: int) -> list[str]:
    it.set_epoch(e)
    return [x["__key__"] for b in DataLoader(it, batch_size=4, num_workers=2, collate_fn=collate) for x in b]


def every_key() -> list[str]:
    return sorted(f"c{s}-{j:03d}" for s in range(SHARDS) for j in range(PER_SHARD))


@pytest.mark.parametrize("form", ["sampler", "iterable"])
def test_a_cache_that_holds_every_shard_fetches_nothing_after_the_first_epoch(
    form: str, shards, proxy: FaultProxy, staging_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from s5loader._shards import tar

    scanned: list[str] = []
    scan = tar.scan_file
    monkeypatch.setattr(tar, "scan_file", lambda path, uri: scanned.append(uri) or scan(path, uri))
    ds, tars, big = shards
    total = sum(map(len, tars.values()))
    opts = {
        "budget": 3 * big,
        "epoch_cache": total,
        "staging_dir": staging_root,
        "shuffle": "block",
        "seed": 3,
    }
    if form == "sampler":
        with S5Sampler(ds, **opts) as sampler:
            first = sampler_epoch(ds, sampler, 0)
            mark, scans = len(proxy.requests), len(scanned)
            later = [sampler_epoch(ds, sampler, e) for e in (1, 2)]
            assert sampler.metrics().epoch_cache_hits == SHARDS
            # each shard scanned once in the first epoch (the first streams: read as it downloads)
            assert scans == SHARDS - 1 and len(scanned) == scans  # a hit keeps its member table
    else:
        with S5IterableDataset(ds, **opts) as it:
            first = iterable_epoch(it, 0)
            mark = len(proxy.requests)
            later = [iterable_epoch(it, e) for e in (1, 2)]
    assert sorted(first) == every_key() and all(sorted(k) == every_key() for k in later)
    assert shard_gets(proxy.requests[:mark]) == {name: 1 for name in tars}  # the first epoch: each shard once
    assert shard_gets(proxy.requests[mark:]) == {}, shard_gets(proxy.requests[mark:])  # later epochs: none


@pytest.mark.parametrize("form", ["sampler", "iterable"])
def test_half_a_cache_keeps_half_the_shards_in_the_same_order_within_budget_plus_cache(
    form: str, shards, proxy: FaultProxy, staging_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds, tars, big = shards
    total = sum(map(len, tars.values()))
    budget, cache = 3 * big, total // 2

    def run(epoch_cache: int) -> tuple[list[list[str]], int, int]:
        opts = {
            "budget": budget,
            "epoch_cache": epoch_cache,
            "staging_dir": staging_root,
            "shuffle": True,
            "seed": 5,
        }
        mark = len(proxy.requests)
        with Peak(lambda: on_disk(staging_root)) as peak:
            if form == "sampler":
                with S5Sampler(ds, **opts) as sampler:
                    got = [sampler_epoch(ds, sampler, e) for e in (0, 1)]
            else:
                with S5IterableDataset(ds, **opts) as it:
                    got = [iterable_epoch(it, e) for e in (0, 1)]
        gets = shard_gets(proxy.requests[mark:])
        return got, sum(gets.values()), peak.peak

    plain, plain_gets, _ = run(0)
    cached, cached_gets, peak = run(cache)
    assert all(sorted(k) == every_key() for k in cached)
    # the cache never changes the order: a shard it keeps is not punched as it is read, and what
    # its samples would give back counts against the cache instead of the budget
    assert cached == plain
    if form == "sampler":  # an order that holds shards whole is another one
        with monkeypatch.context() as m:
            m.setattr(units, "punches_holes", lambda folder, most: False)
            whole, _, _ = run(0)
        assert whole != plain
    # the second epoch fetches about half the shards: the other half comes from the cache
    second = cached_gets - SHARDS
    assert plain_gets == 2 * SHARDS and 0 < second <= SHARDS // 2 + 1, (plain_gets, cached_gets)
    assert peak <= budget + cache + 4 * 4096, (peak, budget + cache)  # whole blocks on disk
    assert leftovers(staging_root) == []


def test_a_damaged_cached_shard_is_fetched_again(shards, proxy: FaultProxy, staging_root: str) -> None:
    import glob
    import os

    ds, tars, big = shards
    total = sum(map(len, tars.values()))
    with S5Sampler(ds, budget=3 * big, epoch_cache=total, staging_dir=staging_root, shuffle=False) as sampler:
        sampler_epoch(ds, sampler, 0)
        # the first shard's entry (those read last are admitted when the next epoch begins)
        entries = glob.glob(os.path.join(staging_root, "s5loader-cache-*", "0", "tar"))
        assert len(entries) == 1
        with open(entries[0], "r+b") as fh:  # cut short: no longer the object it was listed as
            fh.truncate(100)
        mark = len(proxy.requests)
        assert sorted(sampler_epoch(ds, sampler, 1)) == every_key()
    assert sum(shard_gets(proxy.requests[mark:]).values()) == 1


@pytest.mark.parametrize("form, workers", [("sampler", 0), ("sampler", 2), ("iterable", 2)])
def test_a_shuffled_order_with_half_a_cache_runs_at_a_budget_of_four_shards(
    form: str, workers: int, seaweed: Store, proxy: FaultProxy, staging_root: str
) -> None:
    # the report: 19 shards, shuffle=True, a budget of a few shards and a cache of half the data set
    # stalled (num_workers=0) or failed at iter(); the same order without a cache ran
    n = 19
    source, tars, big = class_sorted_shards(seaweed, n_shards=n, per_shard=40, size=5000)
    ds = S5Dataset.from_shards(source, endpoint_url=proxy.endpoint)
    total = sum(map(len, tars.values()))
    keys = sorted(f"c{s}-{j:03d}" for s in range(n) for j in range(40))
    budget = 4 * big
    opts = {
        "budget": budget,
        "epoch_cache": total // 2,
        "staging_dir": staging_root,
        "shuffle": True,
        "seed": 1,
    }
    fetched = []
    with Peak(lambda: on_disk(staging_root)) as peak:
        with S5Sampler(ds, **opts) if form == "sampler" else S5IterableDataset(ds, **opts) as front:
            for e in (0, 1):
                front.set_epoch(e)
                mark = len(proxy.requests)
                if form == "sampler":
                    loader = DataLoader(
                        ds, sampler=front, batch_size=8, num_workers=workers, collate_fn=collate
                    )
                else:
                    loader = DataLoader(front, batch_size=8, num_workers=workers, collate_fn=collate)
                got = [x["__key__"] for b in loader for x in b]
                assert sorted(got) == keys  # every sample once
                gets = shard_gets(proxy.requests[mark:])
                fetched.append(sum(len(tars[name]) * count for name, count in gets.items()))
    assert fetched[1] <= 0.55 * fetched[0], fetched
    # budget + cache, and half a shard of slack: a loaded machine once showed 3.87 MB against the
    # 3.73 MB bound (its cause not found: a transient of about half a shard), runs alone 3.55-3.59 MB
    assert peak.peak <= budget + total // 2 + big // 2, (peak.peak, budget + total // 2)
    assert leftovers(staging_root) == []
