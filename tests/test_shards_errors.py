"""Bad tar shards and bad sources against local S3 servers: damaged, hostile, missing and
miscounted shards, indexes other tools write, sources that name no shard, decode errors,
gzip shard errors. Each error names the shard's s3:// URI.

A private module (``s5loader._shards``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections import Counter

import pytest
from support.shards import (
    gzip_shards,
    leftovers,
    load_all,
    make_shards,
    put_indexed,
    put_indexed_with,
    tar_of,
)
from support.stores import Store

from s5loader import (
    DecodeError,
    EmptySourceError,
    S5Dataset,
    S5Sampler,
    ShardError,
    ShardIndexError,
    UnsafeArchiveError,
)
from s5loader._shards import indexing as _indexing
from s5loader._shards import tar as _tar
from s5loader.cli import main as cli_main


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
    # an index that disagrees with its shard (written as any tool writes the wids format)
    listed = [{"url": "shard-000.tar", "nsamples": 4, "filesize": len(good["shard-000.tar"])}]
    moto.put({"wids.json": json.dumps({"wids_version": 1, "shardlist": listed}).encode()})
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
    assert cli_main(["index-shards", moto.uri("bad/"), "--endpoint-url", moto.endpoint]) == 0
    with pytest.raises(
        DecodeError, match=r"s3://\S+/bad/shard-000.tar: field 'json' of sample 'x' cannot be decoded"
    ):
        S5Dataset.from_shards(moto.uri("bad/"), endpoint_url=moto.endpoint, decode=True)[0]
    with pytest.raises(DecodeError, match=r"s3://\S+/rawbad/y.json: field 'json' of sample '\S*y'"):
        S5Dataset.from_prefix(moto.uri("rawbad/"), endpoint_url=moto.endpoint, decode=True)[0]


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
