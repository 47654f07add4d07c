"""Unit and property tests: sizes, URIs, grouping, s5cmd command lines, the order across ranks
and after an elastic resume, finding and configuring s5cmd, a file's footprint on disk.

Private modules (``s5loader._index``, ``s5loader._sampling``, ``s5loader._util``,
``s5loader._s5cmd``, ``s5loader._staging``) are imported on purpose: their own behaviour is what
these tests check."""

from __future__ import annotations

import os
import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s5loader import BudgetError, ConfigError, S3URIError, parse_size
from s5loader._index.listing import group
from s5loader._s5cmd import ObjectInfo, copy_line, wildcard_line
from s5loader._sampling.order import Order
from s5loader._staging.layout import field_names


def test_parse_size() -> None:
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("500MB") == 500 * 1000**2
    assert parse_size("1.5k") == 1500
    assert parse_size(4096) == 4096
    for bad in ("", "lots", "-1", "1XB", 0, -5, True, 1.5):
        with pytest.raises(ConfigError):
            parse_size(bad)  # type: ignore[arg-type]


def test_parse_uri() -> None:
    from s5loader._util.uri import parse_s3_uri

    assert parse_s3_uri("s3://b-1/a/b c") == ("b-1", "a/b c")
    for bad in ("b/k", "s3:/b/k", "s3://", "s3://-b/k", "http://b/k", 3):
        with pytest.raises(S3URIError):
            parse_s3_uri(bad)  # type: ignore[arg-type]


def test_group_by_modes() -> None:
    objs = [
        ObjectInfo(f"s3://b/{k}", k, 1, "")
        for k in ("p/0001.jpg", "p/0001.cls", "p/0002.jpg", "p/README", "p/f1/x.txt", "p/f1/sub/y.bin")
    ]
    stem = group(objs, "stem", "p/")
    assert [s.key for s in stem] == ["p/0001", "p/0002", "p/f1/sub/y", "p/f1/x"]
    assert [f.name for f in stem[0].fields] == ["cls", "jpg"]
    folder = group(objs, "folder", "p/")
    assert [(s.key, [f.name for f in s.fields]) for s in folder] == [("p/f1", ["sub/y.bin", "x.txt"])]
    assert len(group(objs, "object", "p/")) == 6
    with pytest.raises(ConfigError):
        group(objs, "shard")


@given(st.text(min_size=1, max_size=60).filter(lambda k: "\n" not in k and "\r" not in k and "\x00" not in k))
def test_copy_line_is_one_command_whatever_the_key(key: str) -> None:
    uri = f"s3://bucket/{key}"
    line = copy_line(uri, "/stage/1/data")
    assert line.endswith("\n") and line.count("\n") == 1
    assert shlex.split(line) == ["cp", "--raw", uri, "/stage/1/data"]
    assert shlex.split(wildcard_line(uri + "*", "/stage/.b1/")) == [
        "cp",
        "--exclude",
        "*..*",
        uri + "*",
        "/stage/.b1/",
    ]


def test_copy_line_refuses_line_breaks() -> None:
    with pytest.raises(ValueError):
        copy_line("s3://b/a\nrm s3://b/x", "/stage/1/data")


def test_field_names_never_leave_the_sample_folder() -> None:
    from s5loader._index.sample import Field, Sample

    def names(*fields: str) -> list[str]:
        return field_names(Sample("k", tuple(Field(f, "s3://b/k", 1, "") for f in fields)))

    assert names("image", "label") == ["image", "label"]
    assert names("sub/x.txt") == ["sub/x.txt"]
    for bad in (("..", "x"), ("../x",), ("/abs",), ("a//b",), (".hidden",), ("x" * 300,), ("A", "a")):
        assert names(*bad) == [f"_{j}" for j in range(len(bad))]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 60),
    world=st.integers(1, 5),
    epoch=st.integers(0, 3),
    drop_last=st.booleans(),
    shuffle=st.sampled_from([True, False, "block"]),
    block=st.integers(1, 7),
)
def test_every_index_once_across_ranks(
    n: int, world: int, epoch: int, drop_last: bool, shuffle, block: int
) -> None:
    units = [list(range(i, min(i + block, n))) for i in range(0, n, block)]
    parts = [
        Order(shuffle, 11, world, r, drop_last).indices(n, epoch, units=units, window=5) for r in range(world)
    ]
    sizes = {len(p) for p in parts}
    assert len(sizes) == 1  # all ranks yield the same count
    flat = [i for p in parts for i in p]
    if drop_last:
        assert len(set(flat)) == len(flat) == (n // world) * world
    else:
        assert set(flat) == set(range(n)) and len(flat) == -(-n // world) * world
    assert parts == [
        Order(shuffle, 11, world, r, drop_last).indices(n, epoch, units=units, window=5) for r in range(world)
    ]


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 50), w1=st.integers(1, 4), w2=st.integers(1, 4), k=st.integers(0, 20))
def test_elastic_resume_continues_the_global_order(n: int, w1: int, w2: int, k: int) -> None:
    full = Order(True, 3, 1, 0, False).indices(n, 0)
    k = min(k, n // w1)
    start = k * w1
    rest = [Order(True, 3, w2, r, False).indices(n, 0, start) for r in range(w2)]
    # dealt round-robin: interleaving the ranks' parts gives back the global order, padded
    interleaved = [p[i] for i in range(len(rest[0])) for p in rest]
    assert interleaved[: n - start] == full[start:]
    assert set(interleaved[n - start :]) <= set(full[start:])


def test_finds_the_wheel_binary_not_the_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    from s5loader import find_s5cmd

    monkeypatch.delenv("S5LOADER_S5CMD", raising=False)
    path = find_s5cmd()
    assert path.endswith(os.path.join("s5cmd", "bin", "s5cmd"))
    with open(path, "rb") as f:
        assert f.read(4) == b"\x7fELF"  # the Go binary, not the Python wrapper script


def test_endpoint_with_credentials_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from s5loader.config import resolve_endpoint

    with pytest.raises(ConfigError, match="carries credentials"):
        resolve_endpoint("http://AKID:secret@127.0.0.1:9000")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://u:p@host")
    with pytest.raises(ConfigError):
        resolve_endpoint(None)
    assert resolve_endpoint("http://127.0.0.1:9000") == "http://127.0.0.1:9000"


def test_s5cmd_environment_tunes_go_and_keeps_the_users_settings(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from s5loader._s5cmd import S5cmd

    monkeypatch.delenv("GOGC", raising=False)
    monkeypatch.delenv("GOMEMLIMIT", raising=False)
    env = S5cmd().env()
    assert (env["GOGC"], env["GOMEMLIMIT"]) == ("400", "512MiB")
    monkeypatch.setenv("GOGC", "100")
    assert S5cmd().env()["GOGC"] == "100"


def test_disk_footprint_counts_whole_blocks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from s5loader._staging.area import choose_root, disk_footprint

    assert disk_footprint([4096, 8192]) == 1.0
    assert disk_footprint([20000, 1]) == (20480 + 4096) / 20001
    assert disk_footprint([]) == 1.0
    free = os.statvfs(str(tmp_path)).f_bavail * os.statvfs(str(tmp_path)).f_frsize
    need = free // 2
    assert choose_root(str(tmp_path), need)[1] == need  # fits as object bytes
    with pytest.raises(BudgetError, match="on disk in whole blocks"):
        choose_root(str(tmp_path), need, footprint=4.0)  # but not in whole blocks
    _, shrunk = choose_root(str(tmp_path), need, shrink=True, footprint=4.0)
    # other processes free and fill the disk meanwhile: compare with the most it had
    most = max(free, os.statvfs(str(tmp_path)).f_bavail * os.statvfs(str(tmp_path)).f_frsize)
    assert shrunk * 4.0 <= most * 0.9
