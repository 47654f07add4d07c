"""``s5loader bench`` without a server: argument errors, missing extras named, peers that
cannot run reported as skipped with what to do, and the runtime package holding none of the
benchmark."""

from __future__ import annotations

import os
import sys

import pytest

from s5loader.cli import main as cli_main
from s5loader_bench import cli as bench
from s5loader_bench import methods as bench_methods
from s5loader_bench.methods import Context, Settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "source"),
        (["bucket/prefix"], "SOURCE must be an s3://"),
        (["s3://b/p/", "--steps", "0"], "--steps"),
        (["s3://b/p/", "--steps", "3", "--seconds", "2"], "not allowed with argument"),
        (["s3://b/p/", "--seconds", "-1"], "--seconds"),
        (["s3://b/p/", "--batch-size", "many"], "--batch-size"),
        (["s3://b/p/", "--num-workers", "-2"], "--num-workers"),
        (["s3://b/p/", "--methods", "s5loader,bogus"], "unknown method 'bogus'"),
        (["s3://b/p/", "--budget", "lots"], "--budget"),
        (["s3://b/p/", "--generate", "0"], "--generate"),
        (["s3://b/p/", "--generate", "5", "--sample-size", "big"], "--sample-size"),
        (["s3://b/p/", "--shards-prefix", "/tmp/shards"], "--shards-prefix must be an s3://"),
        (["s3://b/p/", "--prices", "PUT=0.005"], "KIND one of GET, HEAD, LIST, other"),
        (["s3://b/p/", "--prices", "GET=free"], "'free' is not a number"),
        (["s3://b/p/", "--prices", "LIST=-1"], "a price must be 0 or more"),
        (["s3://b/p/", "--first-batch", "--steps", "3"], "not allowed with argument"),
    ],
)
def test_argument_errors(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "usage: s5loader bench" in err


def test_argument_error_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "s3://b/p/", "--methods", "nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err


def test_plot_without_matplotlib_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert bench.main(["s3://b/p/", "--plot", "x.png"]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install 's5loader[bench]'" in err


def test_counting_needs_a_plain_http_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["s3://b/p/", "--count-requests", "--endpoint-url", "https://s3.example.com"]) == 2
    assert "need a plain http:// endpoint" in capsys.readouterr().err
    assert bench.main(["s3://b/p/", "--delay-ms", "-1", "--endpoint-url", "http://127.0.0.1:1"]) == 2
    assert "--delay-ms must be 0 or more" in capsys.readouterr().err


def test_missing_bench_dependency_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [m for m in sys.modules if m == "s5loader_bench" or m.startswith("s5loader_bench.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil -> ModuleNotFoundError
    assert cli_main(["bench", "s3://b/p/"]) == 1
    err = capsys.readouterr().err
    assert "needs psutil" in err and "pip install 's5loader[bench]'" in err
    monkeypatch.setitem(sys.modules, "s5loader_bench", None)
    assert cli_main(["bench", "s3://b/p/"]) == 1
    err = capsys.readouterr().err
    assert "s5loader_bench is not installed" in err and "pip install 's5loader[bench]'" in err


def _installed(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def _offline_context(tmp_path, **settings: object) -> Context:
    """A Context for methods whose shard listing a test replaces (no store, no index)."""
    s = Settings(source="s3://my-bucket/train/", steps=3, batch_size=2, **settings)  # type: ignore[arg-type]
    return Context(s, None, "s5cmd", None, str(tmp_path))  # type: ignore[arg-type]


def test_no_shards_note_points_at_shards_prefix_first(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user with their own bucket needs --shards-prefix (their shards); --generate only writes a
    synthetic data set."""
    monkeypatch.setattr(bench_methods, "list_uris", lambda ctx, prefix: [])
    shard_methods = ["s5loader-shards", "s5loader-iterable"] + (
        ["webdataset"] if _installed("webdataset") else []
    )
    for prefix, default in ((None, True), ("s3://my-bucket/tars/", False)):
        ctx = _offline_context(tmp_path, shards_prefix=prefix)
        for m in shard_methods:
            f = bench_methods.measure(m, ctx)
            assert f.status == "skipped", (m, f.note)
            assert f.note.startswith(f"no tar shards under {prefix or 's3://my-bucket/train-shards/'}")
            assert "point --shards-prefix at" in f.note
            assert f.note.index("--shards-prefix") < f.note.index("--generate")
            assert "synthetic" in f.note[f.note.index("--generate") - 60 :]
            assert ("(the default" in f.note) is default


def test_runtime_package_ships_no_benchmark() -> None:
    """The benchmark's code lives in s5loader_bench and its needs in the bench extra."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    runtime = {d.split(">")[0].split("[")[0].strip() for d in project["dependencies"]}
    assert runtime.isdisjoint({"psutil", "matplotlib", "webdataset", "s3torchconnector"})
    assert {"psutil", "matplotlib", "s3torchconnector"} <= {
        d.split(">")[0].strip() for d in project["optional-dependencies"]["bench"]
    }
    package = os.path.join(ROOT, "s5loader")
    for name in os.listdir(package):
        if name.endswith(".py"):
            text = open(os.path.join(package, name)).read()
            assert "bench" not in name and "import psutil" not in text and "matplotlib" not in text, name
    bench_package = os.path.join(ROOT, "bench", "s5loader_bench")
    for name in os.listdir(bench_package):
        if name.endswith(".py"):  # the public API only
            text = open(os.path.join(bench_package, name)).read()
            assert "s5loader._" not in text and "from s5loader." not in text, name
