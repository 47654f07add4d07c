"""Manifest lines read by the fast paths (chunks of lines of the usual shape read a column at a
time, or single lines read by a regex, extra fields of plain scalars such as a label) give
exactly the index the full path (``json.loads``) gives: the same samples, the same extra values
of the same types, the same saved bytes, the same errors.

Private modules (``s5loader._index``) are imported on purpose: their own behaviour is what these
tests check."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from s5loader._index import manifest as listing
from s5loader._index.manifest import index_manifest
from s5loader._index.saved import index_bytes

URI = "s3://bucket/train/{i:04d}.jpg"
LINES = [
    '{{"uri": "{u}", "size": 10, "etag": "abc", "label": 3}}',
    '{{"uri": "{u}", "size": 10, "label": -7}}',
    '{{"uri":"{u}","size":10,"etag":"e","label":0,"split":"train"}}',
    '{{ "uri" : "{u}" , "size" : 0 , "label" : 1.5 }}',
    '{{"uri": "{u}", "size": 10, "score": 1e3, "w": -0.25E-2, "z": -0}}',
    '{{"uri": "{u}", "size": 10, "ok": true, "bad": false, "none": null}}',
    '{{"uri": "{u}", "size": 10, "name": "caf\\u00e9"}}',  # an escape: the full path
    '{{"uri": "{u}", "size": 10, "name": "café"}}',  # not ASCII: the full path
    '{{"uri": "{u}", "size": 10, "label": 2, "label": 5}}',  # a field twice: the last wins
    '{{"uri": "{u}", "size": 10, "label": 1, "etag": "late"}}',  # a known field after an extra
    '{{"uri": "{u}", "size": 10, "big": 1e400}}',  # out of float range
    '{{"uri": "{u}", "size": 10, "list": [1, 2]}}',  # not a scalar
    '{{"uri": "{u}", "size": 10, "nested": {{"a": 1}}}}',
    '{{"uri": "{u}", "size": 10, "": 4}}',  # an empty key
    '{{"uri": "{u}", "size": 10, "sp ace": "a b", "punct": "!#$%&()*+,-./:;<=>?@[]^_`{{|}}~"}}',
    '{{"uri": "{u}", "size": 10, "label": 12345678901234567890}}',
    '\t{{"uri": "{u}",\t"size": 10, "label": 3}}\t',
    '{{"uri": "{u}", "size": 10, "label": 3}}\r',
    '{{"uri": "{u}", "size": 10, "label": 3}} trailing',  # not JSON: an error either way
    '{{"uri": "{u}", "size": 10, "size": 11}}',  # a known field twice: the last wins
    '{{"uri": "s3://bucket/elsewhere.jpg", "size": 10, "uri": "{u}"}}',
    '{{"uri": "{u}", "size": 10, "etag": "a", "etag": "b", "label": null}}',
    '{{"uri": "{u}", "size": 10, "f": -0.0, "g": 1E+2, "h": 0.5e-3, "s": "", "t": "null"}}',
]


MODES = ("chunks", "lines", "full")


def _index(path: Path, mode: str | bool, monkeypatch: pytest.MonkeyPatch, group_by: str = "object"):  # type: ignore[no-untyped-def]
    """The index by one path: ``chunks`` (all fast paths), ``lines`` (no chunk read a column at
    a time) or ``full`` (json.loads on every line)."""
    mode = {True: "full", False: "chunks"}.get(mode, mode)  # type: ignore[call-overload]
    off = {"chunks": (), "lines": ("_CANON_LINES", "_LOOSE_LINES")}.get(
        mode, ("_FAST_LINE", "_CANON_LINES", "_LOOSE_LINES")
    )
    with monkeypatch.context() as m:
        for name in off:
            m.setattr(listing, name, re.compile(r"(?!)"))
        return index_manifest(str(path), None, group_by)


def _view(index) -> list:  # type: ignore[no-untyped-def]
    out = []
    for i in range(len(index)):
        s = index[i]
        extra = s.extra
        out.append(
            (s.key, [tuple(f) for f in s.fields], extra, {k: type(v) for k, v in (extra or {}).items()})
        )
    return out


@pytest.mark.parametrize("template", LINES)
def test_one_shape_of_line_reads_the_same_on_both_paths(
    template: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(template.format(u=URI.format(i=i)) for i in range(3)) + "\n")
    results = []
    for full in (False, True):
        try:
            index = _index(path, full, monkeypatch)
        except Exception as exc:  # noqa: BLE001 - both paths must fail alike
            results.append(("error", type(exc).__name__))
            continue
        results.append(("ok", _view(index), index_bytes(index)))
    assert results[0] == results[1]


def test_a_manifest_of_mixed_lines_reads_the_same_on_both_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = [t for t in LINES if "trailing" not in t]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(good[i % len(good)].format(u=URI.format(i=i)) + "\n" for i in range(200)))
    fast, full = _index(path, False, monkeypatch), _index(path, True, monkeypatch)
    assert _view(fast) == _view(full)
    assert index_bytes(fast) == index_bytes(full)
    assert fast[0].extra == {"label": 3}


def test_a_labelled_line_takes_the_fast_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the full path must not run for the usual labelled line: json.loads is not called
    path = tmp_path / "m.jsonl"
    path.write_text("".join(LINES[0].format(u=URI.format(i=i)) + "\n" for i in range(50)))

    def refuse(*args: object, **kwargs: object) -> object:
        raise AssertionError("the full path read a labelled line")

    monkeypatch.setattr(listing.json, "loads", refuse)
    index = index_manifest(str(path), None, "object")
    monkeypatch.undo()
    assert len(index) == 50 and index[7].extra == {"label": 3}


def _outcome(path: Path, mode: str, monkeypatch: pytest.MonkeyPatch, group_by: str = "object") -> tuple:
    try:
        index = _index(path, mode, monkeypatch, group_by)
    except Exception as exc:  # noqa: BLE001 - every path must fail alike
        return ("error", type(exc).__name__, str(exc))
    return ("ok", _view(index), index_bytes(index))


@pytest.mark.parametrize("group_by", ["object", "stem", "folder"])
@pytest.mark.parametrize("chunk", [64, 200, 1 << 20])
def test_chunks_of_lines_read_the_same_on_every_path(
    group_by: str, chunk: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # keys out of order, a key that is not ASCII, two buckets, ETags of every
    # kind, lines of both layouts: chunks small enough that some are read a column at a time
    # and some line by line
    lines = []
    for i in range(120):
        j = (i * 37) % 120
        sample, ext = j // 2, (".jpg", ".cls")[j % 2]
        uri = f"s3://{'bucket' if j < 100 else 'other'}/train/{('a', 'é', 'b')[sample % 3]}/{sample:04d}{ext}"
        etag = ("0123456789abcdef0123456789abcdef", "", "ABC", "0123456789abcdef0123456789abcdef-2")[i % 4]
        rec = {"uri": uri, "size": i, "etag": etag, "label": i % 3}
        if i % 5 == 0:
            del rec["etag"]
        if i % 11 == 0:
            lines.append(f'{{ "uri" : "{rec["uri"]}", "size":{rec["size"]}, "label": {rec["label"]} }}')
        else:
            lines.append(json.dumps(rec, ensure_ascii=i % 2 == 0))
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    monkeypatch.setattr(listing, "_CHUNK", chunk)
    outcomes = [_outcome(path, mode, monkeypatch, group_by) for mode in MODES]
    assert outcomes[0] == outcomes[1] == outcomes[2]
    assert outcomes[0][0] == "ok"


@pytest.mark.parametrize("sorted_keys", [True, False])
def test_a_key_listed_twice_is_the_same_error_on_every_path(
    sorted_keys: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [f"k/{i:03d}.jpg" for i in range(50)] + ["k/007.jpg"]
    if not sorted_keys:
        keys.reverse()
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"uri": f"s3://bkt/{k}", "size": 1, "label": 0}) + "\n" for k in keys))
    outcomes = [_outcome(path, mode, monkeypatch) for mode in MODES]
    assert outcomes[0] == outcomes[1] == outcomes[2]
    assert (
        outcomes[0][:2] == ("error", "ManifestError")
        and "s3://bkt/k/007.jpg is listed twice" in outcomes[0][2]
    )


def test_a_labelled_manifest_is_read_a_column_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # neither json.loads nor the builder's one-object add runs for the usual labelled manifest
    path = tmp_path / "m.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "uri": f"s3://bkt/train/{(i * 37) % 500:05d}.jpg",
                    "size": i,
                    "etag": f"{i:032x}",
                    "label": i % 10,
                }
            )
            + "\n"
            for i in range(500)
        )
    )

    def refuse(*args: object, **kwargs: object) -> object:
        raise AssertionError("a line was read one at a time")

    monkeypatch.setattr(listing.json, "loads", refuse)
    monkeypatch.setattr(listing.IndexBuilder, "add", refuse)
    index = index_manifest(str(path), None, "object")
    monkeypatch.undo()
    assert len(index) == 500
    assert [index[i].key for i in range(3)] == ["train/00000.jpg", "train/00001.jpg", "train/00002.jpg"]
    assert index[1].extra == {"label": 3}  # train/00001.jpg is line 473 (473 * 37 % 500 == 1)


@pytest.mark.parametrize("bad", ['"s3://bkt/train/"', '"s3://bkt/"', '"s3://-bk/k.jpg"', '"s3://bkt/a\\tb"'])
def test_a_bad_uri_among_good_lines_is_the_same_on_every_path(
    bad: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = [json.dumps({"uri": f"s3://bkt/k/{i:03d}.jpg", "size": 1, "label": 0}) for i in range(40)]
    lines[17] = f'{{"uri": {bad}, "size": 0, "label": 0}}'
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(lines) + "\n")
    outcomes = [_outcome(path, mode, monkeypatch) for mode in MODES]
    assert outcomes[0] == outcomes[1] == outcomes[2]
    if outcomes[0][0] == "error":
        assert "line 18" in outcomes[0][2]


# -- chunks read a column at a time under every grouping --------------------------------------------

LABELS = [3, -1, "cat", "", 0.25, -0.0, 1e20, True, False, None, 12345678901234567890]


def _pairs_manifest(path: Path, n: int, labels: list | None = None, same_label: bool = True) -> list[dict]:
    """``n`` samples of two objects each (``NNNN.jpg`` + ``NNNN.cls``, one folder per sample),
    lines out of order, a label on each line (the same on both objects of a sample, or not)."""
    recs = []
    for i in range(2 * n):
        j = (i * 37) % (2 * n)
        s, ext = j // 2, (".jpg", ".cls")[j % 2]
        label = (labels or LABELS)[(s if same_label else j) % len(labels or LABELS)]
        recs.append(
            {"uri": f"s3://bkt/train/{s:04d}/{s:04d}{ext}", "size": j, "etag": f"{j:032x}", "label": label}
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


@pytest.mark.parametrize("group_by", ["object", "stem", "folder"])
@pytest.mark.parametrize("same_label", [True, False])
def test_every_grouping_is_read_a_column_at_a_time(
    group_by: str, same_label: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # no line is read alone nor added alone, and the index is the full path's
    path = tmp_path / "m.jsonl"
    recs = _pairs_manifest(path, 120, same_label=same_label)
    full = _outcome(path, "full", monkeypatch, group_by)

    def refuse(*args: object, **kwargs: object) -> object:
        raise AssertionError("a line was read one at a time")

    with monkeypatch.context() as m:
        m.setattr(listing._ManifestReader, "add_line", refuse)
        m.setattr(listing.IndexBuilder, "add", refuse)
        index = index_manifest(str(path), None, group_by)
    assert ("ok", _view(index), index_bytes(index)) == full
    assert len(index) == {"object": 240, "stem": 120, "folder": 120}[group_by]
    if group_by != "object":
        s = index[7]
        assert s.key == ("train/0007/0007" if group_by == "stem" else "train/0007")
        assert [f.name for f in s.fields] == (
            ["cls", "jpg"] if group_by == "stem" else ["0007.cls", "0007.jpg"]
        )
        if same_label:
            assert s.extra == {"label": LABELS[7 % len(LABELS)]}
        else:  # both lines label the sample: the later line (in the manifest) wins
            later = max((n for n, r in enumerate(recs) if r["uri"].startswith("s3://bkt/train/0007/")))
            assert s.extra == {"label": recs[later]["label"]}


@pytest.mark.parametrize("group_by", ["object", "stem", "folder"])
def test_labels_keep_their_json_types_on_every_path(
    group_by: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.jsonl"
    _pairs_manifest(path, 30)
    outcomes = [_outcome(path, mode, monkeypatch, group_by) for mode in MODES]
    assert outcomes[0] == outcomes[1] == outcomes[2]
    got = {type(extra["label"]) for _, _, extra, _ in outcomes[0][1]}
    assert got == {int, str, float, bool, type(None)}
    values = [extra["label"] for _, _, extra, _ in outcomes[0][1]]
    assert 12345678901234567890 in values and any(v is True for v in values) and None in values


@pytest.mark.parametrize("group_by", ["object", "stem", "folder"])
@pytest.mark.parametrize("chunk", [150, 1 << 20])
def test_chunks_with_odd_lines_read_the_same_on_every_path(
    group_by: str, chunk: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # among lines of the usual shape: lines for json.loads, keys the grouping leaves out (no
    # extension, no folder), a key "/NAME.EXT", two buckets, ETags whose lengths add up to 32
    # each on average, a line without a label: some chunks are read a column at a time, some
    # line by line, and the index, the warning and the saved bytes are the same
    lines = []
    for i in range(90):
        j = (i * 7) % 90
        key = f"d{j % 4}/{j:03d}.{('jpg', 'cls', 'txt')[j % 3]}"
        rec: dict = {
            "uri": f"s3://{'bkt' if j < 80 else 'other'}/{key}",
            "size": j,
            "etag": f"{j:032x}",
            "label": j % 5,
        }
        if i % 17 == 3:
            rec["uri"] = f"s3://bkt/noext{j}" if i % 2 else f"s3://bkt/d9/noext{j}"
        if i == 40:
            rec["uri"] = "s3://bkt//slash.jpg"
        if i in (50, 51):
            rec["etag"] = "a" * 31 if i == 50 else "b" * 33
        if i % 13 == 5:
            del rec["label"]
        line = json.dumps(rec)
        if i % 19 == 7:
            line = json.dumps({"label": j % 5, **rec})  # another order of fields: json.loads reads it
        lines.append(line)
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(listing, "_CHUNK", chunk)
    outcomes = []
    for mode in MODES:
        with _warnings() as seen:
            outcomes.append((*_outcome(path, mode, monkeypatch, group_by), seen))
    assert outcomes[0] == outcomes[1] == outcomes[2]
    assert outcomes[0][0] == "ok"
    fields = [f for _, fs, _, _ in outcomes[0][1] for f in fs]
    assert ("a" * 31) in [f[3] for f in fields] and ("b" * 33) in [f[3] for f in fields]
    if group_by != "object":
        assert outcomes[0][3] and "left out" in outcomes[0][3][0]


class _warnings:
    """The builder's warnings while a manifest is read."""

    def __enter__(self) -> list[str]:
        import logging

        self.seen: list[str] = []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.seen.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("s5loader._index.builder").addHandler(self.handler)
        return self.seen

    def __exit__(self, *exc: object) -> None:
        import logging

        logging.getLogger("s5loader._index.builder").removeHandler(self.handler)


@pytest.mark.parametrize("group_by", ["object", "stem", "folder"])
@pytest.mark.parametrize("sorted_keys", [True, False])
def test_an_object_listed_twice_under_any_grouping_is_the_same_error(
    group_by: str, sorted_keys: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [f"k/{i:03d}/{i:03d}.{ext}" for i in range(40) for ext in ("cls", "jpg")] + ["k/007/007.jpg"]
    if not sorted_keys:
        keys.reverse()
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"uri": f"s3://bkt/{k}", "size": 1, "label": 0}) + "\n" for k in keys))
    outcomes = [_outcome(path, mode, monkeypatch, group_by) for mode in MODES]
    assert outcomes[0] == outcomes[1] == outcomes[2]
    assert (
        outcomes[0][:2] == ("error", "ManifestError")
        and "s3://bkt/k/007/007.jpg is listed twice" in outcomes[0][2]
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    keys=st.lists(st.text("ab./é", min_size=1, max_size=7), min_size=1, max_size=40, unique=True),
    labels=st.lists(
        st.one_of(
            st.integers(-3, 3),
            st.sampled_from(["x", "", None, True, 0.5]),
            st.text(max_size=3),
            st.lists(st.integers(0, 2), max_size=2),
        ),
        min_size=1,
    ),
    group_by=st.sampled_from(["object", "stem", "folder"]),
    chunk=st.sampled_from([40, 1 << 20]),
)
def test_any_keys_read_the_same_on_every_path(
    keys: list[str],
    labels: list,
    group_by: str,
    chunk: int,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path_factory.mktemp("m") / "m.jsonl"
    path.write_text(
        "".join(
            json.dumps({"uri": f"s3://bkt/{k}", "size": n, "label": labels[n % len(labels)]}) + "\n"
            for n, k in enumerate(keys)
        ),
        encoding="utf-8",
    )
    monkeypatch.setattr(listing, "_CHUNK", chunk)
    outcomes = [_outcome(path, mode, monkeypatch, group_by) for mode in MODES]
    assert outcomes[0] == outcomes[1] == outcomes[2]


def test_etags_of_other_lengths_are_kept_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # hex ETags of 31 and 33 characters among MD5 ones: 32 on average in the chunk, yet none is
    # an MD5 digest to be stored in 16 bytes (each is kept as the manifest gives it)
    etags = [f"{i:032x}" for i in range(10)] + ["a" * 31, "b" * 33]
    path = tmp_path / "m.jsonl"
    path.write_text(
        "".join(
            json.dumps({"uri": f"s3://bkt/k/{i:02d}.jpg", "size": 1, "etag": e}) + "\n"
            for i, e in enumerate(etags)
        )
    )
    outcomes = [_outcome(path, mode, monkeypatch) for mode in MODES]
    assert outcomes[0] == outcomes[1] == outcomes[2]
    assert [f[3] for _, fs, _, _ in outcomes[0][1] for f in fs] == etags


@pytest.mark.parametrize("group_by", ["object", "stem"])
def test_extras_beyond_plain_ascii_scalars_are_read_a_column_at_a_time(
    group_by: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # labels as json.dumps writes text beyond ASCII (escapes), the text itself, nested values,
    # a field twice, NaN: no line is read alone, and the index is the full path's
    extras = [
        {"label": "类别3"},
        {"label": "café", "w": [1, 2]},
        {"meta": {"a": None, "b": "x"}},
        {"v": float("nan")},
    ]
    lines = []
    for i in range(80):
        j = (i * 31) % 80
        rec = {
            "uri": f"s3://bkt/train/{j // 2:03d}.{('jpg', 'cls')[j % 2]}",
            "size": j,
            "etag": f"{j:032x}",
            **extras[j % 4],
        }
        lines.append(json.dumps(rec, ensure_ascii=i % 2 == 0))
    lines[5] = lines[5][:-1] + ', "label": "again"}'  # a field twice: the last one wins
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    full = _outcome(path, "full", monkeypatch, group_by)

    def refuse(*args: object, **kwargs: object) -> object:
        raise AssertionError("a line was read one at a time")

    with monkeypatch.context() as m:
        m.setattr(listing._ManifestReader, "add_line", refuse)
        m.setattr(listing.IndexBuilder, "add", refuse)
        index = index_manifest(str(path), None, group_by)
    assert full[0] == "ok" and (_view(index), index_bytes(index)) == (full[1], full[2])
    got = [s.extra for s in index]
    if group_by == "object":
        assert {"label": "类别3"} in got
    else:
        assert any(e and {"meta", "v"} <= set(e) for e in got)


@pytest.mark.parametrize(
    "tail",
    [
        ', "size": 5}',
        ', "uri": "s3://bkt/x.jpg"}',
        ', "\\u0075ri": "s3://bkt/x.jpg"}',
        ", }",
        ",}",
        ', "a": [1}',
        ', "a": 1}}',
        ', "a": 1} x',
        '} , "a": 1',
        ', "a": "\\ud800"}',
        ', "a": 1, "a": {"b": 2}}',
    ],
)
def test_a_tail_read_by_json_loads_is_what_the_full_path_reads(
    tail: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # known fields again, empty members, broken JSON, a lone surrogate: the same index or error
    lines = [json.dumps({"uri": f"s3://bkt/k/{i:02d}.jpg", "size": 1, "label": "é"}) for i in range(20)]
    lines[9] = f'{{"uri": "s3://bkt/k/09.jpg", "size": 1{tail}'
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(lines) + "\n")
    outcomes = [_outcome(path, mode, monkeypatch) for mode in MODES]
    assert outcomes[0] == outcomes[1] == outcomes[2]
