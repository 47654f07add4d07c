"""How a large object is cut into parts (checkpoints, dcp, fetch): sizes from the object's size,
S3's limits kept, the caller's choice kept, a streamed upload that outgrows its estimate.

Private modules (``s5loader._largeobj``) are imported on purpose: their own behaviour is what
these tests check."""

from __future__ import annotations

import hashlib
import os

import pytest

from s5loader import ChecksumError
from s5loader._largeobj.fetch_sources import natural_key
from s5loader._largeobj.parts import (
    DEFAULT_CONCURRENCY,
    MAX_PARTS,
    MIN_PART,
    STREAM_PART_GROWTH,
    plan_parts,
    stream_part_size,
)
from s5loader._largeobj.verify import Checker, parse_md5_file

MiB = 1024**2
GiB = 1024**3


@pytest.mark.parametrize(
    ("size", "part_mib", "parts"),
    [
        (1 * GiB, 16, 64),  # at least 64 parts for 1 GiB
        (256 * MiB, 5, 52),  # 4 MiB would be below S3's minimum
        (4 * GiB, 64, 64),
        (40 * GiB, 64, 640),  # no part above 64 MiB unless asked
        (1024 * GiB, 105, 9987),  # 64 MiB parts would need more than 10,000
    ],
)
def test_part_size_from_the_object_size(size: int, part_mib: int, parts: int) -> None:
    plan = plan_parts(size)
    assert (plan.part_mib, plan.parts) == (part_mib, parts)
    assert plan.parts <= MAX_PARTS and plan.part_size * plan.parts >= size
    assert plan.concurrency == DEFAULT_CONCURRENCY


@pytest.mark.parametrize("size", [0, 1, 5 * MiB, 5 * MiB + 1, 100 * MiB])
def test_small_objects_take_few_parts_and_no_idle_slots(size: int) -> None:
    plan = plan_parts(size)
    assert plan.part_size >= MIN_PART
    assert plan.parts == max(1, -(-size // plan.part_size))
    assert plan.concurrency == min(DEFAULT_CONCURRENCY, plan.parts)


def test_the_callers_part_size_and_concurrency_are_kept_within_s3s_limits() -> None:
    assert plan_parts(GiB, part_size=32 * MiB, concurrency=4) == plan_parts(
        GiB, part_size=32 * MiB - 5, concurrency=4
    )
    plan = plan_parts(GiB, part_size=32 * MiB, concurrency=4)
    assert (plan.part_mib, plan.parts, plan.concurrency) == (32, 32, 4)
    assert plan_parts(GiB, part_size=1).part_size == MIN_PART  # raised to S3's minimum
    assert plan_parts(100 * GiB, part_size=5 * MiB).parts <= MAX_PARTS  # raised to fit 10,000 parts
    assert plan_parts(GiB, concurrency=0).concurrency == DEFAULT_CONCURRENCY


def test_a_streamed_upload_far_beyond_its_estimate_still_fits() -> None:
    base = plan_parts(1 * MiB).part_size  # an estimate that saw almost nothing
    assert [stream_part_size(base, n) for n in (1, STREAM_PART_GROWTH, STREAM_PART_GROWTH + 1)] == [
        base,
        base,
        2 * base,
    ]
    total = sum(stream_part_size(base, n) for n in range(1, MAX_PARTS + 1))
    assert total > 300 * 10**9  # 10,000 parts from 5 MiB hold more than 300 GB


def test_a_large_copy_out_of_a_loaded_buffer_goes_through_torch_and_is_exact(monkeypatch) -> None:
    """``ArrivingFile`` hands ``torch.load`` a record with torch's ``copy_`` (the GIL released,
    so the receiving threads go on) where torch is loaded and the record is large; otherwise,
    and into read-only memory (an error as before), with a plain memoryview copy."""
    import sys

    import torch

    from s5loader._largeobj import ranged

    src = memoryview(bytearray(range(256)) * (12 * 1024 + 7))  # 3 MiB and a bit
    calls: list[int] = []
    real = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, s: (calls.append(s.numel()), real(t, s))[1])
    for pos, n in ((0, 2 * MiB), (12345, ranged.COPY_OUTSIDE_GIL), (5, 1000)):
        out = bytearray(n + 3)
        ranged._copy(memoryview(out), src, pos, n)
        assert out[:n] == src[pos : pos + n] and out[n:] == b"\0\0\0"
    assert calls == [2 * MiB, ranged.COPY_OUTSIDE_GIL]  # the small copy did not go through torch
    with pytest.raises(TypeError):
        ranged._copy(memoryview(bytes(2 * MiB)), src, 0, 2 * MiB)
    monkeypatch.delitem(sys.modules, "torch")
    out = bytearray(2 * MiB)
    ranged._copy(memoryview(out), src, 7, 2 * MiB)
    assert out == src[7 : 7 + 2 * MiB] and len(calls) == 2


def test_md5_files_and_etags_units() -> None:
    text = "d41d8cd98f00b204e9800998ecf8427e  a.part00\n0cc175b9c0f1b6a831c399e269772661 *a.part01\n"
    assert parse_md5_file(text, "a.part01") == "0cc175b9c0f1b6a831c399e269772661"
    assert parse_md5_file(text, "other") is None
    assert (
        parse_md5_file("d41d8cd98f00b204e9800998ecf8427e  whatever\n", "x")
        == "d41d8cd98f00b204e9800998ecf8427e"
    )
    data = os.urandom(20 * MiB + 5)
    parts = [data[i : i + 8 * MiB] for i in range(0, len(data), 8 * MiB)]
    etag = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest() + "-3"
    ok = Checker("s3://b/k", len(data), etag)
    ok.update(data[:12345])
    ok.update(data[12345:])
    ok.check()  # the part size (8 MiB) is guessed from the size and the part count
    bad = Checker("s3://b/k", len(data), etag)
    bad.update(bytes([data[0] ^ 0xFF]) + data[1:])  # always differs from data
    with pytest.raises(ChecksumError, match="s3://b/k: the bytes do not match its multipart ETag"):
        bad.check()
    short = Checker("s3://b/k", len(data), etag)
    short.update(data[:-1])
    with pytest.raises(ChecksumError, match="got 20971524 bytes, the listing says 20971525"):
        short.check()
    assert sorted(["v10", "v2", "v1"], key=natural_key) == ["v1", "v2", "v10"]
