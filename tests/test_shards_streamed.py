"""The first tar shard of a pass is read while it downloads (against local S3 servers behind a
fault proxy): its first samples come before its end, the engine waits for them, a broken
download resumes, a short shard is found at its end."""

from __future__ import annotations

import pytest
from support.shards import leftovers, load_all, make_shards, put_indexed, put_indexed_with
from support.stores import Store
from support.waits import stays_false
from torch.utils.data import DataLoader

from s5loader import S5Dataset, S5Sampler, ShardError


def test_the_first_shard_of_a_pass_is_read_while_it_downloads(seaweed: Store, staging_root: str) -> None:
    import threading

    from support.faults import FaultProxy, Rule

    shards, expected = make_shards(3, 60, size=4000)
    source = put_indexed(seaweed, shards)
    # The first shard's body stops half way until released: its first samples must come anyway
    # (the loader asks for 16 indices ahead, in the first half).
    proxy = FaultProxy(seaweed.endpoint, rules=[Rule("shard-000.tar", "half")])
    guard = threading.Timer(30, proxy.release.set)  # never hang: a shard read whole waits for this
    guard.start()
    try:
        ds = S5Dataset.from_shards(source, endpoint_url=proxy.endpoint)
        with S5Sampler(
            ds, shuffle=False, budget=4 * max(map(len, shards.values())), staging_dir=staging_root
        ) as sampler:
            got, first_while_held = [], None
            for batch in DataLoader(ds, sampler=sampler, batch_size=4, num_workers=2, collate_fn=lambda b: b):
                if first_while_held is None:
                    first_while_held = not proxy.release.is_set()
                    proxy.release.set()
                got += batch
            assert leftovers(sampler.staging_dir) == []
            assert sampler.stats is not None and sampler.stats.staged_units == 3
        gets = [(m, p, h) for m, p, h in proxy.requests if "shard-000.tar" in p]
    finally:
        guard.cancel()
        proxy.close()
    assert first_while_held is True  # the first batch came while half the shard was still held
    assert [x["__key__"] for x in got] == sorted(expected)  # each sample once, in order
    assert all({k: v for k, v in x.items() if k != "__key__"} == expected[x["__key__"]] for x in got)
    assert [m for m, _, _ in gets] == ["GET"]  # one streamed GET, no HEAD, no second copy


def test_the_engine_starts_once_the_streamed_first_shard_gave_a_sample(
    moto: Store, staging_root: str
) -> None:
    # The other shards' calls do not share the link with the first shard before its first
    # sample is here: while its GET gets no answer, nothing else is requested.
    import threading

    from support.faults import FaultProxy, Rule

    shards, expected = make_shards(3, 10, size=3000)
    source = put_indexed(moto, shards)
    proxy = FaultProxy(moto.endpoint, rules=[Rule("shard-000.tar", "hold")])
    guard = threading.Timer(30, proxy.release.set)
    guard.start()
    try:
        ds = S5Dataset.from_shards(source, endpoint_url=proxy.endpoint)
        with S5Sampler(ds, shuffle=False, budget=1 << 20, staging_dir=staging_root) as sampler:
            it = iter(sampler)
            first: list[int] = []
            t = threading.Thread(target=lambda: first.append(next(it)))
            t.start()
            assert proxy.wait_held("shard-000.tar", 1, 30), "the streamed shard was never requested"
            stays_false(
                lambda: [p for _, p, _ in proxy.requests if "shard-000.tar" not in p and ".tar" in p],
                1.5,
                "another shard was requested before the streamed one gave a sample",
            )
            proxy.release.set()
            t.join(30)
            rest = list(it)
            keys = [ds[i]["__key__"] for i in first + rest]
    finally:
        guard.cancel()
        proxy.close()
    assert sorted(keys) == sorted(expected)  # then every sample once


def test_a_streamed_first_shard_resumes_a_broken_download_and_checks_what_it_reads(
    moto: Store, staging_root: str
) -> None:
    from support.faults import FaultProxy, Rule

    shards, expected = make_shards(2, 10, size=3000)
    source = put_indexed(moto, shards)
    proxy = FaultProxy(moto.endpoint, rules=[Rule("shard-000.tar", "truncate", times=1)])
    try:
        ds = S5Dataset.from_shards(source, endpoint_url=proxy.endpoint)
        with S5Sampler(ds, shuffle=False, budget=1 << 20, staging_dir=staging_root, verify=True) as sampler:
            got = load_all(ds, sampler)
        ranged = [h.get("range") for m, p, h in proxy.requests if "shard-000.tar" in p and m == "GET"]
    finally:
        proxy.close()
    assert sorted(x["__key__"] for x in got) == sorted(expected)
    assert all({k: v for k, v in x.items() if k != "__key__"} == expected[x["__key__"]] for x in got)
    assert len(ranged) == 2 and ranged[0] is None and ranged[1] is not None and ranged[1].startswith("bytes=")
    # a first shard that is not what its index says: an error naming it, as for a staged shard
    proxy = FaultProxy(moto.endpoint, rules=[Rule("shard-000.tar", "corrupt")])
    try:
        ds = S5Dataset.from_shards(source, endpoint_url=proxy.endpoint)
        with S5Sampler(ds, shuffle=False, budget=1 << 20, staging_dir=staging_root, verify=True) as sampler:
            with pytest.raises(ShardError, match=r"s3://.*shard-000\.tar"):
                load_all(ds, sampler, workers=0)
            assert leftovers(sampler.staging_dir) == []
    finally:
        proxy.close()


def test_a_streamed_first_shard_found_short_at_its_end_keeps_what_was_read_under_skip(
    moto: Store, staging_root: str
) -> None:
    shards, expected = make_shards(3, 10, size=3000)
    # the index says 12 samples for the first shard, which holds 10: found at its end
    source = put_indexed_with(moto, shards, {"shard-000.tar": 12})
    ds = S5Dataset.from_shards(source, endpoint_url=moto.endpoint)
    with S5Sampler(ds, shuffle=False, budget=1 << 20, staging_dir=staging_root, on_error="skip") as sampler:
        got = load_all(ds, sampler)
        assert sampler.stats is not None and [u.rsplit("/", 1)[-1] for u in sampler.stats.skipped] == [
            "shard-000.tar"
        ]
        assert leftovers(sampler.staging_dir) == []
    # the ten samples it holds were read from the streamed copy, each once and byte-exact
    assert sorted(x["__key__"] for x in got) == sorted(expected)
    assert all({k: v for k, v in x.items() if k != "__key__"} == expected[x["__key__"]] for x in got)
