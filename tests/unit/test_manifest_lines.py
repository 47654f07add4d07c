"""Manifest lines read by the fast path (a regex for the usual shape, extra fields of plain
scalars such as a label) give exactly the index the full path (``json.loads``) gives: the same
samples, the same extra values of the same types, the same saved bytes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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
]


def _index(path: Path, full_path_only: bool, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    with monkeypatch.context() as m:
        if full_path_only:
            m.setattr(listing, "_FAST_LINE", re.compile(r"(?!)"))
        return index_manifest(str(path), None, "object")


def _view(index) -> list:  # type: ignore[no-untyped-def]
    out = []
    for i in range(len(index)):
        s = index[i]
        extra = s.extra
        out.append((s.key, [tuple(f) for f in s.fields], extra, {k: type(v) for k, v in (extra or {}).items()}))
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
