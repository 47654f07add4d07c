"""Tar shards through S5Dataset.from_shards, S5Sampler and a DataLoader against local S3
servers: byte-exact loads, rank splits, resume, the budget, shard orders, gzip shards."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
from collections import Counter

import pytest
from support.shards import (
    class_sorted_shards,
    gzip_shards,
    leftovers,
    load_all,
    make_shards,
    put_indexed,
    sample_bytes,
    shard_gets,
    tar_of,
)
from support.stores import Store, on_disk
from torch.utils.data import DataLoader

from s5loader import BudgetError, S5Dataset, S5Sampler, ShardIndexError


def test_webdataset_and_gnu_tar_shards_load_byte_exact_through_both_datasets_and_the_daemon(
    seaweed: Store, tmp_path, staging_root: str
) -> None:
    import webdataset as wds

    expected: dict[str, dict[str, bytes]] = {}
    local = tmp_path / "wds"
    local.mkdir()
    with wds.ShardWriter(str(local / "shard-%03d.tar"), maxcount=8, verbose=0) as sink:
        for i in range(20):
            fields = {
                "bin": sample_bytes(i, 2000 + i),
                "cls": str(i % 3).encode(),
                "meta.json": b'{"i": %d}' % i,
            }
            expected[f"w{i:04d}"] = fields
            sink.write({"__key__": f"w{i:04d}", **fields})
    gnu = tmp_path / "gnu"
    (gnu / "d").mkdir(parents=True)
    for i in range(6):
        fields = {"txt": f"text {i}".encode(), "bin": sample_bytes(100 + i, 5000)}
        expected[f"d/g{i:04d}"] = fields
        for f, v in fields.items():
            (gnu / "d" / f"g{i:04d}.{f}").write_bytes(v)
    names = sorted(p.name for p in (gnu / "d").iterdir())
    subprocess.run(
        ["tar", "cf", str(local / "shard-100.tar"), *[f"d/{n}" for n in names]], cwd=gnu, check=True
    )
    store_shards = {p.name: p.read_bytes() for p in sorted(local.iterdir())}
    assert len(store_shards) == 4
    seaweed.put(store_shards)
    source = seaweed.uri("shard-{000..002}.tar")
    with pytest.raises(ShardIndexError, match="s5loader index-shards"):
        S5Dataset.from_shards(seaweed.uri(), endpoint_url=seaweed.endpoint)
    # the CLI builds and uploads the index; without a terminal, progress comes as lines
    r = subprocess.run(
        [sys.executable, "-m", "s5loader", "index-shards", seaweed.uri(), "--endpoint-url", seaweed.endpoint],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "4 shards of 4" in r.stderr and "26 samples" in r.stdout
    ds = S5Dataset.from_shards(seaweed.uri(), endpoint_url=seaweed.endpoint)
    assert len(ds) == 26 and len(ds.samples) == 4
    assert (
        len(S5Dataset.from_shards(source, index=seaweed.uri("wids.json"), endpoint_url=seaweed.endpoint))
        == 20
    )
    with S5Sampler(
        ds, shuffle="block", seed=1, budget=200_000, samples_per_call=8, staging_dir=staging_root
    ) as sampler:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            got = load_all(ds, sampler)
            assert sorted(x["__key__"] for x in got) == sorted(expected)
            for x in got:
                assert {k: v for k, v in x.items() if k != "__key__"} == expected[x["__key__"]]
            assert leftovers(sampler.staging_dir) == []  # every shard deleted once read
            assert sampler.stats is not None and sampler.stats.staged_units == 4  # one cp per shard
    # the same shards through the iterable dataset (two workers) and the daemon
    from s5loader import S5IterableDataset, consume

    with S5IterableDataset(ds, shuffle="block", seed=2, budget=400_000, staging_dir=staging_root) as it:
        got = [x for b in DataLoader(it, batch_size=4, num_workers=2, collate_fn=lambda b: b) for x in b]
    assert sorted(x["__key__"] for x in got) == sorted(expected)
    assert all({k: v for k, v in x.items() if k != "__key__"} == expected[x["__key__"]] for x in got)
    cache = tmp_path / "cache"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "s5loader",
            "prefetch",
            "--shards",
            seaweed.uri(),
            "--cache",
            str(cache),
            "--budget",
            "1MB",
            "--endpoint-url",
            seaweed.endpoint,
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    delivered = {}
    for sample in consume(cache, timeout=10):
        delivered[sample.key] = {f: sample.read(f) for f in sample.files}
    assert delivered == expected


def test_every_sample_once_per_epoch_over_two_ranks_and_a_mid_epoch_resume(
    moto: Store, staging_root: str
) -> None:
    shards, expected = make_shards(5, 7)
    source = put_indexed(moto, shards)
    ds = S5Dataset.from_shards(source, endpoint_url=moto.endpoint)
    keys: list[str] = []
    for rank in range(2):
        with S5Sampler(
            ds,
            shuffle="block",
            num_replicas=2,
            rank=rank,
            drop_last=True,
            budget=70_000,
            samples_per_call=6,
            staging_dir=staging_root,
        ) as sampler:
            got = load_all(ds, sampler)
            keys += [x["__key__"] for x in got]
    assert len(keys) == 34 and len(set(keys)) == 34  # 35 samples, drop_last: each once, equal parts

    with S5Sampler(
        ds, shuffle="block", seed=3, budget=70_000, samples_per_call=6, staging_dir=staging_root
    ) as s:
        it = iter(s)
        first = [ds[next(it)]["__key__"] for _ in range(11)]
        state = s.state_dict()
    with S5Sampler(
        ds, shuffle="block", seed=3, budget=70_000, samples_per_call=6, staging_dir=staging_root
    ) as s:
        s.load_state_dict(state)
        rest = [x["__key__"] for x in load_all(ds, s)]
        assert leftovers(s.staging_dir) == []
    assert len(first) + len(rest) == 35 and set(first) | set(rest) == set(expected)


def test_three_ranks_over_uneven_shards_each_sample_once_with_and_without_drop_last(
    moto: Store, staging_root: str
) -> None:
    shards = {
        f"shard-{i:03d}.tar": tar_of([(f"k{i:02d}{j:02d}.bin", b"%d" % j) for j in range(n)])
        for i, n in enumerate((1, 6, 2, 5, 3))
    }  # 17 samples
    source = put_indexed(moto, shards)
    ds = S5Dataset.from_shards(source, endpoint_url=moto.endpoint)
    for drop_last in (False, True):
        parts = []
        for rank in range(3):
            with S5Sampler(
                ds,
                shuffle="block",
                seed=1,
                num_replicas=3,
                rank=rank,
                drop_last=drop_last,
                budget=60_000,
                samples_per_call=4,
                staging_dir=staging_root,
            ) as sampler:
                parts.append([x["__key__"] for x in load_all(ds, sampler, workers=0)])
                assert leftovers(sampler.staging_dir) == []
        keys = [k for p in parts for k in p]
        assert {len(p) for p in parts} == {5 if drop_last else 6}
        if drop_last:
            assert len(set(keys)) == 15
        else:
            assert set(keys) == {f"k{i:02d}{j:02d}" for i, n in enumerate((1, 6, 2, 5, 3)) for j in range(n)}


def test_budget_and_shuffle_rules_over_shards(moto: Store, staging_root: str) -> None:
    shards, _ = make_shards(3, 4, size=3000)
    source = put_indexed(moto, shards)
    ds = S5Dataset.from_shards(source, endpoint_url=moto.endpoint)
    big = max(len(v) for v in shards.values())
    with pytest.raises(BudgetError, match=r"shard s3://.*shard-00\d\.tar.*staged whole"):
        S5Sampler(ds, budget=big - 1, shuffle="block", staging_dir=staging_root)
    # shuffle=True over shards that do not all fit keeps as many open as fit beside one more
    with S5Sampler(ds, budget=2 * big, shuffle=True, staging_dir=staging_root) as s:
        assert s.window == 1 and sorted(x["__key__"] for x in load_all(ds, s, workers=0)) == [
            f"s{k:05d}" for k in range(12)
        ]
    with S5Sampler(ds, budget=4 * big, shuffle=True, staging_dir=staging_root) as s:
        assert s.window == 3 and len(load_all(ds, s, workers=0)) == 12
    with S5Sampler(ds, budget=big, shuffle=False, staging_dir=staging_root, verify=True) as s:
        assert [x["__key__"] for x in load_all(ds, s, workers=0)] == [f"s{k:05d}" for k in range(12)]
    # keep_staged: the second epoch reads the shards the first one staged, fetching nothing
    with S5Sampler(ds, budget=4 * big, shuffle="block", staging_dir=staging_root, keep_staged=True) as s:
        for epoch in range(2):
            s.set_epoch(epoch)
            assert len(load_all(ds, s)) == 12
            assert s.stats is not None and (s.stats.staged_units, s.stats.calls > 0) == (
                (3, True) if epoch == 0 else (0, False)
            )


def test_staged_shard_bytes_never_exceed_the_budget_and_shards_go_once_read(
    moto: Store, staging_root: str
) -> None:
    from support.stores import Peak

    shards, expected = make_shards(6, 4, size=4000)
    shards["shard-005.tar"] = tar_of([("last.bin", b"x" * 100)])  # uneven sizes
    source = put_indexed(moto, shards)
    ds = S5Dataset.from_shards(source, endpoint_url=moto.endpoint)
    big = max(len(v) for v in shards.values())
    budget = 2 * big + 1000

    with S5Sampler(
        ds, budget=budget, shuffle="block", seed=5, samples_per_call=4, staging_dir=staging_root
    ) as s:

        def staged() -> int:
            total = 0
            for root, _, files in os.walk(s.staging_dir):
                for f in files:  # shards and s5cmd's partial downloads; not the control files
                    if "/.calls" not in root and f not in (".lock", ".released", ".members"):
                        try:
                            total += os.lstat(os.path.join(root, f)).st_size
                        except OSError:
                            pass
            return total

        with Peak(staged, interval=0.001) as peak:
            got = load_all(ds, s)
        assert leftovers(s.staging_dir) == []  # every shard deleted once its samples were read
    assert len(got) == 21 and len({x["__key__"] for x in got}) == 21
    assert peak.looks > 10 and big <= peak.peak <= budget, (peak.peak, budget)


def test_over_shards_the_metrics_count_shards_as_units_and_the_old_name_warns(
    moto: Store, staging_root: str
) -> None:
    shards, expected = make_shards(3, 5)  # 15 samples in 3 shards
    source = put_indexed(moto, shards)
    ds = S5Dataset.from_shards(source, endpoint_url=moto.endpoint)
    with S5Sampler(ds, shuffle=False, budget=400_000, staging_dir=staging_root) as sampler:
        assert len(load_all(ds, sampler)) == 15
        m = sampler.metrics()
        assert (m.position, m.fetched_units) == (15, 3)  # 15 samples read, 3 shards staged
        assert sampler.stats is not None and sampler.stats.staged_units == 3
        with pytest.warns(DeprecationWarning, match="fetched_units"):
            assert m.fetched_samples == 3
        with pytest.warns(DeprecationWarning, match="staged_units"):
            assert sampler.stats.staged_samples == 3
        assert (
            m.as_dict()["fetched_units"] == m.as_dict()["fetched_samples"] == 3
        )  # JSON readers: one release


@pytest.mark.parametrize("shuffle", [True, False, "block"])
def test_two_ranks_fetch_each_shard_once_per_epoch_and_class_sorted_shards_mix_from_the_first_batch(
    shuffle: bool | str, seaweed: Store, staging_root: str
) -> None:
    from support.faults import FaultProxy

    source, shards, big = class_sorted_shards(seaweed)
    proxy = FaultProxy(seaweed.endpoint)
    try:
        ds = S5Dataset.from_shards(source, endpoint_url=proxy.endpoint)
        keys: list[str] = []
        firsts: list[list[int]] = []
        for rank in range(2):
            with S5Sampler(
                ds,
                shuffle=shuffle,
                seed=9,
                num_replicas=2,
                rank=rank,
                budget=4 * big,
                samples_per_call=8,
                staging_dir=staging_root,
            ) as sampler:
                sampler.set_epoch(1)
                got = load_all(ds, sampler)
                assert all(
                    x["bin"] == sample_bytes(int(x["cls"]) * 1000 + int(x["__key__"][-3:]), 2000) for x in got
                )
                keys += [x["__key__"] for x in got]
                firsts.append([int(x["cls"]) for x in got[:8]])
                if shuffle is True:
                    assert sampler.window == 3  # shards open at once: 3 beside the one being staged
                    assert sampler.shuffle_quality(span=64).units_per_span >= 2.5
                assert leftovers(sampler.staging_dir) == []
        gets = shard_gets(proxy.requests)
    finally:
        proxy.close()
    assert sorted(keys) == sorted(f"c{s}-{j:03d}" for s in range(8) for j in range(25))  # each sample once
    assert gets == Counter(list(shards)), gets  # each shard fetched once over both ranks
    if shuffle is True:
        assert all(len(set(first)) >= 2 for first in firsts), firsts  # the first batch mixes classes
    if shuffle is False:
        assert all(len(set(first)) == 1 for first in firsts)  # shard order


def test_a_shard_order_resumes_mid_epoch_exactly_and_stages_nothing_twice(
    seaweed: Store, staging_root: str
) -> None:
    from support.faults import FaultProxy

    source, shards, big = class_sorted_shards(seaweed, n_shards=6, per_shard=10)
    proxy = FaultProxy(seaweed.endpoint)
    try:
        ds = S5Dataset.from_shards(source, endpoint_url=proxy.endpoint)
        opts = {"shuffle": True, "seed": 5, "budget": 3 * big, "staging_dir": staging_root}
        with S5Sampler(ds, **opts) as s:
            s.set_epoch(2)
            whole = [ds[i]["__key__"] for i in s]
        before = sum(shard_gets(proxy.requests).values())
        with S5Sampler(ds, **opts) as s:
            s.set_epoch(2)
            it = iter(s)
            head = [ds[next(it)]["__key__"] for _ in range(23)]
            state = s.state_dict()
        with S5Sampler(ds, **{**opts, "budget": 5 * big}) as s:  # another budget: the saved order goes on
            s.load_state_dict(state)
            assert s.window == 2
            rest = [x["__key__"] for x in load_all(ds, s)]
            assert leftovers(s.staging_dir) == []
    finally:
        proxy.close()
    assert head + rest == whole and len(set(whole)) == 60
    # the resumed run stages the shards the rest needs, each once: the shards of the head that
    # were drained are not fetched again
    drained = {k.split("-")[0] for k in head} - {k.split("-")[0] for k in rest}
    assert sum(shard_gets(proxy.requests).values()) - before <= 6 + 6 - len(drained)


def test_gzip_shards_load_byte_exact_within_a_budget_that_counts_their_tar(
    seaweed: Store, staging_root: str
) -> None:
    from s5loader import S5IterableDataset

    source, shards, expected = gzip_shards(seaweed)
    index = json.loads(
        seaweed.client.get_object(Bucket=seaweed.bucket, Key=seaweed.prefix + "wids.json")["Body"].read()
    )
    tarsize = {e["url"]: e["tarsize"] for e in index["shardlist"]}
    assert set(tarsize) == set(shards) and all(
        tarsize[n] == len(gzip.decompress(d)) for n, d in shards.items()
    )
    disk = max(len(d) + tarsize[n] for n, d in shards.items())
    ds = S5Dataset.from_shards(source, endpoint_url=seaweed.endpoint)
    assert len(ds) == 60 and ds[13] == {
        "__key__": "c1-003",
        **expected["c1-003"],
    }  # the direct read decompresses
    # a budget of 3 staged shards, counted with their tar: the sampler keeps 2 open
    with S5Sampler(ds, shuffle=True, seed=1, budget=3 * disk, staging_dir=staging_root) as sampler:
        assert sampler.window == 2
        peak = [0]

        def watch(x: dict) -> dict:
            peak[0] = max(peak[0], on_disk(sampler.staging_dir))
            return x

        got = [
            watch(x)
            for b in DataLoader(ds, sampler=sampler, batch_size=4, num_workers=2, collate_fn=lambda b: b)
            for x in b
        ]
        assert leftovers(sampler.staging_dir) == []
    assert sorted(x["__key__"] for x in got) == sorted(expected)
    assert all(
        x["bin"] == expected[x["__key__"]]["bin"] and x["cls"] == expected[x["__key__"]]["cls"] for x in got
    )
    assert len({x["cls"] for x in got[:8]}) >= 2  # mixed across the open shards from the first batches
    assert 0 < peak[0] <= 3 * disk
    # the iterable: 2 workers, each stages whole shards of its own
    with S5IterableDataset.from_shards(
        source,
        endpoint_url=seaweed.endpoint,
        shuffle=True,
        budget=4 * disk,
        staging_dir=staging_root,
        num_workers=2,
    ) as it:
        keys = [
            x["__key__"]
            for b in DataLoader(it, batch_size=4, num_workers=2, collate_fn=lambda b: b)
            for x in b
        ]
    assert sorted(keys) == sorted(expected)
    # a budget that holds the compressed shard but not its tar beside it says so at once
    with pytest.raises(BudgetError, match="larger than the budget"):
        S5Sampler(ds, budget=max(map(len, shards.values())) + 10, staging_dir=staging_root)


def test_a_shard_whose_headers_turn_pax_or_gnu_midway_loads_byte_exact(
    moto: Store, staging_root: str
) -> None:
    # plain ustar headers first (read without tarfile), then a pax header (a non-ASCII name)
    # or a GNU long name: tarfile reads from there to the end; offsets are the same either way
    expected: dict[str, dict[str, bytes]] = {}
    shards = {}
    for s, fmt in enumerate((tarfile.PAX_FORMAT, tarfile.GNU_FORMAT)):
        members = []
        for j, stem in enumerate(["a0001", "a0002", "ü0003" if s == 0 else "l" * 120 + "/0003", "a0004"]):
            key = f"s{s}/{stem}"
            fields = {"bin": sample_bytes(s * 100 + j, 700 + 300 * j), "cls": b"%d" % j}
            expected[key] = fields
            members += [(f"{key}.{f}", v) for f, v in fields.items()]
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        shards[f"shard-{s}.tar"] = buf.getvalue()
    ds = S5Dataset.from_shards(put_indexed(moto, shards), endpoint_url=moto.endpoint)
    with S5Sampler(
        ds, shuffle=True, seed=3, budget=10 * max(map(len, shards.values())), staging_dir=staging_root
    ) as sampler:
        got = load_all(ds, sampler)
    assert {x["__key__"]: {k: v for k, v in x.items() if k != "__key__"} for x in got} == expected
    assert len(got) == 8


def test_a_batch_whose_shards_the_budget_cannot_hold_at_once_is_an_error_not_a_stall(
    moto: Store, staging_root: str
) -> None:
    shards, _ = make_shards(8, 5)
    source = put_indexed(moto, shards)
    big = max(map(len, shards.values()))
    ds = S5Dataset.from_shards(source, endpoint_url=moto.endpoint)
    # a batch of 16 samples in key order lies in 4 shards of 5; the budget holds 2 of them
    with S5Sampler(ds, shuffle=False, budget=2 * big, staging_dir=staging_root, stall_timeout=600) as sampler:
        with pytest.raises(
            BudgetError, match=r"batch of 16 samples .* tar shards that take .*lower batch_size"
        ):
            next(iter(DataLoader(ds, sampler=sampler, batch_size=16, collate_fn=lambda b: b)))
        got = [x for b in DataLoader(ds, sampler=sampler, batch_size=4, collate_fn=lambda b: b) for x in b]
    assert len(got) == 40  # a batch of 4 lies in 2 shards at most: it fits
