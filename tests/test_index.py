"""The compact sample index: the same samples as the straightforward model, saved and loaded,
listed with retries, and listed once per torchrun job.

Private modules (``s5loader._index``, ``s5loader._s5cmd``) are imported only where they are the
seam under test; the rest goes through the public API."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support.reference_index import group as reference_group
from support.stores import Store, free_port, make_pairs
from torch.utils.data import DataLoader

from s5loader import FetchError, IndexFileError, S5Dataset, S5Sampler, find_s5cmd
from s5loader._index.sample import Sample
from s5loader._index.saved import MAGIC
from s5loader._s5cmd import ObjectInfo

MD5 = "0123456789abcdef0123456789abcdef"


def normal(samples: list[Sample]) -> list[Sample]:
    # The compact index keeps no empty extra dict: a sample without extra fields has None.
    return [s._replace(extra=s.extra or None) for s in samples]


# -- real listings ------------------------------------------------------------------------------
def test_from_prefix_matches_reference_and_keeps_the_listing(moto: Store) -> None:
    objects = {**make_pairs(5), "odd-name.x.y": b"1", "noext": b"22", "sub/": b"", "sub/9.image": b"333"}
    moto.put(objects)
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    c = moto.client
    listed = [
        ObjectInfo(f"s3://{moto.bucket}/{o['Key']}", o["Key"], o["Size"], o["ETag"].strip('"'))
        for o in c.list_objects_v2(Bucket=moto.bucket, Prefix=moto.prefix)["Contents"]
    ]
    assert list(ds.samples) == reference_group(listed, "stem", base=moto.prefix)
    # blocks see every key s5cmd listed, those no sample uses too (s5cmd leaves out "sub/")
    assert sorted(ds._listing or []) == sorted(o.key for o in listed if o.key != "train/sub/")
    assert "train/noext" in (ds._listing or [])


def test_from_manifest_with_extras_matches_reference(moto: Store, tmp_path: Path) -> None:
    data = moto.put({"a/1.jpg": b"x" * 3, "a/1.cls": b"7", "b/2.jpg": b"yy"})
    uris = [f"s3://{moto.bucket}/{k}" for k in data]
    lines = [
        json.dumps({"uri": uris[0], "size": 3, "etag": MD5, "label": 1, "w": 0.5}),
        json.dumps(uris[1]),  # no size: one HEAD
        json.dumps({"uri": uris[2], "size": 2, "label": 2}),
    ]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    ds = S5Dataset.from_manifest(str(manifest), endpoint_url=moto.endpoint, group_by="folder")
    head = moto.client.head_object(Bucket=moto.bucket, Key="train/a/1.cls")
    objs = [
        ObjectInfo(uris[0], "train/a/1.jpg", 3, MD5),
        ObjectInfo(uris[1], "train/a/1.cls", 1, head["ETag"].strip('"')),
        ObjectInfo(uris[2], "train/b/2.jpg", 2, ""),
    ]
    extras = {uris[0]: {"label": 1, "w": 0.5}, uris[1]: {}, uris[2]: {"label": 2}}
    assert list(ds.samples) == normal(reference_group(objs, "folder", extras=extras))
    assert ds[0]["label"] == 1 and ds[0]["1.cls"] == b"7"


def _as_list(batch: list) -> list:  # keep samples as dicts
    return batch


@pytest.mark.parametrize("group_by", ["stem", "object"])
def test_labelled_manifest_in_the_bucket_stages_every_sample(
    store: Store, staging_root: str, group_by: str
) -> None:
    # the usual labelled manifest (lines as json.dumps writes them, with size, ETag and a label,
    # not in key order) read from the bucket, so by the fast path a chunk at a time: the index
    # is the reference's, and staging every sample gives its bytes and its label, JSON type kept
    labels: list[object] = [3, "cat", 0.5, True, None, -2]
    data = store.put(
        {f"{i:04d}.{ext}": f"{i}-{ext}".encode() * (i + 1) for i in range(12) for ext in ("jpg", "cls")}
    )
    keys = sorted(data, reverse=True)
    label_of = {k: labels[int(k.rsplit("/", 1)[1][:4]) % len(labels)] for k in keys}
    objs = [
        ObjectInfo(f"s3://{store.bucket}/{k}", k, len(data[k]), hashlib.md5(data[k]).hexdigest())
        for k in keys
    ]
    lines = [
        json.dumps({"uri": o.uri, "size": o.size, "etag": o.etag, "label": label_of[o.key]}) for o in objs
    ]
    store.client.put_object(
        Bucket=store.bucket, Key=store.prefix + "labels.jsonl", Body=("\n".join(lines) + "\n").encode()
    )
    ds = S5Dataset.from_manifest(store.uri("labels.jsonl"), endpoint_url=store.endpoint, group_by=group_by)
    extras = {o.uri: {"label": label_of[o.key]} for o in objs}
    assert list(ds.samples) == reference_group(objs, group_by, extras=extras)
    with S5Sampler(ds, staging_dir=staging_root) as sampler:
        loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=2, collate_fn=_as_list)
        got = [s for batch in loader for s in batch]
    assert len(got) == len(ds) == (12 if group_by == "stem" else 24)
    for s in got:
        key = s["__key__"]
        first = key + ".jpg" if group_by == "stem" else key
        if group_by == "stem":
            assert s["jpg"] == data[key + ".jpg"] and s["cls"] == data[key + ".cls"]
        else:
            assert s["data"] == data[key]
        assert s["label"] == label_of[first] and type(s["label"]) is type(label_of[first])


# -- saving and loading ---------------------------------------------------------------------------
def test_saved_index_round_trips_and_damage_is_refused(moto: Store, tmp_path: Path) -> None:
    data = moto.put(make_pairs(6))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    path = str(tmp_path / "train.s5idx")
    ds.save_index(path)
    back = S5Dataset.from_index(path, endpoint_url=moto.endpoint)
    assert list(back.samples) == list(ds.samples) and back.source == moto.uri()
    assert list(back._listing or []) == list(ds._listing or [])
    assert back[2]["image"] == data[f"{moto.prefix}0002.image"]  # reads the objects it names
    ds.save_index(moto.uri("../index/train.s5idx").replace("train/../", ""))
    from_s3 = S5Dataset.from_index(f"s3://{moto.bucket}/index/train.s5idx", endpoint_url=moto.endpoint)
    assert list(from_s3.samples) == list(ds.samples)

    raw = bytearray(Path(path).read_bytes())
    damaged = tmp_path / "damaged.s5idx"
    raw[len(raw) // 2] ^= 0x01
    damaged.write_bytes(bytes(raw))
    with pytest.raises(IndexFileError, match="damaged.s5idx.*checksum"):
        S5Dataset.from_index(str(damaged))
    truncated = tmp_path / "truncated.s5idx"
    truncated.write_bytes(Path(path).read_bytes()[:-100])
    with pytest.raises(IndexFileError, match="checksum"):
        S5Dataset.from_index(str(truncated))
    foreign = tmp_path / "foreign.s5idx"
    foreign.write_text('{"not": "an index"}\n')
    with pytest.raises(IndexFileError, match="not an s5loader index file"):
        S5Dataset.from_index(str(foreign))
    newer = tmp_path / "newer.s5idx"
    newer.write_bytes(MAGIC + (2).to_bytes(4, "little") + Path(path).read_bytes()[12:])
    with pytest.raises(IndexFileError, match="format version 2.*save the index again"):
        S5Dataset.from_index(str(newer))
    with pytest.raises(IndexFileError, match="cannot read"):
        S5Dataset.from_index(str(tmp_path / "missing.s5idx"))


def test_pickled_dataset_carries_the_compact_index(moto: Store) -> None:
    moto.put(make_pairs(50))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    blob = pickle.dumps(ds)
    back = pickle.loads(blob)
    assert list(back.samples) == list(ds.samples)
    # one compressed buffer, not 100 pickled NamedTuples with their URIs
    assert len(blob) < len(pickle.dumps(list(ds.samples)))


# -- listing: retries, and once per job ------------------------------------------------------------
def wrapper(tmp_path: Path, fail_first: int) -> tuple[str, Path]:
    """An s5cmd that logs each run's arguments and fails its first ``fail_first`` ``ls`` runs
    the way an interrupted listing does (an error line, exit code 1)."""
    log = tmp_path / "s5cmd-runs.log"
    script = tmp_path / "s5cmd"
    script.write_text(
        f"""#!/bin/sh
echo "$*" >> {log}
case " $* " in *" ls "*)
  n=$(grep -c ' ls ' {log})
  if [ "$n" -le {fail_first} ]; then
    err="RequestError: send request failed: read: connection reset by peer"
    echo "{{\"operation\":\"ls\",\"error\":\"$err\"}}" >&2
    exit 1
  fi;;
esac
exec {find_s5cmd()} "$@"
"""
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), log


def test_interrupted_listing_is_listed_again(
    moto: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    moto.put(make_pairs(3))
    binary, log = wrapper(tmp_path, fail_first=1)
    monkeypatch.setenv("S5LOADER_S5CMD", binary)
    with caplog.at_level(logging.INFO, logger="s5loader"):
        ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    assert len(ds) == 3
    assert log.read_text().count(" ls ") == 2
    assert any(
        "connection reset by peer" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
    )
    done = [
        r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "listed " in r.getMessage()
    ]
    assert done and f"listed {moto.uri()} with s5cmd ls: 6 objects" in done[0]
    assert "2 attempt(s), about 2 LIST requests" in done[0]


def test_listing_that_keeps_failing_names_the_prefix(
    moto: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    moto.put(make_pairs(1))
    binary, log = wrapper(tmp_path, fail_first=100)
    monkeypatch.setenv("S5LOADER_S5CMD", binary)
    with pytest.raises(
        FetchError, match=rf"cannot list {moto.uri()} \(4 attempts\).*connection reset by peer"
    ):
        S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    assert log.read_text().count(" ls ") == 4


LIST_ONCE_SCRIPT = """
import json, os, sys
uri, endpoint, out, mode = sys.argv[1:5]
if mode.startswith("dist"):
    import torch.distributed as dist
    dist.init_process_group("gloo")
if mode == "dist-split":  # a source per rank
    uri += "a/" if os.environ["RANK"] == "0" else "b/"
from s5loader import S5Dataset, S5Sampler
ds = S5Dataset.from_prefix(uri, endpoint_url=endpoint)
sampler = S5Sampler(ds, samples_per_call=4)
rank = os.environ["RANK"]
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"samples": [list(s) for s in ds.samples], "blocks": len(sampler._run.blocks.blocks),
               "sizes": [ds[i]["__key__"] for i in range(2)]}, f)
sampler.close()
"""


@pytest.mark.parametrize("mode", ["dist", "local", "dist-split"])
def test_torchrun_lists_once(seaweed: Store, tmp_path: Path, mode: str) -> None:
    pairs = make_pairs(9, size=32)
    seaweed.put(
        {f"{half}/{k}": v for k, v in pairs.items() for half in "ab"} if mode == "dist-split" else pairs
    )
    binary, log = wrapper(tmp_path, fail_first=0)
    script = tmp_path / "job.py"
    script.write_text(LIST_ONCE_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(script),
        seaweed.uri(),
        seaweed.endpoint,
        str(out),
        mode,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "S5LOADER_S5CMD": binary}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    r0, r1 = (json.loads((out / f"rank{i}.json").read_text()) for i in range(2))
    if mode == "dist-split":  # each rank lists its own source
        assert log.read_text().count(" ls ") == 2
        assert len(r0["samples"]) == len(r1["samples"]) == 9
        assert all("/train/a/" in s[0] for s in r0["samples"]) and all(
            "/train/b/" in s[0] for s in r1["samples"]
        )
        return
    assert log.read_text().count(" ls ") == 1  # one listing for the whole job
    assert len(r0["samples"]) == 9 and r0 == r1
    assert r0["blocks"] > 0  # the listing came along: blocks are planned on both ranks
