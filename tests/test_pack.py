"""``s5loader pack``: objects, manifests and split archives into WebDataset shards that read
back byte-exact through ``S5Dataset.from_shards``; SIGKILL and a rerun; two ranks with one
index; bad input (vanished objects, unsafe keys, overlapping or occupied destinations).

Private modules (``s5loader._pack``, ``s5loader._shards``) are imported only where they are the
seam under test; the rest goes through the public API."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
from collections import Counter

import psutil
import pytest
from support.faults import FaultProxy, Rule
from support.stores import Peak, Store
from support.waits import wait_for

import s5loader
from s5loader import ConfigError, ObjectNotFoundError, S5Dataset, UnsafeArchiveError
from s5loader._shards import tar as _tar

KiB = 1024


def dataset(n: int, size: int = 2 * KiB, folder: str = "") -> dict[str, bytes]:
    """``n`` samples of an image (random bytes, sizes vary) and a label, under ``folder``."""
    out = {}
    for i in range(n):
        out[f"{folder}{i:04d}.image"] = random.Random(i).randbytes(size + 37 * i)
        out[f"{folder}{i:04d}.label"] = str(i % 7).encode()
    return out


def expected_samples(objects: dict[str, bytes]) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    for k, v in objects.items():
        key, _, field = k.partition(".")
        out.setdefault(key, {})[field] = v
    return out


def work_bytes(path: str) -> int:
    """Bytes of the objects and shards below a pack's work folder (not its pid file, nor the
    command file s5cmd reads, about 150 bytes per object, which the budget does not count)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            if f not in (".commands", "pid"):
                try:
                    total += os.lstat(os.path.join(root, f)).st_size
                except FileNotFoundError:
                    continue
    return total


def state_keys(store: Store, prefix: str) -> list[str]:
    """The keys of a pack's state (``.s5pack/``) under ``prefix``."""
    got = store.client.list_objects_v2(Bucket=store.bucket, Prefix=prefix + ".s5pack/").get("Contents", [])
    return [o["Key"] for o in got]


def read_back(dest: str, endpoint: str) -> list[dict]:
    ds = S5Dataset.from_shards(dest, endpoint_url=endpoint)
    return [ds[i] for i in range(len(ds))]


def as_dict(samples: list[dict]) -> dict[str, dict[str, bytes]]:
    keys = Counter(s["__key__"] for s in samples)
    assert max(keys.values()) == 1, keys.most_common(3)  # every sample once
    return {s["__key__"]: {f: v for f, v in s.items() if f != "__key__"} for s in samples}


def listed(store: Store, prefix: str) -> dict[str, bytes]:
    c = store.client
    out = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=store.bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"][len(prefix) :]] = c.get_object(Bucket=store.bucket, Key=o["Key"])["Body"].read()
    return out


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "s5loader", "pack", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


# -- the real path ----------------------------------------------------------------------------


def test_packed_prefix_reads_back_byte_exact_with_index_md5(seaweed: Store, tmp_path) -> None:
    objects = seaweed.put(dataset(120))
    src, dest = seaweed.uri(), seaweed.uri().replace("/train/", "/shards/")
    with Peak(lambda: work_bytes(str(tmp_path))) as peak:
        r = s5loader.pack(
            src,
            dest,
            shard_size="40KB",
            shuffle=True,
            seed=3,
            budget="100KB",
            endpoint_url=seaweed.endpoint,
            staging_dir=str(tmp_path),
        )
    assert r.shards == r.packed > 3 and r.samples == 120 and r.index == dest + "wids.json"
    got = as_dict(read_back(dest, seaweed.endpoint))
    want = expected_samples({k[len(seaweed.prefix) :]: v for k, v in objects.items()})
    assert got == want  # keys relative to the source prefix, fields and bytes equal
    # the index gives each shard's size and MD5; samples are consecutive in each shard
    files = listed(seaweed, seaweed.prefix.replace("/train/", "/shards/"))
    index = json.loads(files["wids.json"])
    assert sum(e["nsamples"] for e in index["shardlist"]) == 120
    order = []
    for e in index["shardlist"]:
        body = files[e["url"]]
        assert (len(body), hashlib.md5(body).hexdigest()) == (e["filesize"], e["md5sum"])
        samples = _tar.scan_bytes(body, e["url"])
        assert len(samples) == e["nsamples"] and len({s.key for s in samples}) == len(samples)
        order += [s.key for s in samples]
    assert order != sorted(order)  # shuffled across shards
    assert 0 < r.peak_staged <= 100_000 and peak.peak <= 100_000  # the budget, a limit
    assert os.listdir(tmp_path) == []  # nothing left behind, s5loader-pack-UID neither
    assert index["s5loader_pack"]["source"] == src and not [k for k in files if k.startswith(".s5pack/")]


def test_sigkill_midway_then_rerun_completes_without_redoing(seaweed: Store, tmp_path) -> None:
    seaweed.put(dataset(48, size=1 * KiB))
    src, dest = seaweed.uri(), seaweed.uri().replace("/train/", "/packed/")
    dest_prefix = seaweed.prefix.replace("/train/", "/packed/")
    args = [
        src,
        dest,
        "--shard-size",
        "12KB",
        "--budget",
        "30KB",
        "--shuffle",
        "--seed",
        "5",
        "--endpoint-url",
        seaweed.endpoint,
        "--staging-dir",
        str(tmp_path),
    ]
    # the command line, one shard at a time, so that it is still at work when killed
    proc = subprocess.Popen(
        [sys.executable, "-m", "s5loader", "pack", *args, "--workers", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    c = seaweed.client

    done: list = []

    def two_shards_done() -> bool:
        assert proc.poll() is None, "the pack ended before it could be killed"
        done[:] = c.list_objects_v2(Bucket=seaweed.bucket, Prefix=dest_prefix + ".s5pack/done/").get(
            "Contents", []
        )
        return len(done) >= 2

    wait_for(two_shards_done, 60, "two shards packed", interval=0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    at_kill = listed(seaweed, dest_prefix)
    assert "wids.json" not in at_kill  # no index before every shard is there
    for name, body in at_kill.items():  # every shard a reader can see is whole
        if name.endswith(".tar"):
            _tar.scan_bytes(body, name)
    # the same arguments (the parallelism may differ), here through the API
    kw = {
        "shard_size": "12KB",
        "budget": "30KB",
        "shuffle": True,
        "seed": 5,
        "endpoint_url": seaweed.endpoint,
        "staging_dir": str(tmp_path),
    }
    r = s5loader.pack(src, dest, **kw)
    plan = json.loads(at_kill[".s5pack/plan.json"])
    assert r.shards == plan["shards"] and r.packed <= plan["shards"] - len(
        done
    )  # finished shards not packed again
    assert state_keys(seaweed, dest_prefix) == []  # the plan and the markers, gone once the index is written
    got = as_dict(read_back(dest, seaweed.endpoint))
    assert got == expected_samples(listed(seaweed, seaweed.prefix))
    # once more: the index says this pack is finished, so nothing to do, the same index
    index = listed(seaweed, dest_prefix)["wids.json"]
    again = s5loader.pack(src, dest, **kw)
    assert again.packed == 0 and listed(seaweed, dest_prefix)["wids.json"] == index
    assert (again.shards, again.samples, again.index) == (r.shards, 48, dest + "wids.json")
    assert state_keys(seaweed, dest_prefix) == [] and os.listdir(tmp_path) == []


def put_volumes(store: Store, name: str, blob: bytes, volume: int) -> str:
    """Split ``blob`` like ``split -b VOLUME -d`` and upload the volumes and their .md5 files."""
    c = store.client
    for i in range(0, len(blob), volume):
        part = blob[i : i + volume]
        key = f"{store.prefix}{name}.part{i // volume:02d}"
        c.put_object(Bucket=store.bucket, Key=key, Body=part)
        line = f"{hashlib.md5(part).hexdigest()}  {key.rsplit('/', 1)[1]}\n"
        c.put_object(Bucket=store.bucket, Key=key + ".md5", Body=line.encode())
    return store.uri(name + ".part")


def test_split_tar_gz_with_md5_files_packs_into_shards(seaweed: Store, tmp_path) -> None:
    files = dataset(80, size=3 * KiB, folder="set/")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.addfile(tarfile.TarInfo("set"))  # a folder entry: left out
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    source = put_volumes(seaweed, "set.tar.gz", buf.getvalue(), volume=20 * KiB)
    dest = seaweed.uri().replace("/train/", "/fromtar/")
    r = s5loader.pack(
        source,
        dest,
        from_archive=True,
        shard_size="50KB",
        budget="120KB",
        endpoint_url=seaweed.endpoint,
        staging_dir=str(tmp_path),
    )
    assert r.samples == 80 and r.shards == r.packed > 3
    assert 0 < r.peak_staged <= 120_000  # the budget, a limit
    assert as_dict(read_back(dest, seaweed.endpoint)) == expected_samples(files)
    # a damaged volume is named and nothing is indexed
    bad = f"{seaweed.prefix}set.tar.gz.part01"
    seaweed.client.put_object(Bucket=seaweed.bucket, Key=bad, Body=b"x" * 100)
    with pytest.raises(s5loader.ChecksumError, match=bad):
        s5loader.pack(
            source,
            seaweed.uri().replace("/train/", "/bad/"),
            from_archive=True,
            endpoint_url=seaweed.endpoint,
            staging_dir=str(tmp_path),
        )
    assert "wids.json" not in listed(seaweed, seaweed.prefix.replace("/train/", "/bad/"))


def test_two_ranks_pack_disjoint_halves_with_one_index(seaweed: Store, tmp_path) -> None:
    seaweed.put(dataset(40))
    src, dest = seaweed.uri(), seaweed.uri().replace("/train/", "/ranks/")
    args = [
        src,
        dest,
        "--shard-size",
        "20KB",
        "--endpoint-url",
        seaweed.endpoint,
        "--staging-dir",
        str(tmp_path),
    ]
    # torchrun starts the two ranks (RANK, WORLD_SIZE, ...); each rank's output goes to a file
    logs = tmp_path / "logs"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            "--redirects",
            "3",
            "--log-dir",
            str(logs),
            "-m",
            "s5loader",
            "pack",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out0, out1 = (next(logs.rglob(f"attempt_0/{r}/stdout.log")).read_text() for r in (0, 1))
    shards = int(out0.split(" of ")[1].split(" ")[0])
    p0, p1 = (int(o.split("packed ")[1].split(" ")[0]) for o in (out0, out1))
    assert p0 + p1 == shards and p0 > 0 and p1 > 0  # each rank packed its half
    assert "indexed" in out0 and "indexed" not in out1  # rank 0 wrote the one index
    assert len(as_dict(read_back(dest, seaweed.endpoint))) == 40


# -- bad input --------------------------------------------------------------------------------


def test_vanished_object_is_named_or_skipped_and_counted(moto: Store, tmp_path) -> None:
    moto.put(dataset(12))
    src = moto.uri()
    gone = f"{moto.prefix}0005.image"
    ds_keys = S5Dataset.from_prefix(src, endpoint_url=moto.endpoint)  # listed ...
    assert len(ds_keys) == 12
    from s5loader._pack import plan as _plan

    real = _plan.plan_samples

    def plan_then_delete(samples, base):  # ... then gone before the download
        out = real(samples, base)
        moto.client.delete_object(Bucket=moto.bucket, Key=gone)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_plan, "plan_samples", plan_then_delete)
        with pytest.raises(ObjectNotFoundError, match=f"s3://{moto.bucket}/{gone}"):
            s5loader.pack(src, "s3://data/out1/", endpoint_url=moto.endpoint, staging_dir=str(tmp_path))
        assert "wids.json" not in listed(moto, "out1/")
        assert os.listdir(tmp_path) == []  # the work folder and s5loader-pack-UID, gone on an error too
        moto.client.put_object(Bucket=moto.bucket, Key=gone, Body=b"back")
        r = s5loader.pack(
            src, "s3://data/out2/", missing="skip", endpoint_url=moto.endpoint, staging_dir=str(tmp_path)
        )
    assert r.skipped == ["0005"] and r.samples == 11
    got = as_dict(read_back("s3://data/out2/", moto.endpoint))
    assert len(got) == 11 and "0005" not in got


def test_keys_that_cannot_be_member_names_are_refused_before_any_upload(moto: Store, tmp_path) -> None:
    moto.put({"a.b/0001.jpg": b"x"})
    with pytest.raises(UnsafeArchiveError, match=r"a\.b/0001\.jpg.*read back"):
        s5loader.pack(moto.uri(), "s3://data/o/", group_by="object", endpoint_url=moto.endpoint)
    assert listed(moto, "o/") == {}
    # a long key is carried by a pax header and reads back whole
    long_key = "d" * 120 + "/" + "k" * 150
    moto.client.delete_object(Bucket=moto.bucket, Key=moto.prefix + "a.b/0001.jpg")
    moto.put({long_key + ".jpg": b"long", "ünï/0002.jpg": b"utf8"})
    s5loader.pack(moto.uri(), "s3://data/p/", endpoint_url=moto.endpoint, staging_dir=str(tmp_path))
    assert as_dict(read_back("s3://data/p/", moto.endpoint)) == {
        long_key: {"jpg": b"long"},
        "ünï/0002": {"jpg": b"utf8"},
    }


def test_dest_inside_source_or_holding_other_shards_is_refused(moto: Store, tmp_path) -> None:
    moto.put(dataset(4))
    with pytest.raises(ConfigError, match="overlap"):
        s5loader.pack(moto.uri(), moto.uri("shards/"), endpoint_url=moto.endpoint)
    r = run_cli(moto.uri(), moto.uri("shards/"), "--endpoint-url", moto.endpoint)
    assert r.returncode == 1 and "s5loader pack: error:" in r.stderr and "overlap" in r.stderr
    moto.client.put_object(Bucket=moto.bucket, Key="busy/other-000.tar", Body=b"x")
    with pytest.raises(ConfigError, match="already holds s3://data/busy/other-000.tar"):
        s5loader.pack(moto.uri(), "s3://data/busy/", endpoint_url=moto.endpoint, staging_dir=str(tmp_path))
    assert set(listed(moto, "busy/")) == {"other-000.tar"}  # nothing written
    s5loader.pack(moto.uri(), "s3://data/ok/", endpoint_url=moto.endpoint, staging_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="other samples or options"):
        s5loader.pack(
            moto.uri(), "s3://data/ok/", shuffle=True, endpoint_url=moto.endpoint, staging_dir=str(tmp_path)
        )


def test_rank_0_names_the_missing_ranks_then_a_rerun_finishes(moto: Store, tmp_path) -> None:
    objects = moto.put(dataset(30))
    kw = {"shard_size": "12KB", "endpoint_url": moto.endpoint, "staging_dir": str(tmp_path), "world_size": 3}
    with pytest.raises(s5loader.ShardIndexError, match=r"rank\(s\) 1, 2") as err:
        s5loader.pack(moto.uri(), "s3://data/r/", rank=0, index_timeout=0.5, **kw)
    assert "run the pack again" in str(err.value) and "wids.json" not in listed(moto, "r/")
    for r in (1, 2):
        assert s5loader.pack(moto.uri(), "s3://data/r/", rank=r, **kw).index is None  # only rank 0 indexes
    done = s5loader.pack(moto.uri(), "s3://data/r/", rank=0, **kw)
    assert done.packed == 0 and done.samples == 30
    # the state is gone, and a rank run again over the finished pack sees it finished at once
    assert state_keys(moto, "r/") == []
    again = s5loader.pack(moto.uri(), "s3://data/r/", rank=1, index_timeout=0.5, **kw)
    assert again.packed == 0 and again.index is None and again.samples == 30
    # key order: runs of samples under one key prefix came with one wildcard line each
    want = expected_samples({k[len(moto.prefix) :]: v for k, v in objects.items()})
    assert as_dict(read_back("s3://data/r/", moto.endpoint)) == want


def test_labels_and_manifests_become_members(moto: Store, tmp_path) -> None:
    moto.put({"cat/1.jpg": b"c1", "cat/2.jpg": b"c2", "dog/3.jpg": b"d3"})
    s5loader.pack(
        moto.uri(), "s3://data/lab/", label="folder", endpoint_url=moto.endpoint, staging_dir=str(tmp_path)
    )
    got = as_dict(read_back("s3://data/lab/", moto.endpoint))
    assert got == {
        "cat/1": {"jpg": b"c1", "cls": b"0"},
        "cat/2": {"jpg": b"c2", "cls": b"0"},
        "dog/3": {"jpg": b"d3", "cls": b"1"},
    }
    # the class names travel with the shards: the index names them, from_shards gives them back
    ds = S5Dataset.from_shards("s3://data/lab/", endpoint_url=moto.endpoint)
    assert ds.classes == ["cat", "dog"] and ds.class_to_idx == {"cat": 0, "dog": 1}
    manifest = tmp_path / "m.jsonl"
    lines = [
        {"uri": moto.uri("cat/1.jpg"), "caption": "a cat"},
        {"uri": moto.uri("dog/3.jpg"), "caption": "a dog"},
    ]
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    s5loader.pack(str(manifest), "s3://data/man/", endpoint_url=moto.endpoint, staging_dir=str(tmp_path))
    got = as_dict(read_back("s3://data/man/", moto.endpoint))
    assert got == {
        f"{moto.prefix}cat/1": {"jpg": b"c1", "json": b'{"caption": "a cat"}'},
        f"{moto.prefix}dog/3": {"jpg": b"d3", "json": b'{"caption": "a dog"}'},
    }


def test_no_shard_of_a_volume_that_fails_its_check_is_marked_done(moto: Store, tmp_path) -> None:
    files = dataset(30, size=3 * KiB)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:  # plain tar: a flipped byte still reads
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    source = put_volumes(moto, "set.tar", buf.getvalue(), volume=40 * KiB)
    key = f"{moto.prefix}set.tar.part01"
    good = moto.client.get_object(Bucket=moto.bucket, Key=key)["Body"].read()
    bad = bytearray(good)
    bad[20 * KiB] ^= 0xFF  # inside a member's data
    moto.client.put_object(Bucket=moto.bucket, Key=key, Body=bytes(bad))
    kw = {
        "from_archive": True,
        "shard_size": "10KB",
        "budget": "100KB",
        "endpoint_url": moto.endpoint,
        "staging_dir": str(tmp_path),
    }
    with pytest.raises(s5loader.ChecksumError, match=key):
        s5loader.pack(source, "s3://data/v/", **kw)
    kept = [k for k in listed(moto, "v/") if k.startswith(".s5pack/done/")]
    assert "wids.json" not in listed(moto, "v/")
    # the volume again as its .md5 file says: the same pack, finished by a rerun
    moto.client.put_object(Bucket=moto.bucket, Key=key, Body=good)
    r = s5loader.pack(source, "s3://data/v/", **kw)
    assert len(kept) < r.shards and r.packed == r.shards - len(kept)  # only shards marked done were kept
    assert as_dict(read_back("s3://data/v/", moto.endpoint)) == expected_samples(files)


# -- the disk budget, a limit ---------------------------------------------------------------


def test_a_sample_or_a_shard_the_budget_cannot_hold_is_refused_before_anything_is_written(
    moto: Store, tmp_path
) -> None:
    objects = dataset(20)
    objects["0007.image"] = random.Random(7).randbytes(300 * KiB)
    moto.put(objects)
    big = moto.uri("0007.image")
    with pytest.raises(
        s5loader.BudgetError,
        match=rf"{big}: its sample '0007' takes .* more than the budget of "
        r"97.7 KiB \(100000 bytes\).*pass a budget of at least",
    ):
        s5loader.pack(
            moto.uri(), "s3://data/b1/", budget="100KB", endpoint_url=moto.endpoint, staging_dir=str(tmp_path)
        )
    assert listed(moto, "b1/") == {} and os.listdir(tmp_path) == []  # nothing written, here or there
    # every sample fits, but a shard (cut at the default 100MB) does not: named, with what to pass
    moto.client.delete_object(Bucket=moto.bucket, Key=moto.prefix + "0007.image")
    r = run_cli(
        moto.uri(),
        "s3://data/b2/",
        "--budget",
        "20KB",
        "--endpoint-url",
        moto.endpoint,
        "--staging-dir",
        str(tmp_path),
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert (
        "s3://data/b2/shard-000000.tar takes" in r.stderr and "budget of 19.5 KiB (20000 bytes)" in r.stderr
    )
    assert "smaller --shard-size" in r.stderr and listed(moto, "b2/") == {}
    # cut smaller, the same budget holds it, and never more than it
    with Peak(lambda: work_bytes(str(tmp_path))) as peak:
        done = s5loader.pack(
            moto.uri(),
            "s3://data/b2/",
            shard_size="8KB",
            budget="20KB",
            endpoint_url=moto.endpoint,
            staging_dir=str(tmp_path),
        )
    assert done.samples == 20 and done.peak_staged <= 20_000 and peak.peak <= 20_000


def test_an_archive_is_packed_within_its_budget_or_refused_naming_the_member(moto: Store, tmp_path) -> None:
    files = dataset(20, size=3 * KiB, folder="set/")
    files["set/0011.image"] = random.Random(11).randbytes(70 * KiB)  # larger than half the budget below
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    source = put_volumes(moto, "set.tar", buf.getvalue(), volume=40 * KiB)
    kw = {"from_archive": True, "endpoint_url": moto.endpoint, "staging_dir": str(tmp_path)}
    # half the budget holds the shards: a shard size above it is refused at once
    with pytest.raises(
        s5loader.BudgetError, match=r"half the budget \(39.1 KiB \(40 kB\)\) holds the shards"
    ):
        s5loader.pack(source, "s3://data/a1/", shard_size="50KB", budget="80KB", **kw)
    assert listed(moto, "a1/") == {}
    # a sample larger than that half is found as it streams by: named, with the budget that holds it
    with pytest.raises(
        s5loader.BudgetError,
        match=r"set.tar.part00: its member 'set/0011.image' \(70.0 KiB\) "
        r"makes s3://data/a2/shard-00000\d.tar take",
    ):
        s5loader.pack(source, "s3://data/a2/", shard_size="20KB", budget="100KB", **kw)
    assert "wids.json" not in listed(moto, "a2/") and os.listdir(tmp_path) == []
    # a budget that holds it packs it, within that budget: the shard holds more of it while the
    # sample is written
    r = s5loader.pack(source, "s3://data/a2/", shard_size="20KB", budget="200KB", **kw)
    assert r.samples == 20 and 90 * KiB < r.peak_staged <= 200_000
    assert as_dict(read_back("s3://data/a2/", moto.endpoint)) == expected_samples(files)


# -- index-shards over what pack wrote ----------------------------------------------------------


def test_index_shards_refuses_to_replace_the_index_pack_wrote_unless_forced(moto: Store, tmp_path) -> None:
    moto.put(dataset(10))
    s5loader.pack(
        moto.uri(), "s3://data/ix/", shard_size="10KB", endpoint_url=moto.endpoint, staging_dir=str(tmp_path)
    )
    index = listed(moto, "ix/")["wids.json"]
    assert all(e["md5sum"] for e in json.loads(index)["shardlist"])

    def index_shards(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "s5loader",
                "index-shards",
                "s3://data/ix/",
                *extra,
                "--endpoint-url",
                moto.endpoint,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )

    r = index_shards()
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "s3://data/ix/wids.json already exists (s5loader pack wrote it, with each shard's MD5" in r.stderr
    assert "--force" in r.stderr and listed(moto, "ix/")["wids.json"] == index  # kept as it was
    r = index_shards("--force")
    assert r.returncode == 0, r.stderr
    replaced = json.loads(listed(moto, "ix/")["wids.json"])
    assert [e["nsamples"] for e in replaced["shardlist"]] == [
        e["nsamples"] for e in json.loads(index)["shardlist"]
    ]
    assert "md5sum" not in replaced["shardlist"][0]  # what --force gives up
    # an index pack did not write is refused the same way, without the word about MD5s
    assert "already exists; pass --force" in index_shards().stderr


# -- Ctrl-C -----------------------------------------------------------------------------------

CTRL_C = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even in the background
from s5loader.cli import main
sys.exit(main(["pack", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("held", ["downloads", "uploads"])
def test_ctrl_c_ends_the_command_with_one_line_and_leaves_nothing(moto: Store, tmp_path, held: str) -> None:
    """SIGINT to the process group, as Ctrl-C sends it, while shards download (two under way and
    more waiting their turn: each GET of an image is held) or upload (each part held): exit
    130, one line, no traceback; no work folder, no s5cmd, no multipart upload left."""
    if held == "downloads":  # six one-sample shards, all within the budget: two build, four wait
        moto.put(dataset(6))
        rule, count, extra = Rule(".image", "hold", method="GET"), 2, ["--shard-size", "3KB"]
    else:  # two shards large enough for a multipart upload
        moto.put({f"{i:04d}.bin": random.Random(i).randbytes(6 * 1024 * KiB) for i in range(2)})
        rule, count, extra = Rule("partNumber=", "hold", method="PUT"), 1, ["--shard-size", "7MB"]
    proxy = FaultProxy(moto.endpoint, [rule])
    dest, stage = "s3://data/cc/", tmp_path / "stage"
    stage.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CTRL_C,
            moto.uri(),
            dest,
            *extra,
            "--budget",
            "100MB",
            "--workers",
            "4",
            "--endpoint-url",
            proxy.endpoint,
            "--staging-dir",
            str(stage),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    s5: list[psutil.Process] = []
    try:
        assert proxy.wait_held(rule.match, count, timeout=60), proc.communicate(timeout=30)
        if held == "uploads":
            assert moto.client.list_multipart_uploads(Bucket=moto.bucket, Prefix="cc/").get("Uploads")
        s5 = [c for c in psutil.Process(proc.pid).children(recursive=True) if c.name() == "s5cmd"]
        assert s5, "no s5cmd under way"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proxy.close()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Error" not in err, err
    assert err.strip().splitlines()[-1] == "s5loader pack: interrupted" and out == ""
    assert os.listdir(stage) == []  # the work folder and s5loader-pack-UID
    _, alive = psutil.wait_procs(s5, timeout=10)
    assert not alive
    assert not moto.client.list_multipart_uploads(Bucket=moto.bucket, Prefix="cc/").get("Uploads")
    assert not [k for k in listed(moto, "cc/") if k.endswith(".tar")]  # no shard got through


def test_shards_waiting_for_their_turn_reserve_no_disk(seaweed: Store, tmp_path) -> None:
    # A budget far above what the shards under way take: only the two shards being built, and
    # the written ones waiting for their upload, reserve disk; the many waiting their turn none.
    seaweed.put(dataset(40, size=1 * KiB))
    dest = seaweed.uri().replace("/train/", "/shards/")
    with Peak(lambda: work_bytes(str(tmp_path))) as peak:
        r = s5loader.pack(
            seaweed.uri(),
            dest,
            shard_size="4KB",
            budget="1GB",
            endpoint_url=seaweed.endpoint,
            staging_dir=str(tmp_path),
        )
    assert r.shards == r.packed >= 20
    shard_disk = (
        4_000 + 4 * 1024 + 10 * 1024
    )  # at most: a shard's tar (size + headers) and its largest object
    assert 0 < peak.peak <= r.peak_staged <= r.shards * shard_disk // 2, (peak.peak, r.peak_staged)
