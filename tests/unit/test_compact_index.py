"""The sample index without a server: the compact index against a plain reference, plain samples
kept in order, fast manifest lines read as json does, and ranks of one node sharing one index
through a file.

Private modules (``s5loader._index``, ``s5loader._s5cmd``) are imported on purpose: their own
behaviour is what these tests check."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.reference_index import group as reference_group

from s5loader import ManifestError
from s5loader._index.compact import SampleIndex
from s5loader._index.listing import group
from s5loader._index.sample import GROUP_BY, Sample
from s5loader._index.saved import dumps, loads
from s5loader._s5cmd import ObjectInfo
from s5loader.exceptions import ConfigError

PARTS = ["a", "b", "a.b", "a-b", "x.y.z", "_", "é", "0", "a.", ".b", "."]
MD5 = "0123456789abcdef0123456789abcdef"


def normal(samples: list[Sample]) -> list[Sample]:
    # The compact index keeps no empty extra dict: a sample without extra fields has None.
    return [s._replace(extra=s.extra or None) for s in samples]


@st.composite
def object_sets(draw: st.DrawFn) -> tuple[list[ObjectInfo], str, dict[str, dict[str, object]] | None, bool]:
    """Inputs shaped like the three constructors': a listing under a base prefix, an object
    list (no base, maybe repeated URIs, maybe two buckets), a manifest with extra fields."""
    shape = draw(st.sampled_from(["listing", "objects", "manifest"]))
    base = draw(st.sampled_from(["", "p/", "p/a"])) if shape == "listing" else ""
    buckets = ["b"] if shape == "listing" else draw(st.sampled_from([["b"], ["b", "bb"]]))
    rels = draw(st.lists(st.lists(st.sampled_from(PARTS), min_size=1, max_size=3).map("/".join), max_size=25))
    objects = []
    for i, rel in enumerate(rels):
        key = base + rel + draw(st.sampled_from(["", "", "/"]))
        etag = draw(st.sampled_from(["", MD5, MD5.upper(), "abc-2", MD5[:31]]))
        b = draw(st.sampled_from(buckets))
        objects.append(ObjectInfo(f"s3://{b}/{key}", key, draw(st.integers(0, 3)) * i, etag))
    if shape != "objects":  # a listing or a manifest names each object once
        first: dict[str, ObjectInfo] = {}
        for o in objects:
            first.setdefault(o.uri, o)
        objects = list(first.values())
    extras = None
    if shape == "manifest":
        values = st.dictionaries(
            st.sampled_from(["label", "w", "x"]), st.integers(0, 5) | st.text(max_size=3), max_size=2
        )
        extras = {o.uri: draw(values) for o in objects}
    return objects, base, extras, draw(st.booleans())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(object_sets(), st.sampled_from(GROUP_BY))
def test_compact_index_matches_reference(case, group_by: str) -> None:
    objects, base, extras, in_order = case
    if in_order:  # a listing's order, which skips the builder's sort when it is the samples' order
        objects = sorted(objects, key=lambda o: o.uri)
    try:
        expected = normal(reference_group(objects, group_by, base=base, extras=extras))
    except ConfigError as exc:
        with pytest.raises(ConfigError) as got:
            group(objects, group_by, base=base, extras=extras)
        assert str(got.value) == str(exc)
        return
    index = group(objects, group_by, base=base, extras=extras)
    assert list(index) == expected
    assert [index[i] for i in range(-len(index), 0)] == expected
    assert list(index.sizes()) == [s.size for s in expected]
    assert index.total_bytes == sum(s.size for s in expected)
    assert list(loads(dumps(index))) == expected  # the saved form
    assert list(pickle.loads(pickle.dumps(index))) == expected
    assert list(SampleIndex.from_samples(expected)) == expected  # plain samples, order kept


def test_index_of_plain_samples_keeps_their_order_and_names() -> None:
    from s5loader._index.sample import Field

    samples = [
        Sample("z", (Field("odd", "s3://b/k1", 5, MD5), Field("x", "s3://c/other", 1, "w-1"))),
        Sample("a/b", (Field("data", "s3://b/a/b", 2, ""),), {"label": 3}),
    ]
    index = SampleIndex.from_samples(samples)
    assert list(index) == samples
    assert index[1].extra == {"label": 3} and index.largest() == 0


def test_local_ranks_share_one_index_through_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    from s5loader import IndexShareError, NoSuchBucketError
    from s5loader._index.share import shared_index

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("S5LOADER_INDEX_TIMEOUT", "0.2")
    what: list[str | None] = ["prefix", "s3://b/p/", None, "stem"]
    index = group([ObjectInfo("s3://b/p/1.jpg", "p/1.jpg", 3, MD5)], "stem", base="p/")

    def never() -> SampleIndex:
        raise AssertionError("a local rank other than 0 built the index")

    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(IndexShareError, match=r"waited 0.2s for local rank 0 .* s3://b/p/"):
        shared_index(never, what)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert shared_index(lambda: index, what) is index
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert list(shared_index(never, what)) == list(index)
    assert not list((tmp_path / f"s5loader-index-{os.getuid()}").iterdir())  # the last reader removed it

    def fails() -> SampleIndex:
        raise NoSuchBucketError("s3://b/p/: NoSuchBucket")

    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(NoSuchBucketError):
        shared_index(fails, what)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(
        NoSuchBucketError, match="local rank 0 could not build the index: s3://b/p/: NoSuchBucket"
    ):
        shared_index(never, what)


def test_local_ranks_share_a_shard_list_as_json_never_a_pickle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    from s5loader import IndexShareError
    from s5loader._index.share import shared_object
    from s5loader._shards.index import Shard

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    what: list[str | None] = ["shards", "s3://b/s/", None]
    value = ([Shard("s3://b/s/0.tar", 10240, "e", 3)], "s3://b/s/wids.json", {"shuffled": True})

    def plain(v):  # type: ignore[no-untyped-def]
        return [[list(sh) for sh in v[0]], v[1], v[2]]

    def back(p):  # type: ignore[no-untyped-def]
        return [Shard(*sh) for sh in p[0]], p[1], p[2]

    monkeypatch.setenv("LOCAL_RANK", "0")
    assert shared_object(lambda: value, what, plain, back) is value
    (written,) = list((tmp_path / f"s5loader-index-{os.getuid()}").iterdir())
    assert written.read_bytes().startswith(b"[[[")  # JSON, not a pickle
    monkeypatch.setenv("LOCAL_RANK", "1")
    got = shared_object(lambda: (_ for _ in ()).throw(AssertionError("built twice")), what, plain, back)
    assert got == value and isinstance(got[0][0], Shard)
    # a file that is no JSON of that shape is an error, never code
    monkeypatch.setenv("LOCAL_RANK", "0")
    shared_object(lambda: value, what, plain, back)
    (written,) = list((tmp_path / f"s5loader-index-{os.getuid()}").iterdir())
    written.write_bytes(b"\x80\x04K\x01.")  # a pickle of 1
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(IndexShareError, match="not a shared value"):
        shared_object(lambda: value, what, plain, back)


def test_manifest_fast_lines_read_as_json_does(tmp_path: Path) -> None:
    from s5loader._index.manifest import index_manifest

    lines = [
        '{"uri": "s3://bk/p/1.jpg", "size": 3, "etag": "' + MD5 + '"}',  # the usual shape
        '{"uri":"s3://bk/p/1.cls","size":0}',
        '  {"uri": "s3://bk/p/é 2.jpg", "size": 12}  ',
        '{"uri": "s3://bk/p/2\\u00e9.jpg", "size": 5, "etag": "\\"' + MD5 + '\\""}',  # escapes: json
        '{"size": 4, "uri": "s3://bk/p/3.jpg"}',  # another key order
        '{"uri": "s3://bk/p/4.jpg", "size": 7, "etag": "x-2", "label": 4}',  # extra fields
        "",
    ]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    objects, extras = [], {}
    for line in filter(None, lines):
        rec = json.loads(line)
        uri = rec.pop("uri")
        objects.append(ObjectInfo(uri, uri.split("/", 3)[3], rec.pop("size"), rec.pop("etag", "").strip('"')))
        extras[uri] = rec
    for group_by in GROUP_BY:
        got = list(index_manifest(str(manifest), None, group_by))
        assert got == normal(reference_group(objects, group_by, extras=extras))
    manifest.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[0] + "\n")
    with pytest.raises(ManifestError, match=r"m.jsonl: s3://bk/p/1.jpg is listed twice"):
        index_manifest(str(manifest), None, "object")
    manifest.write_text('{"uri": "s3://bk/p/", "size": 0}\n')
    with pytest.raises(ManifestError, match="line 1: 's3://bk/p/' names no object"):
        index_manifest(str(manifest), None, "object")


def test_the_engine_reads_sizes_and_fields_from_the_index_as_from_its_samples() -> None:
    from s5loader._engine.schedule import field_of, sample_sizes
    from s5loader._index.sample import DISK, Field

    samples = [
        Sample(f"k{i}", tuple(Field(n, f"s3://b/k{i}.{n}", 10 * i + j, "") for j, n in enumerate(names)))
        for i, names in enumerate(["", "a", "ab"] * 2 + ["a"])
    ]
    index = SampleIndex.from_samples(samples)
    with_disk = SampleIndex.from_samples(
        [Sample(s.key, s.fields, {DISK: 1000 + i}) for i, s in enumerate(samples)]
    )
    for seq in (samples, index, with_disk):
        size = sample_sizes(seq)
        assert [size(i) for i in range(7)] == [seq[i].size for i in range(7)]
        fields = [(i, j) for i in range(7) for j in range(len(seq[i].fields))]
        assert len(fields) == 7 and all(field_of(seq, i, j) == seq[i].fields[j] for i, j in fields)
    assert sample_sizes(with_disk)(3) == 1003  # a DISK extra is the sample's size
