"""The tar scan reads plain ustar headers itself and leaves the rest to tarfile: on every tar
(ustar, GNU and pax formats, long and non-ASCII names, folders, links, empty files, damaged
headers, cut tars) it gives exactly what tarfile alone gives, samples or error.

Private modules (``s5loader._shards``) are imported on purpose: their own behaviour is what
these tests check."""

from __future__ import annotations

import io
import random
import tarfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from s5loader._shards import headers as _headers
from s5loader._shards import tar as _tar
from s5loader.exceptions import S5LoaderError

URI = "s3://b/shard.tar"

names = st.sampled_from(
    ["0001", "d/0001", "a" * 90 + "/x", "d" * 120 + "/0002", "b" * 101, "ü/ñ", "0003.seg", "dir/", "x/y/z"]
)
members = st.lists(
    st.tuples(
        names,
        st.sampled_from(["jpg", "cls", "JSON", "", "/"]),
        st.sampled_from(
            [
                tarfile.REGTYPE,
                tarfile.AREGTYPE,
                tarfile.DIRTYPE,
                tarfile.SYMTYPE,
                tarfile.LNKTYPE,
                tarfile.FIFOTYPE,
            ]
        ),
        st.integers(0, 1500),
    ),
    max_size=12,
)


def make_tar(items: list[tuple[str, str, bytes, int]], fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for k, (stem, ext, kind, size) in enumerate(items):
            name = stem + "/" if ext == "/" else f"{stem}.{ext}" if ext else f"{stem}{k}"
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                info.linkname = "elsewhere"
            data = bytes([k % 251]) * size if kind in (tarfile.REGTYPE, tarfile.AREGTYPE) else b""
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def outcome(data: bytes) -> object:
    try:
        return _tar.scan_bytes(data, URI)
    except S5LoaderError as exc:
        return (type(exc).__name__, str(exc))


def by_tarfile(data: bytes, monkeypatch: pytest.MonkeyPatch) -> object:
    with monkeypatch.context() as m:
        m.setattr(_headers._Ustar, "__iter__", lambda self: iter(()))  # every header to tarfile
        return outcome(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    items=members,
    fmt=st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
    damage=st.one_of(st.none(), st.tuples(st.integers(0, 1 << 16), st.integers(0, 255))),
    cut=st.one_of(st.none(), st.integers(0, 1 << 16)),
)
def test_the_scan_gives_what_tarfile_gives(items, fmt, damage, cut, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        data = make_tar(items, fmt)
    except ValueError:  # a name the format cannot hold (ustar: over 256 bytes)
        return
    if damage is not None:
        at, value = damage
        b = bytearray(data)
        b[at % len(b)] = value
        data = bytes(b)
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    assert outcome(data) == by_tarfile(data, monkeypatch)


def test_plain_headers_are_read_without_tarfile_and_others_are_handed_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = make_tar(
        [
            ("0001", "jpg", tarfile.REGTYPE, 700),
            ("0001", "cls", tarfile.REGTYPE, 1),
            ("d" * 120 + "/0002", "jpg", tarfile.REGTYPE, 3),
        ],
        tarfile.USTAR_FORMAT,
    )
    # a pax header for a non-ASCII name in the middle: tarfile reads from that header on
    pax = make_tar(
        [
            ("0001", "jpg", tarfile.REGTYPE, 700),
            ("ü", "jpg", tarfile.REGTYPE, 5),
            ("0003", "jpg", tarfile.REGTYPE, 5),
        ],
        tarfile.PAX_FORMAT,
    )
    opened: list[int] = []
    real_open = tarfile.open

    def counting_open(*a, **k):  # type: ignore[no-untyped-def]
        opened.append(k["fileobj"].tell())
        return real_open(*a, **k)

    monkeypatch.setattr(tarfile, "open", counting_open)
    got = _tar.scan_bytes(plain, URI)
    assert [s.key for s in got] == ["0001", "d" * 120 + "/0002"] and opened == []
    got = _tar.scan_bytes(pax, URI)
    assert [s.key for s in got] == ["0001", "ü", "0003"] and opened == [512 + 1024]
    assert got[1].members[0].offset == 512 + 1024 + 512 + 512 + 512  # pax header, its record, the header


def test_a_random_shard_scan_matches_tarfile_member_for_member() -> None:
    rnd = random.Random(5)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for j in range(300):
            for ext in ("jpg", "cls"):
                data = rnd.randbytes(rnd.randrange(0, 5000))
                info = tarfile.TarInfo(f"train/{j:05d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    want = [(m.name, m.offset_data, m.size) for m in tarfile.open(fileobj=io.BytesIO(data)).getmembers()]
    got = [(f"{s.key}.{m.field}", m.offset, m.size) for s in _tar.scan_bytes(data, URI) for m in s.members]
    assert got == want
