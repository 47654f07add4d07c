"""Tar shards in the WebDataset format, without a server: brace patterns, the wids index and
how its URLs resolve, grouping members into samples, hostile tars, decoding by extension.
These are unit tests of the private shard modules (``s5loader._shards``): the index format
and the tar scanner are the point of them."""

from __future__ import annotations

import gzip
import io
import json

import pytest
from support.shards import tar_of

from s5loader import ConfigError, ShardError, ShardIndexError, UnsafeArchiveError
from s5loader._shards import index as _shards
from s5loader._shards import tar as _tar
from s5loader.decode import decode


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


def test_a_staged_shard_is_read_by_offset_and_a_member_cut_short_comes_back_short(tmp_path) -> None:
    data = tar_of([("0001.bin", bytes(range(256)) * 40), ("0001.txt", b"t"), ("0002.bin", b"z" * 700)])
    samples = _tar.scan_bytes(data, "s3://b/s.tar")
    path = tmp_path / "tar"
    path.write_bytes(data)
    with open(path, "rb", buffering=0) as fh:
        assert [_tar.read_sample(fh, s) for s in samples] == [
            _tar.read_sample(io.BytesIO(data), s) for s in samples
        ]
    last = samples[1].members[0]
    path.write_bytes(data[: last.offset + 100])  # the file ends inside the last member
    with open(path, "rb", buffering=0) as fh:
        assert _tar.read_sample(fh, samples[1]) == {"bin": b"z" * 100}


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


def test_a_member_table_is_parsed_with_the_cycle_collector_paused_and_left_as_it_was() -> None:
    import gc

    table = _tar.dumps(_tar.scan_bytes(tar_of([("a.bin", b"x" * 10), ("b.bin", b"y")]), "s3://b/t.tar"))
    seen: list[bool] = []
    real = json.loads
    try:
        json.loads = lambda data: (seen.append(gc.isenabled()), real(data))[1]  # type: ignore[assignment]
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            parsed = _tar.loads(table)
            assert [parsed[j].key for j in range(2)] == ["a", "b"]
            assert gc.isenabled() is enabled
    finally:
        json.loads = real
        gc.enable()
    assert seen == [False, False]
