"""Tar shards in the WebDataset format: the shard index (wids), S5Dataset.from_shards through
S5Sampler and a DataLoader, rank splits, resume, hostile shards and decoding."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections import Counter

import psutil
import pytest
from support.shards import (
    class_sorted_shards,
    leftovers,
    make_shards,
    put_indexed,
    sample_bytes,
    shard_gets,
    tar_of,
)
from support.stores import Store, on_disk
from torch.utils.data import DataLoader

from s5loader import (
    Access,
    BudgetError,
    ConfigError,
    DecodeError,
    EmptySourceError,
    S5Dataset,
    S5Sampler,
    ShardError,
    ShardIndexError,
    UnsafeArchiveError,
)
from s5loader._shards import index as _shards
from s5loader._shards import indexing as _indexing
from s5loader._shards import tar as _tar
from s5loader.decode import decode

# -- helpers ------------------------------------------------------------------------------


def load_all(ds: S5Dataset, sampler: S5Sampler, workers: int = 2) -> list[dict]:
    loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=workers, collate_fn=lambda b: b)
    return [x for b in loader for x in b]


# -- fast tier: no server -----------------------------------------------------------------


def test_brace_patterns_expand_as_webdataset_does() -> None:
    assert _shards.expand_braces("s3://b/shard-{000..002}.tar") == [
        "s3://b/shard-000.tar",
        "s3://b/shard-001.tar",
        "s3://b/shard-002.tar",
    ]
    assert _shards.expand_braces("s3://b/{a,b}-{1..2}.tar") == [
        "s3://b/a-1.tar",
        "s3://b/a-2.tar",
        "s3://b/b-1.tar",
        "s3://b/b-2.tar",
    ]
    with pytest.raises(ConfigError, match="backwards"):
        _shards.expand_braces("s3://b/{3..1}.tar")


def test_the_wids_index_round_trips_with_relative_urls() -> None:
    shards = [_shards.Shard("s3://b/train/shard-0.tar", 100, "e", 3), _shards.Shard("s3://c/x.tar", 5, "", 1)]
    data = _shards.format_index(shards, "s3://b/train/wids.json")
    doc = json.loads(data)
    assert doc["__kind__"] == "wids-shard-index-v1" and doc["wids_version"] == 1
    assert doc["shardlist"][0] == {"url": "shard-0.tar", "nsamples": 3, "filesize": 100}
    assert doc["shardlist"][1]["url"] == "s3://c/x.tar"
    assert _shards.parse_index(data, "s3://b/train/wids.json") == {
        "s3://b/train/shard-0.tar": 3,
        "s3://c/x.tar": 1,
    }
    with pytest.raises(ShardIndexError, match="entry 0"):
        _shards.parse_index(b'{"shardlist": [{"url": "a.tar"}]}', "s3://b/i.json")
    with pytest.raises(ShardIndexError, match="not valid JSON"):
        _shards.parse_index(b"{", "s3://b/i.json")


def test_members_group_into_samples_by_the_first_dot_of_the_file_name() -> None:
    data = tar_of([("d/0001.jpg", b"J"), ("d/0001.seg.PNG", b"P"), ("d/0002.jpg", b"K"), ("README", b"x")])
    samples = _tar.scan_bytes(data, "s3://b/s.tar")
    assert [(s.key, [m.field for m in s.members]) for s in samples] == [
        ("d/0001", ["jpg", "seg.png"]),
        ("d/0002", ["jpg"]),
    ]
    assert _tar.read_sample(io.BytesIO(data), samples[0]) == {"jpg": b"J", "seg.png": b"P"}


@pytest.mark.parametrize(
    ("data", "error", "words"),
    [
        (
            tar_of([("0001.txt", b"a" * 1000), ("0002.txt", b"b")])[:900],
            ShardError,
            "0001.txt",
        ),  # cut in a member
        (tar_of([("0001.txt", b"a"), ("0002.txt", b"b")])[:1100], ShardError, "0001.txt"),  # cut in a header
        (tar_of([("0001.txt", b"a")])[:1024], ShardError, "end-of-archive"),  # no end blocks
        (b"this is not a tar file" * 40, ShardError, "not a tar"),
        (tar_of([("../evil.txt", b"x")]), UnsafeArchiveError, "../evil.txt"),
        (tar_of([("/etc/evil.txt", b"x")]), UnsafeArchiveError, "/etc/evil.txt"),
        (tar_of([("0001.txt", b"a"), ("0001.txt", b"b")]), ShardError, "twice"),
        (gzip.compress(tar_of([("0001.txt", b"a")]), mtime=0), ShardError, "gzip compressed"),
    ],
)
def test_hostile_tars_are_refused_naming_the_shard_and_member(data: bytes, error: type, words: str) -> None:
    with pytest.raises(error, match="s3://b/bad.tar") as info:
        _tar.scan_bytes(data, "s3://b/bad.tar")
    assert words in str(info.value)
    with pytest.raises(error):  # the streamed scan of index-shards sees the same
        _tar.scan(io.BytesIO(data), len(data), "s3://b/bad.tar", stream=True)


def test_end_padding_of_any_length_passes_and_anything_after_it_does_not() -> None:
    # ``tar -b 2048`` pads to 1 MiB records: the streamed scan of index-shards must accept
    # the zeros that follow its read-ahead as the file scan does
    data = tar_of([("0001.txt", b"a"), ("0002.txt", b"b")]) + bytes(300_000)
    for stream in (False, True):
        assert len(_tar.scan(io.BytesIO(data), len(data), "s3://b/s.tar", stream=stream)) == 2
        bad = data + b"x"
        with pytest.raises(
            ShardError, match="s3://b/s.tar: a truncated or damaged tar after member '0002.txt'"
        ):
            _tar.scan(io.BytesIO(bad), len(bad), "s3://b/s.tar", stream=stream)


def test_index_urls_resolve_as_wids_does_and_never_leave_the_bucket() -> None:
    where = "s3://b/train/wids.json"

    def parse(doc: dict) -> dict[str, int]:
        return _shards.parse_index(json.dumps({"wids_version": 1, **doc}).encode(), where)

    def urls(*names: str) -> dict:
        return {"shardlist": [{"url": u, "nsamples": 1} for u in names]}

    assert parse(urls("./a.tar", "./.b.tar", "sub/../c.tar", "../val/d.tar")) == {
        "s3://b/train/a.tar": 1,
        "s3://b/train/.b.tar": 1,
        "s3://b/train/c.tar": 1,
        "s3://b/val/d.tar": 1,
    }
    # widsindex writes a "base" (update --rebase: an absolute URL; --base: anything)
    assert parse({"base": "s3://other/x", **urls("a.tar")}) == {"s3://other/x/a.tar": 1}
    assert parse({"base": "../data/", **urls("a.tar")}) == {"s3://b/data/a.tar": 1}
    assert parse({"base": "file:///mnt/copy", **urls("a.tar")}) == {"s3://b/train/a.tar": 1}
    for bad, words in [
        ("../../a.tar", "leads outside the bucket s3://b/"),
        ("x/../../../a.tar", "leads outside the bucket"),
        ("/etc/a.tar", "absolute path"),
        ("s3://c/x/../a.tar", "'..' component"),
    ]:
        with pytest.raises(ShardIndexError, match=f"{where}: entry 0 .*{words}"):
            parse(urls(bad))
    with pytest.raises(ShardIndexError, match="base .*leads outside the bucket"):
        parse({"base": "../../..", **urls("a.tar")})


def test_a_sparse_member_is_refused(tmp_path) -> None:
    # GNU tar stores a sparse file's data in pieces: reading it by offset would return garbage
    f = tmp_path / "0001.bin"
    with open(f, "wb") as fh:
        fh.truncate(100_000)
        fh.seek(100_000)
        fh.write(b"end")
    subprocess.run(["tar", "--sparse", "-cf", str(tmp_path / "s.tar"), "0001.bin"], cwd=tmp_path, check=True)
    with pytest.raises(ShardError, match=r"s3://b/s.tar: member '0001.bin' is a GNU sparse file"):
        _tar.scan_file(str(tmp_path / "s.tar"), "s3://b/s.tar")


def test_decode_by_extension_never_unpickles() -> None:
    import pickle

    import numpy as np
    import torch

    npy = io.BytesIO()
    np.save(npy, np.arange(3))
    pth = io.BytesIO()
    torch.save({"w": torch.ones(2)}, pth)
    png = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (3, 2)).save(png, format="PNG")
    evil = pickle.dumps(print)
    out = decode(
        {
            "__key__": "k",
            "cls": b"7",
            "txt": b"hi",
            "json": b'{"a": 1}',
            "npy": npy.getvalue(),
            "pth": pth.getvalue(),
            "seg.png": png.getvalue(),
            "pickle": evil,
            "pyd": evil,
            "bin": b"\x00",
            "index": b"x1",
        }
    )
    assert out["cls"] == 7 and out["txt"] == "hi" and out["json"] == {"a": 1} and out["index"] == "x1"
    assert out["npy"].tolist() == [0, 1, 2] and out["pth"]["w"].tolist() == [1.0, 1.0]
    assert out["seg.png"].size == (3, 2)
    assert out["pickle"] == evil and out["pyd"] == evil and out["bin"] == b"\x00" and out["__key__"] == "k"


class _FakeShards:
    """What ShardPass needs of a dataset of shards: shard sizes and sample -> (shard, j)."""

    def __init__(self, counts: list[int], sizes: list[int]) -> None:
        from s5loader._shards.dataset import ShardSet

        shards = [_shards.Shard(f"s3://b/{i}.tar", sizes[i], "", n) for i, n in enumerate(counts)]
        self.shards = ShardSet(shards, Access(), "s3://b/")
        self.source = "s3://b/"


def test_a_pass_stages_each_shard_once_per_run_of_its_samples_and_knows_its_peak() -> None:
    from s5loader._shards.passes import ShardPass

    ds = _FakeShards([3, 2, 2], [100, 10, 1])
    # padding repeats samples 0 and 1 at the end: shard 0 is staged again for them
    p = ShardPass(ds, [0, 3, 1, 2, 4, 5, 6, 0, 1], "/nowhere", False, "raise")  # type: ignore[arg-type]
    assert p.engine_order == [0, 1, 2, 0]
    assert p.needed == [[0, 1, 2], [0, 1], [0, 1], [0, 1]]
    assert p.visit_of == [0, 1, 0, 0, 1, 2, 2, 3, 3]
    assert p.peak_bytes() == (110, 1)  # shards 0 and 1 are open together
    p.check_budget(110, "block")
    with pytest.raises(BudgetError, match="lower samples_per_call"):
        p.check_budget(109, "block")
    with pytest.raises(BudgetError, match="open as the budget held"):
        p.check_budget(109, True)


def test_the_first_call_stages_the_shards_of_the_first_samples_together(tmp_path) -> None:
    from s5loader._shards.passes import ShardPass
    from s5loader.config import StagingOptions
    from s5loader.engine import Stager
    from s5loader.s5cmd import S5cmd
    from s5loader.staging.area import StagingArea

    ds = _FakeShards([4] * 6, [100] * 6)
    # a shuffled order: the first samples lie in shards 0, 2, 5 and 1; shard 0 is read while
    # it downloads, so the engine's first call takes the other three, side by side
    order = [0, 8, 20, 4, 1, 9, 21, 5, 2, 10, 22, 6, 3, 11, 23, 7, *range(12, 20)]
    p = ShardPass(ds, order, "/nowhere", False, "raise")  # type: ignore[arg-type]
    assert p.streamed == 0 and p.engine_order[:4] == [0, 2, 5, 1] and p.first_call == 4
    area = StagingArea(str(tmp_path))
    area.create()
    try:  # the engine skips the streamed shard inside the call's span and stages the other three
        stager = Stager(
            ds.shards,
            p.engine_order,
            area,
            S5cmd(),
            StagingOptions(budget=10_000),
            kept=p.engine_kept(None),
            first_call=p.first_call,
        )
        started: list[list[int]] = []
        stager._start_call = started.append  # type: ignore[method-assign]
        stager._schedule()
        assert [[p.engine_order[pos] for pos in call] for call in started][:1] == [[2, 5, 1]]
    finally:
        area.remove()
    big = _FakeShards([20] * 3, [100] * 3)
    seq = ShardPass(big, list(range(60)), "/nowhere", False, "raise")  # type: ignore[arg-type]
    assert seq.first_call == 1  # in shard order the first samples need the streamed shard alone


# -- real path: s5cmd against local S3 servers --------------------------------------------


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


def test_bad_shards_raise_naming_them_or_are_skipped(moto: Store, staging_root: str) -> None:
    shards, expected = make_shards(2, 3)
    good = dict(shards)
    shards["shard-002.tar"] = tar_of([("../../escape.txt", b"x")])
    shards["shard-003.tar"] = shards["shard-000.tar"][:1500]  # truncated
    shards["shard-004.tar"] = b"not a tar" * 200
    source = put_indexed_with(moto, shards, {"shard-002.tar": 1, "shard-003.tar": 3, "shard-004.tar": 2})
    ds = S5Dataset.from_shards(source, endpoint_url=moto.endpoint)
    with S5Sampler(ds, shuffle=False, budget=100_000, staging_dir=staging_root) as s:
        with pytest.raises((ShardError, UnsafeArchiveError), match="shard-002.tar.*escape.txt"):
            load_all(ds, s, workers=0)
    with S5Sampler(ds, shuffle=False, budget=100_000, staging_dir=staging_root, on_error="skip") as s:
        got = load_all(ds, s)
        assert sorted(x["__key__"] for x in got) == sorted(expected)
        assert s.stats is not None and sorted(s.stats.skipped) == sorted(
            moto.uri(n) for n in shards if n not in good
        )
        assert leftovers(s.staging_dir) == []
    assert not os.path.exists(os.path.join(staging_root, "..", "escape.txt"))
    # a shard gone after the listing (404) is skipped too, with its URI
    ds = S5Dataset.from_shards(source, endpoint_url=moto.endpoint)
    moto.client.delete_object(Bucket=moto.bucket, Key=moto.prefix + "shard-001.tar")
    with S5Sampler(
        ds, shuffle=False, budget=100_000, staging_dir=staging_root, on_error="skip", retries=0
    ) as s:
        got = load_all(ds, s, workers=0)
        assert sorted(x["__key__"] for x in got) == sorted(expected)[:3]
        assert moto.uri("shard-001.tar") in s.stats.skipped  # type: ignore[union-attr]
    # an index that disagrees with its shard
    moto.put(
        {
            "wids.json": _shards.format_index(
                [_shards.Shard(moto.uri("shard-000.tar"), len(good["shard-000.tar"]), "", 4)],
                moto.uri("wids.json"),
            )
        }
    )
    ds = S5Dataset.from_shards([moto.uri("shard-000.tar")], endpoint_url=moto.endpoint)
    with S5Sampler(ds, shuffle=False, budget=100_000, staging_dir=staging_root) as s:
        with pytest.raises(ShardError, match=r"shard-000.tar holds 3 samples.*says 4"):
            load_all(ds, s, workers=0)
    with pytest.raises(ShardError, match="shard-000.tar holds 3"):
        ds[0]  # the direct read (no sampler) checks the same


def test_an_index_that_widsindex_writes_loads(moto: Store) -> None:
    shards, expected = make_shards(2, 3)
    shards["shard-001.tar"] += bytes(200_000)  # end padding past the streamed scan's tail
    source = put_indexed(moto, shards)
    # an index as webdataset's widsindex writes it (update --rebase: a "base", md5sums), kept
    # in another folder than its shards
    listed = [
        {"url": f"./{n}", "md5sum": hashlib.md5(d).hexdigest(), "nsamples": 3, "filesize": len(d)}
        for n, d in shards.items()
    ]
    doc = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "shardlist": listed,
        "name": "t",
        "base": source,
    }
    moto.put({"meta/train.json": json.dumps(doc).encode()})
    ds = S5Dataset.from_shards(source, index=moto.uri("meta/train.json"), endpoint_url=moto.endpoint)
    assert len(ds) == 6 and ds[4]["bin"] == expected["s00004"]["bin"]
    # shards compressed other than with gzip are not read, and a prefix of only those says so
    moto.put({"zst/shard-000.tar.zst": b"(\xb5/\xfd" + bytes(20)})
    with pytest.raises(
        EmptySourceError, match=r"only other compressed ones such as s3://.*/zst/shard-000.tar.zst"
    ):
        S5Dataset.from_shards(moto.uri("zst/"), endpoint_url=moto.endpoint)


def test_wids_reads_the_index_that_index_shards_writes(moto: Store, tmp_path) -> None:
    # wids is webdataset 0.2's indexed reader (webdataset 1.0 no longer ships it)
    wids = pytest.importorskip("wids")
    shards, expected = make_shards(2, 3)
    put_indexed(moto, shards)
    # with the shards beside the index, as they are in the bucket
    for name in ["wids.json", *shards]:
        (tmp_path / name).write_bytes(
            moto.client.get_object(Bucket=moto.bucket, Key=moto.prefix + name)["Body"].read()
        )
    wds = wids.ShardListDataset(str(tmp_path / "wids.json"), cache_dir=str(tmp_path / "cache"))
    assert len(wds) == 6
    got = {wds[i]["__key__"]: wds[i][".bin"].read() for i in range(6)}
    assert got == {k: v["bin"] for k, v in expected.items()}


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


def test_a_source_that_names_no_shard_says_what_exists_near_it(moto: Store) -> None:
    from s5loader import NoSuchBucketError, ObjectNotFoundError

    shards, _ = make_shards(3, 2)
    put_indexed(moto, shards)  # train/shard-000.tar ... beside the folder train/shard/ that does not exist
    moto.put({"jpegs/0001.jpg": b"j", "jpegs/0001.cls": b"1"})
    # a prefix without its slash, and with it: the folder is empty, its neighbours are named
    for given in (moto.uri("shard"), moto.uri("shard/")):
        with pytest.raises(EmptySourceError) as empty:
            S5Dataset.from_shards(given, endpoint_url=moto.endpoint)
        message = str(empty.value)
        assert f"no object under {moto.uri('shard/')}" in message
        assert (
            f"such as {moto.uri('shard-000.tar')}" in message
            and f"name the folder they are in ({moto.uri()})" in message
        )
    assert "a prefix names a folder" in str(
        pytest.raises(
            EmptySourceError, S5Dataset.from_shards, moto.uri("shard"), endpoint_url=moto.endpoint
        ).value
    )
    # a folder of objects that are not shards says what it holds
    with pytest.raises(
        EmptySourceError, match=r"it holds 2 other object\(s\), such as s3://\S+/jpegs/0001\.cls"
    ):
        S5Dataset.from_shards(moto.uri("jpegs/"), endpoint_url=moto.endpoint)
    # a brace pattern that matches nothing names the shards nearest to it by name
    with pytest.raises(ObjectNotFoundError) as braces:
        S5Dataset.from_shards(moto.uri("shard-{0000..0002}.tar"), endpoint_url=moto.endpoint)
    assert "3 of the 3 shards" in str(braces.value)
    assert f"nearest to it by name: {moto.uri('shard-000.tar')}" in str(braces.value)
    # a list, and one shard: the same, and an empty folder or a missing bucket is said
    with pytest.raises(
        ObjectNotFoundError, match=r"shard-003.tar: no such shard; the keys nearest to it by name: "
    ):
        S5Dataset.from_shards(
            [moto.uri("shard-000.tar"), moto.uri("shard-003.tar")], endpoint_url=moto.endpoint
        )
    with pytest.raises(ObjectNotFoundError, match=r"nothing exists under s3://\S+/train/none/$"):
        S5Dataset.from_shards(moto.uri("none/shard-000.tar"), endpoint_url=moto.endpoint)
    with pytest.raises(NoSuchBucketError, match=r"has no bucket 'no-such-bucket'"):
        S5Dataset.from_shards("s3://no-such-bucket/train/shard-000.tar", endpoint_url=moto.endpoint)


def put_indexed_with(store: Store, shards: dict[str, bytes], counts: dict[str, int]) -> str:
    """Upload shards (some unreadable) with an index that gives ``counts`` for the bad ones."""
    store.put(shards)
    listed = []
    for name, data in shards.items():
        n = counts.get(name)
        if n is None:
            n = len(_tar.scan_bytes(data, name))
        listed.append(_shards.Shard(store.uri(name), len(data), "", n))
    store.put({"wids.json": _shards.format_index(listed, store.uri("wids.json"))})
    return store.uri()


def test_decode_and_the_direct_read_without_a_sampler(moto: Store) -> None:
    from s5loader import ObjectNotFoundError

    shards, expected = make_shards(2, 3)
    source = put_indexed(moto, shards)
    with pytest.raises(ObjectNotFoundError, match=r"shard-002.tar: no such shard \(1 of the 3"):
        S5Dataset.from_shards(moto.uri("shard-{000..002}.tar"), endpoint_url=moto.endpoint)
    ds = S5Dataset.from_shards(source, endpoint_url=moto.endpoint, decode=True)
    assert [ds[i]["cls"] for i in range(6)] == [k % 7 for k in range(6)]
    assert ds[4]["bin"] == expected["s00004"]["bin"]
    assert Counter(type(ds[i]["__key__"]) for i in range(6)) == Counter({str: 6})
    # decode= on raw objects too: the index object's "json" field is parsed, the shards stay bytes
    raw = S5Dataset.from_prefix(source, endpoint_url=moto.endpoint, decode=True)
    by_key = {raw.samples[i].key: raw[i] for i in range(len(raw))}
    assert by_key["train/wids"]["json"]["__kind__"] == "wids-shard-index-v1"
    assert by_key["train/shard-000"]["tar"] == shards["shard-000.tar"]
    # a field that is not what its extension says names the field, the key and its URI
    moto.put({"bad/shard-000.tar": tar_of([("x.json", b"{nope")]), "rawbad/y.json": b"{nope"})
    _indexing.build_index(moto.uri("bad/"), moto.endpoint)
    with pytest.raises(
        DecodeError, match=r"s3://\S+/bad/shard-000.tar: field 'json' of sample 'x' cannot be decoded"
    ):
        S5Dataset.from_shards(moto.uri("bad/"), endpoint_url=moto.endpoint, decode=True)[0]
    with pytest.raises(DecodeError, match=r"s3://\S+/rawbad/y.json: field 'json' of sample '\S*y'"):
        S5Dataset.from_prefix(moto.uri("rawbad/"), endpoint_url=moto.endpoint, decode=True)[0]


# -- the daemon ---------------------------------------------------------------------------------

CONSUMER = """
import hashlib, json, sys
from s5loader.consume import consume
with open(sys.argv[2], "a") as out:
    for s in consume(sys.argv[1], timeout=60):
        files = {k: hashlib.sha256(open(p, "rb").read()).hexdigest() for k, p in s.files.items()}
        out.write(json.dumps({"name": s.name, "files": files}) + "\\n")
        out.flush()
"""


def test_the_daemon_delivers_shard_samples_as_folders_within_budget(
    seaweed: Store, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from support.stores import Peak

    from s5loader._sampling.order import Order
    from s5loader._sampling.units import units_of
    from s5loader._util.platform import punches_holes
    from s5loader.consume import END_MARKER, ready_names
    from s5loader.daemon import sample_folder_name

    shards, expected = make_shards(4, 5, size=2000)
    source = put_indexed(seaweed, shards)
    big = max(len(v) for v in shards.values())
    budget = 2 * big + 3000
    cache, out = tmp_path / "cache", tmp_path / "got.jsonl"
    env = dict(os.environ)
    consumer = subprocess.Popen([sys.executable, "-c", CONSUMER, str(cache), str(out)], env=env)

    def cache_bytes() -> int:
        # bytes of samples: a staged shard's less what was punched out of it (the blocks it takes,
        # at most its size), a delivered file's size
        seen = {}
        for root, _, files in os.walk(cache):
            for f in files:
                if f not in (".lock", ".state.json", ".released") and "/.calls" not in root:
                    try:
                        st = os.lstat(os.path.join(root, f))
                    except OSError:
                        continue
                    staged = "/.staging/" in root + "/" and f == "tar"
                    seen[st.st_ino] = min(st.st_size, st.st_blocks * 512) if staged else st.st_size
        return sum(seen.values())

    with Peak(cache_bytes, interval=0.002) as peak:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "s5loader",
                "prefetch",
                "--shards",
                source,
                "--cache",
                str(cache),
                "--budget",
                str(budget),
                "--endpoint-url",
                seaweed.endpoint,
                "--shuffle",
                "--seed",
                "3",
                "--epochs",
                "2",
                "--samples-per-call",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert r.returncode == 0, r.stderr
        assert consumer.wait(60) == 0
    # the shared shard order (as many shards open as the daemon's state says, counting what the
    # samples written out of a shard give back where the file system punches them out), every epoch
    ds = S5Dataset.from_shards(source, endpoint_url=seaweed.endpoint)
    window = json.loads((cache / ".state.json").read_text())["window"]
    units = units_of(ds)
    cost = units.order_cost() if punches_holes(str(tmp_path)) else None
    want = []
    for epoch in range(2):
        for i in units.plan(Order(True, 3, 1, 0, False), epoch, 0, None, window, cost)[0]:
            want.append(sample_folder_name(len(want), ds[i]["__key__"]))
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["name"] for g in got] == want
    epoch_keys = [sorted(n.split("-", 1)[1] for n in want[e * 20 : (e + 1) * 20]) for e in range(2)]
    assert epoch_keys[0] == epoch_keys[1] == sorted(expected)  # each sample once an epoch
    for g in got:
        key = g["name"].split("-", 1)[1]
        assert g["files"] == {f: hashlib.sha256(v).hexdigest() for f, v in expected[key].items()}
    assert peak.peak <= budget, (peak.peak, budget)
    assert ready_names(str(cache)) == [] and (cache / END_MARKER).exists()
    # a budget that cannot hold a shard and its unpacked samples (on a file system that cannot
    # punch them out of it) is refused before any download
    from s5loader.daemon import PrefetchDaemon, PrefetchOptions, stream

    opts = PrefetchOptions.of(
        source, str(tmp_path / "c2"), big + 10, endpoint_url=seaweed.endpoint, shards=True
    )
    with monkeypatch.context() as m:
        m.setattr(stream, "punches_holes", lambda folder, most: False)
        with (
            PrefetchDaemon(opts) as p,
            pytest.raises(BudgetError, match=r"shard s3://.*shard-00\d.tar.*twice the largest shard"),
        ):
            p.open()
    assert not list((tmp_path / "c2" / ".staging").glob("*/tar"))


def test_a_shard_daemon_cut_mid_shard_continues_without_loss_or_repeat(moto: Store, tmp_path) -> None:
    import threading

    from s5loader.consume import consume
    from s5loader.daemon import PrefetchDaemon, PrefetchOptions, sample_folder_name

    shards, expected = make_shards(3, 5, size=1000)
    source = put_indexed(moto, shards)
    big = max(len(v) for v in shards.values())
    cache = tmp_path / "cache"
    opts = PrefetchOptions.of(
        source, str(cache), 2 * big + 2000, endpoint_url=moto.endpoint, shards=True, samples_per_call=1
    )

    class Cut(Exception):
        pass

    class CutAtSeven(PrefetchDaemon):
        def _deliver(self, seq: int, staged) -> None:  # type: ignore[no-untyped-def]
            if seq == 7:  # the third sample of the second shard: the process dies here
                raise Cut()
            super()._deliver(seq, staged)

    got: list[tuple[str, dict[str, bytes]]] = []

    def consumer() -> None:
        for s in consume(str(cache), timeout=60):
            got.append((s.name, {f: s.read(f) for f in s.files}))

    reader = threading.Thread(target=consumer)
    reader.start()
    with CutAtSeven(opts) as first, pytest.raises(Cut):
        first.open()
        first.run()
    with PrefetchDaemon(opts) as second:
        second.open()
        assert second.summary.resumed_from == 7
        assert second.run().delivered == 8
    reader.join(60)
    keys = sorted(expected)
    assert [name for name, _ in got] == [sample_folder_name(i, k) for i, k in enumerate(keys)]
    for name, files in got:
        assert files == expected[name.split("-", 1)[1]]


def test_a_member_name_that_is_not_utf8_keeps_its_bytes_through_the_daemon(moto: Store, tmp_path) -> None:
    # an old tar's Latin-1 name: tarfile gives it as surrogates, which UTF-8 cannot encode
    from s5loader.consume import consume
    from s5loader.daemon import PrefetchDaemon, PrefetchOptions

    name = b"caf\xe9".decode("utf-8", "surrogateescape")
    data = tar_of([(f"{name}.cls", b"1"), (f"{name}.txt", b"t"), ("plain.cls", b"2")])
    source = put_indexed(moto, {"shard-000.tar": data})
    opts = PrefetchOptions.of(
        source, str(tmp_path / "cache"), 4 * len(data), endpoint_url=moto.endpoint, shards=True
    )
    with PrefetchDaemon(opts) as daemon:
        daemon.open()
        assert daemon.run().delivered == 2
    got, raw = [], []
    for s in consume(str(tmp_path / "cache"), timeout=60):
        got.append((s.key, {f: s.read(f) for f in s.files}))
        with open(os.path.join(s.path, "__key__"), "rb") as fh:
            raw.append(fh.read())
    assert got == [(name, {"cls": b"1", "txt": b"t"}), ("plain", {"cls": b"2"})]
    assert raw == [b"caf\xe9", b"plain"]


@pytest.mark.parametrize("shuffle", [False, "block"])
def test_iterable_workers_split_shards_not_samples_so_each_shard_is_fetched_once(
    shuffle: bool | str, moto: Store, staging_root: str
) -> None:
    from support.faults import FaultProxy

    from s5loader import S5IterableDataset

    shards, expected = make_shards(4, 5)
    source = put_indexed(moto, shards)
    proxy = FaultProxy(moto.endpoint)
    try:
        # "block": a worker's share holds a window of all four shards; each worker still
        # windows only its own run of them
        budget = 80_000 if shuffle is False else 400_000
        with S5IterableDataset.from_shards(
            source, endpoint_url=proxy.endpoint, shuffle=shuffle, budget=budget, staging_dir=staging_root
        ) as it:
            got = [
                x["__key__"]
                for b in DataLoader(it, batch_size=4, num_workers=2, collate_fn=lambda b: b)
                for x in b
            ]
        gets = Counter(
            path.split("?")[0].rsplit("/", 1)[-1]
            for method, path, _ in proxy.requests
            if method == "GET" and ".tar" in path
        )
    finally:
        proxy.close()
    assert sorted(got) == sorted(expected)
    # worker 0 takes the first half of the epoch (shards 0 and 1), worker 1 the second half
    assert gets == Counter(list(shards)), gets


@pytest.mark.parametrize("shuffle", [True, "block"])
def test_the_first_shard_is_read_from_its_front_while_it_downloads(
    shuffle: bool | str, moto: Store, staging_root: str
) -> None:
    from s5loader import S5IterableDataset

    shards, expected = make_shards(3, 100)
    source = put_indexed(moto, shards)
    with S5IterableDataset.from_shards(
        source,
        endpoint_url=moto.endpoint,
        shuffle=shuffle,
        seed=1,
        budget=2_000_000,
        staging_dir=staging_root,
    ) as it:
        got = [
            x["__key__"]
            for b in DataLoader(it, batch_size=4, num_workers=0, collate_fn=lambda b: b)
            for x in b
        ]
        assert leftovers(it._area.path) == []
    assert sorted(got) == sorted(expected)  # each sample once
    number = [int(k[1:]) for k in got]
    shard = number[0] // 100
    mine = [i % 100 for i in number if i // 100 == shard]
    # the shard streamed first comes in its own order by windows of 32, then 64 samples, each shuffled
    assert sorted(mine[:32]) == list(range(32)) and sorted(mine[32:96]) == list(range(32, 96))
    assert mine[:32] != list(range(32))


@pytest.mark.parametrize("shuffle", [False, True])
def test_iterable_dataset_over_shards_resumes_mid_epoch_exactly(
    shuffle: bool, moto: Store, staging_root: str
) -> None:
    # with the shuffle buffer; "block" resumes through the same path (test_iterable); True is a
    # shard order over shards that do not all fit (six shards' worth for two workers)
    from torchdata.stateful_dataloader import StatefulDataLoader

    from s5loader import S5IterableDataset

    shards, expected = make_shards(3, 5)
    shards["shard-003.tar"] = tar_of([("odd.bin", b"o")])  # uneven shard sizes
    source = put_indexed(moto, shards)

    def run(state: dict | None, stop: int | None) -> tuple[list[str], dict]:
        budget = 6 * max(map(len, shards.values())) if shuffle else 200_000  # a worker: two open, one staging
        with S5IterableDataset.from_shards(
            source,
            endpoint_url=moto.endpoint,
            shuffle=shuffle,
            seed=4,
            shuffle_buffer=3,
            budget=budget,
            staging_dir=staging_root,
        ) as it:
            it.set_epoch(1)
            ld = StatefulDataLoader(it, batch_size=2, num_workers=2, collate_fn=lambda b: b)
            if state is not None:
                ld.load_state_dict(state)
            got: list[str] = []
            for i, batch in enumerate(ld):
                got += [x["__key__"] for x in batch]
                if stop is not None and i + 1 == stop:
                    return got, ld.state_dict()
            return got, ld.state_dict()

    whole, _ = run(None, None)
    head, state = run(None, 3)
    rest, _ = run(state, None)
    assert sorted(whole) == sorted([*expected, "odd"])
    assert head + rest == whole  # the same samples, in the same order, none twice


def test_iterable_dataset_over_shards_every_sample_once_per_rank_split(
    moto: Store, staging_root: str
) -> None:
    from s5loader import S5IterableDataset

    shards, expected = make_shards(6, 5)
    source = put_indexed(moto, shards)
    keys: list[str] = []
    for rank in range(2):
        with S5IterableDataset.from_shards(
            source,
            endpoint_url=moto.endpoint,
            shuffle="block",
            seed=2,
            budget=80_000,
            num_replicas=2,
            rank=rank,
            staging_dir=staging_root,
        ) as it:
            loader = DataLoader(it, batch_size=4, num_workers=2, collate_fn=lambda b: b)
            got = [x for b in loader for x in b]
            assert all(x["bin"] == expected[x["__key__"]]["bin"] for x in got)
            keys += [x["__key__"] for x in got]
            assert leftovers(it._area.path) == []
    assert len(keys) == 30 and set(keys) == set(expected)  # 30 samples over 2 ranks: each once


def test_iterable_shuffle_buffer_too_big_for_the_budget_names_the_buffer_and_a_budget(
    moto: Store, staging_root: str
) -> None:
    # a buffer of 60 samples keeps samples of more shards staged than a budget of three holds
    from s5loader import S5IterableDataset

    shards, _ = make_shards(12, 10)
    source = put_indexed(moto, shards)
    big = max(map(len, shards.values()))
    opts = {
        "endpoint_url": moto.endpoint,
        "shuffle": True,
        "shuffle_buffer": 60,
        "budget": 3 * big,
        "staging_dir": staging_root,
    }
    # refused in this process when made, before any worker starts
    with pytest.raises(
        BudgetError, match=r"shuffle_buffer=60 over the tar shards .* budget of .* Give shuffle_buffer="
    ):
        S5IterableDataset.from_shards(source, **opts)
    assert os.listdir(staging_root) == []


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


def test_iterable_shuffle_over_shards_that_do_not_fit_mixes_and_fetches_each_shard_once(
    seaweed: Store, staging_root: str
) -> None:
    from support.faults import FaultProxy

    from s5loader import S5IterableDataset

    source, shards, big = class_sorted_shards(seaweed)
    proxy = FaultProxy(seaweed.endpoint)
    try:
        # two workers share the budget: each keeps 2 shards open beside one being staged
        with S5IterableDataset.from_shards(
            source,
            endpoint_url=proxy.endpoint,
            shuffle=True,
            seed=3,
            budget=8 * big,
            staging_dir=staging_root,
        ) as it:
            loader = DataLoader(it, batch_size=8, num_workers=2, collate_fn=lambda b: b)
            batches = [[int(x["cls"]) for x in b] for b in loader]
            assert leftovers(it._area.path) == []
        gets = shard_gets(proxy.requests)
    finally:
        proxy.close()
    assert sorted(c for b in batches for c in b) == sorted(s for s in range(8) for _ in range(25))
    assert len(set(batches[0])) >= 2 and len(set(batches[1])) >= 2, batches[
        :2
    ]  # each worker's first batch mixes
    assert gets == Counter(list(shards)), gets


def test_an_iterable_frees_each_sample_it_reads_so_more_shards_mix_within_the_budget(
    seaweed: Store, staging_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from support.stores import Peak

    from s5loader import S5IterableDataset
    from s5loader._sampling import units

    source, shards, big = class_sorted_shards(seaweed, n_shards=12, per_shard=20, size=100_000)
    budget = 4 * big  # read in this process: 3 shards open beside one being staged, when nothing is freed

    def run() -> tuple[list[int], int]:
        with S5IterableDataset.from_shards(
            source,
            endpoint_url=seaweed.endpoint,
            shuffle=True,
            seed=2,
            budget=budget,
            staging_dir=staging_root,
        ) as it:

            def allocated() -> int:  # the blocks staged shards take on disk (punched ones do not)
                total = 0
                for root, _, files in os.walk(it._area.path):
                    for f in files:  # shards and s5cmd's partial downloads; not the control files
                        if "/.calls" not in root and not f.startswith("."):
                            with contextlib.suppress(OSError):
                                total += os.lstat(os.path.join(root, f)).st_blocks * 512
                return total

            with Peak(allocated, interval=0.001) as peak:
                got = [int(x["cls"]) for x in it]
            assert leftovers(it._area.path) == []
        return got, peak.peak

    def most_open(stream: list[int]) -> int:
        last = {c: pos for pos, c in enumerate(stream)}
        open_now: set[int] = set()
        most = 0
        for pos, c in enumerate(stream):
            open_now.add(c)
            most = max(most, len(open_now))
            if last[c] == pos:
                open_now.discard(c)
        return most

    with monkeypatch.context() as m:
        m.setattr(units, "punches_holes", lambda folder, most: False)  # a file system that cannot
        whole, peak_whole = run()
    freeing, peak = run()
    everything = sorted(s for s in range(12) for _ in range(20))
    assert sorted(freeing) == sorted(whole) == everything
    assert most_open(whole) == 3 < most_open(freeing), (most_open(whole), most_open(freeing))
    slack = 4 * 4096  # the budget counts bytes; a file takes whole blocks (four shards staged)
    assert big < peak <= budget + slack and big < peak_whole <= budget + slack, (peak, peak_whole, budget)


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


def test_the_iterable_checks_its_budget_and_worker_count_in_the_main_process(
    seaweed: Store, staging_root: str
) -> None:
    from s5loader import S5IterableDataset

    source, _, big = class_sorted_shards(seaweed, n_shards=4, per_shard=5)
    # a budget that cannot hold the largest shard: an error now, before any worker starts
    with pytest.raises(BudgetError) as e:
        S5IterableDataset.from_shards(
            source, endpoint_url=seaweed.endpoint, budget=big // 2, staging_dir=staging_root, num_workers=2
        )
    assert source in str(e.value) and "budget" in str(e.value), str(e.value)
    assert os.listdir(staging_root) == []  # nothing was made
    # the rank's whole budget serves all its workers: one and a half shards do for 2 workers
    with S5IterableDataset.from_shards(
        source,
        endpoint_url=seaweed.endpoint,
        budget=3 * big // 2,
        staging_dir=staging_root,
        num_workers=2,
        shuffle=False,
    ) as it:
        with pytest.raises(ConfigError, match="num_workers=2, but its DataLoader runs 1 worker"):
            next(iter(DataLoader(it, batch_size=2, num_workers=1)))
        got = [x for b in DataLoader(it, batch_size=2, num_workers=2, collate_fn=lambda b: b) for x in b]
        assert len(got) == 20
    with pytest.raises(ConfigError, match="num_workers must be None"):
        S5IterableDataset.from_shards(source, endpoint_url=seaweed.endpoint, num_workers=-1)


def _size(n: int) -> str:
    from s5loader._util.uri import format_size

    return format_size(n)


ITERABLE_SCRIPT = """
import os, signal, sys, time
from torch.utils.data import DataLoader
from s5loader import S5IterableDataset

def transform(sample):
    if {bad_key!r} and sample["__key__"] == {bad_key!r}:
        raise ValueError("a bad sample")
    return sample

it = S5IterableDataset.from_shards({source!r}, endpoint_url={endpoint!r}, budget={budget}, shuffle=True,
                                   staging_dir={root!r}, transform=transform, samples_per_call=2)
print(it._area.path, flush=True)
for i, b in enumerate(DataLoader(it, batch_size=2, num_workers=2, collate_fn=lambda b: b)):
    if i == 3:
        {action}
    time.sleep(0.05)
"""


@pytest.mark.parametrize("how", ["worker-error", "keyboardinterrupt", "sigkill"])
def test_the_iterable_leaves_no_staging_folder_after_an_error_and_the_next_start_removes_a_killed_ones(
    how: str, seaweed: Store, staging_root: str, tmp_path
) -> None:

    from s5loader import S5IterableDataset

    source, _, big = class_sorted_shards(seaweed, n_shards=4, per_shard=10)
    script = tmp_path / "train.py"
    script.write_text(
        ITERABLE_SCRIPT.format(
            source=source,
            endpoint=seaweed.endpoint,
            root=staging_root,
            budget=4 * big,
            bad_key="c2-004" if how == "worker-error" else "",
            action={"keyboardinterrupt": "raise KeyboardInterrupt", "sigkill": "time.sleep(60)"}.get(
                how, "pass"
            ),
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    staging = proc.stdout.readline().strip()
    assert staging.startswith(staging_root), staging
    if how == "sigkill":
        deadline = time.monotonic() + 30
        while not leftovers(staging) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert leftovers(staging)  # staged shards, read by nobody
        proc.kill()
    _, err = proc.communicate(timeout=120)
    if how == "worker-error":
        assert proc.returncode == 1 and "ValueError: a bad sample" in err, err[-2000:]
    elif how == "keyboardinterrupt":
        assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in err, err[-2000:]
    if how != "sigkill":
        assert not os.path.exists(staging), leftovers(staging)
        return
    deadline = time.monotonic() + 15  # the killed run's workers notice their parent is gone
    while (
        os.path.isdir(staging)
        and time.monotonic() < deadline
        and any(str(script) in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))
    ):
        time.sleep(0.2)
    assert os.path.isdir(staging)  # SIGKILL leaves it behind; the next start removes it
    with S5IterableDataset.from_shards(source, endpoint_url=seaweed.endpoint, staging_dir=staging_root):
        assert not os.path.exists(staging)
    assert os.listdir(staging_root) == []


def gzip_shards(
    store: Store, n_shards: int = 6, per_shard: int = 10
) -> tuple[str, dict[str, bytes], dict[str, dict[str, bytes]]]:
    """Class-sorted shards, gzip-compressed, named .tar.gz and .tgz by turns, and indexed."""
    shards: dict[str, bytes] = {}
    expected: dict[str, dict[str, bytes]] = {}
    for s in range(n_shards):
        members = []
        for j in range(per_shard):
            key = f"c{s}-{j:03d}"
            fields = {"bin": sample_bytes(s * 1000 + j, 3000), "cls": b"%d" % s}
            expected[key] = fields
            members += [(f"{key}.{f}", v) for f, v in fields.items()]
        shards[f"shard-{s:03d}.{'tgz' if s % 2 else 'tar.gz'}"] = gzip.compress(tar_of(members), mtime=0)
    return put_indexed(store, shards), shards, expected


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


def test_gzip_shard_errors_say_what_is_wrong_and_what_to_run(seaweed: Store, staging_root: str) -> None:
    source, shards, _ = gzip_shards(seaweed, n_shards=2, per_shard=3)
    # an index without the tar sizes (as other tools write it) names the shard and the command
    listed = [{"url": n, "nsamples": 3, "filesize": len(d)} for n, d in shards.items()]
    seaweed.put({"wids.json": json.dumps({"shardlist": listed}).encode()})
    with pytest.raises(
        ShardIndexError,
        match=r"shard-000.tar.gz is a gzip-compressed shard.*'tarsize'.*s5loader index-shards",
    ):
        S5Dataset.from_shards(source, endpoint_url=seaweed.endpoint)
    # a damaged one: index-shards names it, and so does staging it
    seaweed.put({"shard-001.tgz": shards["shard-001.tgz"][:-40]})
    with pytest.raises(
        ShardError, match=r"shard-001.tgz is a gzip-compressed shard that does not decompress"
    ):
        _indexing.build_index(source, seaweed.endpoint, overwrite=True)  # over the index put above
    seaweed.put({"wids.json": json.dumps({"shardlist": [{**e, "tarsize": 10240} for e in listed]}).encode()})
    ds = S5Dataset.from_shards(source, endpoint_url=seaweed.endpoint)
    with S5Sampler(ds, shuffle=False, staging_dir=staging_root) as sampler:
        with pytest.raises(
            ShardError, match=r"shard-001.tgz is a gzip-compressed shard that does not decompress"
        ):
            load_all(ds, sampler)
    # other compressions are named first, as before
    with pytest.raises(
        ShardError, match=r"shard-000.tar.xz is a compressed tar shard that s5loader cannot read"
    ):
        S5Dataset.from_shards(seaweed.uri("shard-000.tar.xz"), endpoint_url=seaweed.endpoint)


def test_the_daemon_unpacks_gzip_shards_within_a_budget_that_counts_their_tar(
    seaweed: Store, tmp_path
) -> None:
    from support.stores import Peak

    source, shards, expected = gzip_shards(seaweed, n_shards=4, per_shard=5)
    tars = {n: len(gzip.decompress(d)) for n, d in shards.items()}
    # a staged shard, its tar beside it, and the samples unpacked from the tar
    budget = max(len(d) + 2 * tars[n] for n, d in shards.items())
    cache, out = tmp_path / "cache", tmp_path / "got.jsonl"
    consumer = subprocess.Popen([sys.executable, "-c", CONSUMER, str(cache), str(out)])
    with Peak(lambda: on_disk(str(cache)), interval=0.002) as peak:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "s5loader",
                "prefetch",
                "--shards",
                source,
                "--cache",
                str(cache),
                "--budget",
                str(budget),
                "--endpoint-url",
                seaweed.endpoint,
                "--shuffle",
                "--seed",
                "3",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert consumer.wait(60) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(g["name"].split("-", 1)[1] for g in got) == sorted(expected)
    for g in got:
        fields = expected[g["name"].split("-", 1)[1]]
        assert {k.rsplit(".", 1)[-1]: v for k, v in g["files"].items()} == {
            f: hashlib.sha256(v).hexdigest() for f, v in fields.items()
        }
    assert 0 < peak.peak <= budget, (peak.peak, budget)
    # a budget that cannot hold the largest shard with its tar beside it
    staged = max(len(d) + tars[n] for n, d in shards.items())
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "s5loader",
            "prefetch",
            "--shards",
            source,
            "--cache",
            str(tmp_path / "c2"),
            "--budget",
            str(staged - 1),
            "--endpoint-url",
            seaweed.endpoint,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "decompressed" in r.stderr and "raise --budget" in r.stderr, r.stderr[-2000:]


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
    import time

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
            time.sleep(1.5)
            before = [p for _, p, _ in proxy.requests if "shard-000.tar" not in p and ".tar" in p]
            proxy.release.set()
            t.join(30)
            rest = list(it)
            keys = [ds[i]["__key__"] for i in first + rest]
    finally:
        guard.cancel()
        proxy.close()
    assert before == []  # the engine waited for the streamed shard's first sample
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
