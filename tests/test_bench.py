"""``s5loader bench``: argument errors, ``--generate``, a short run of every method against a
real local S3 server, peers reported as skipped when absent, the tree CPU monitor and its
split by process kind, the latency proxy and its request counts, ``--steps`` bounding every
method, and the runtime package loading none of it. No timing assertions."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Iterator

import boto3
import pytest

from s5loader.cli import main as cli_main
from s5loader_bench import cli as bench
from s5loader_bench import methods as bench_methods
from s5loader_bench.methods import METHODS, Context, Figures, Recorder, Settings, drive, wildcard_cover
from s5loader_bench.monitor import CpuSplit, ProcTimes, TreeMonitor
from s5loader_bench.proxy import LatencyProxy, RequestParser, classify

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _client(endpoint: str):  # type: ignore[no-untyped-def]
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def _keys(endpoint: str, bucket: str, prefix: str) -> dict[str, int]:
    out = {}
    for page in _client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = o["Size"]
    return out


# -- argument errors ---------------------------------------------------------------------
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


# -- against a real local S3 ---------------------------------------------------------------
@pytest.fixture(scope="module")
def data(seaweed_server: str) -> dict[str, str]:
    """16 samples of 2 KB under a fresh prefix, and 4 tar shards of them beside it."""
    base = f"bench-{uuid.uuid4().hex[:8]}/"
    source = f"s3://data/{base}train/"
    rc = bench.main(
        [
            "--generate",
            "16",
            source,
            "--endpoint-url",
            seaweed_server,
            "--sample-size",
            "2KB",
            "--shard-samples",
            "4",
        ]
    )
    assert rc == 0
    return {"endpoint": seaweed_server, "source": source, "base": base}


def test_generate_writes_the_expected_objects(
    data: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    samples = _keys(data["endpoint"], "data", data["base"] + "train/")
    assert len(samples) == 32
    for i in range(16):
        assert samples[f"{data['base']}train/{i:06d}.image"] == 2000
        assert 1 <= samples[f"{data['base']}train/{i:06d}.label"] <= 4
    shards = _keys(data["endpoint"], "data", data["base"] + "train-shards/")
    assert sorted(shards) == [f"{data['base']}train-shards/shard-{n:06d}.tar" for n in range(4)] + [
        f"{data['base']}train-shards/wids.json"
    ]  # the shards' index, as s5loader index-shards writes it
    body = _client(data["endpoint"]).get_object(Bucket="data", Key=sorted(shards)[1])["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        names = tar.getnames()
        assert names == [f"{i:06d}.{f}" for i in range(4, 8) for f in ("image", "label")]
        label = tar.extractfile("000005.label").read()  # type: ignore[union-attr]
    direct = _client(data["endpoint"]).get_object(Bucket="data", Key=f"{data['base']}train/000005.label")
    assert label == direct["Body"].read() == b"5"


def test_generate_without_labels_writes_one_object_per_sample(seaweed_server: str, tmp_path) -> None:
    base = f"bench-{uuid.uuid4().hex[:8]}/"
    source = f"s3://data/{base}one/"
    assert (
        bench.main(
            [
                "--generate",
                "6",
                source,
                "--endpoint-url",
                seaweed_server,
                "--sample-size",
                "1KB",
                "--shard-samples",
                "3",
                "--no-label",
            ]
        )
        == 0
    )
    assert sorted(_keys(seaweed_server, "data", base + "one/")) == [
        f"{base}one/{i:06d}.image" for i in range(6)
    ]
    body = (
        _client(seaweed_server)
        .get_object(Bucket="data", Key=f"{base}one-shards/shard-000001.tar")["Body"]
        .read()
    )
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        assert tar.getnames() == [f"{i:06d}.image" for i in range(3, 6)]
    # the first batch alone, at a batch of 4: one step per method, counted at the proxy
    out_json = tmp_path / "first.json"
    assert (
        bench.main(
            [
                source,
                "--endpoint-url",
                seaweed_server,
                "--first-batch",
                "--batch-size",
                "4",
                "--num-workers",
                "2",
                "--count-requests",
                "--methods",
                "s5loader",
                "boto3",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    doc = json.loads(out_json.read_text())
    assert doc["settings"]["first_batch"] and doc["settings"]["samples_per_call"] == 1000
    for r in doc["results"]:
        assert r["status"] == "ok" and r["steps"] == 1 and r["samples"] == 4 and r["first_batch_s"] > 0
        assert r["objects"] == 4  # one object per sample


def test_generate_shows_progress_on_stderr(seaweed_server: str, capsys: pytest.CaptureFixture[str]) -> None:
    source = f"s3://data/bench-{uuid.uuid4().hex[:8]}/p/"
    assert (
        bench.main(
            [
                "--generate",
                "3",
                source,
                "--endpoint-url",
                seaweed_server,
                "--sample-size",
                "10",
                "--shards-prefix",
                source + "tars/",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    # not a terminal (captured): a line at the end instead of a bar
    assert "uploading to" in out.err and "7 objects of 7" in out.err and "wrote 3 samples" in out.out


def _installed(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def test_short_run_of_every_method(
    data: dict[str, str], tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_md, out_png = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"
    argv = [
        data["source"],
        "--endpoint-url",
        data["endpoint"],
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--num-workers",
        "2",
        "--samples-per-call",
        "4",
        "--json",
        str(out_json),
        "--markdown",
        str(out_md),
    ]
    if _installed("matplotlib"):
        argv += ["--plot", str(out_png)]
    rc = bench.main(argv)
    table = capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    by = {r["method"]: r for r in doc["results"]}
    assert list(by) == list(METHODS)
    assert rc == 0, {m: r["note"] for m, r in by.items()}
    fields = {f.name for f in dataclasses.fields(Figures)}
    for m, r in by.items():
        assert set(r) == fields
        if m in ("s3torchconnector", "webdataset") and not _installed(m):
            assert r["status"] == "skipped" and "not installed" in r["note"]
            continue
        assert r["status"] == "ok", (m, r["note"])
        assert r["samples"] >= 6 and r["bytes"] >= 6 * 2000 and r["steps"] >= 3
        assert r["samples_per_s"] > 0 and r["mb_per_s"] > 0 and r["seconds"] > 0
        assert r["cpu_s"] >= 0 and r["cpu_s_per_1k_samples"] >= 0 and r["peak_mem_mb"] > 0
        assert r["ratio_to_s5loader"] > 0
        if m.startswith("s5cmd"):
            assert r["wait_fraction"] is None  # no Python loop
        else:
            assert 0 <= r["wait_fraction"] <= 1.0001
        assert m in table
    assert by["s5loader"]["ratio_to_s5loader"] == 1
    s = doc["settings"]
    assert (
        s["source"] == data["source"]
        and s["batch_size"] == 2
        and s["steps"] == 3
        and s["methods"] == list(METHODS)
    )
    assert doc["machine"]["logical_cpus"] >= 1 and doc["machine"]["versions"]["torch"]
    assert out_md.read_text().startswith("| method |")
    if _installed("matplotlib"):
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("mode", ["none", "full"])
def test_shard_shuffle_sets_both_sides_shuffle(
    data: dict[str, str], tmp_path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, object] = {}
    for name in ("S5Sampler", "S5IterableDataset"):
        real = getattr(bench_methods, name)
        monkeypatch.setattr(
            bench_methods,
            name,
            type(
                name,
                (real,),
                {
                    "__init__": lambda self, *a, _real=real, _name=name, **kw: (
                        seen.__setitem__(_name, kw["shuffle"]),
                        _real.__init__(self, *a, **kw),
                    )[1]
                },
            ),
        )
    methods = ["s5loader-shards", "s5loader-iterable"] + (["webdataset"] if _installed("webdataset") else [])
    if "webdataset" in methods:
        import webdataset

        real_shuffle = webdataset.WebDataset.shuffle
        monkeypatch.setattr(
            webdataset.WebDataset,
            "shuffle",
            lambda self, n, *a, **kw: (seen.__setitem__("webdataset", n), real_shuffle(self, n, *a, **kw))[1],
        )
    out_json = tmp_path / "r.json"
    rc = bench.main(
        [
            data["source"],
            "--endpoint-url",
            data["endpoint"],
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--num-workers",
            "2",
            "--methods",
            *methods,
            "--shard-shuffle",
            mode,
            "--json",
            str(out_json),
        ]
    )
    doc = json.loads(out_json.read_text())
    assert rc == 0 and all(r["status"] == "ok" for r in doc["results"]), [r["note"] for r in doc["results"]]
    assert doc["settings"]["shard_shuffle"] == mode
    expect = mode == "full"
    assert seen["S5Sampler"] is expect and seen["S5IterableDataset"] is expect
    if "webdataset" in methods:
        assert seen.get("webdataset") == (1000 if expect else None)


def test_absent_peer_is_reported_not_faked(
    data: dict[str, str], tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "s3torchconnector", None)
    monkeypatch.setitem(sys.modules, "webdataset", None)
    out_json = tmp_path / "r.json"
    rc = bench.main(
        [
            data["source"],
            "--endpoint-url",
            data["endpoint"],
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--methods",
            "s3torchconnector,webdataset",
            "s5cmd-bulk",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    by = {r["method"]: r for r in json.loads(out_json.read_text())["results"]}
    for peer in ("s3torchconnector", "webdataset"):
        r = by[peer]
        assert r["status"] == "skipped" and f"{peer} is not installed" in r["note"]
        assert "pip install 's5loader[bench]'" in r["note"]
        assert r["samples"] == 0 and r["samples_per_s"] is None and r["cpu_s"] is None
        assert f"skipped: {peer} is not installed" in table
    assert by["s5cmd-bulk"]["status"] == "ok" and by["s5cmd-bulk"]["ratio_to_s5loader"] is None


def test_missing_shards_are_a_skip(
    data: dict[str, str], tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not _installed("webdataset"):
        pytest.skip("webdataset is not installed")
    out_json = tmp_path / "r.json"
    rc = bench.main(
        [
            data["source"],
            "--endpoint-url",
            data["endpoint"],
            "--steps",
            "1",
            "--methods",
            "webdataset",
            "--shards-prefix",
            f"s3://data/{data['base']}nothing-here/",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    r = json.loads(out_json.read_text())["results"][0]
    assert r["status"] == "skipped" and "no tar shards under" in r["note"]
    assert r["note"].index("--shards-prefix") < r["note"].index("--generate")


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


def test_webdataset_with_fewer_shards_than_workers_runs_one_worker_per_shard(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 shards and --num-workers 4: webdataset runs with 2 workers and says so, in the table and
    the JSON. The shards are local files that a stand-in for s5cmd cats."""
    if not _installed("webdataset"):
        pytest.skip("webdataset is not installed")
    shards = []
    for n in range(2):
        path = tmp_path / f"shard-{n:06d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(4 * n, 4 * n + 4):
                for name, body in (("image", os.urandom(100)), ("label", str(i).encode())):
                    info = tarfile.TarInfo(f"{i:06d}.{name}")
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
        shards.append(str(path))
    fake = tmp_path / "fake-s5cmd"  # `s5cmd [flags] cat URI`: cats its last argument
    fake.write_text('#!/bin/sh\nfor a; do last=$a; done\nexec cat "$last"\n')
    fake.chmod(0o755)
    monkeypatch.setattr(bench_methods, "list_uris", lambda ctx, prefix: shards)
    ctx = _offline_context(tmp_path, num_workers=4)
    ctx.s5cmd = str(fake)
    f = bench_methods.measure("webdataset", ctx)
    assert f.status == "ok", f.note
    assert f.num_workers == 2 and f.note == "2 shards, ran with 2 workers instead of 4"
    assert f.samples == 6 and f.bytes >= 6 * 100
    doc = json.loads(json.dumps(dataclasses.asdict(f)))  # as --json writes it
    assert doc["num_workers"] == 2 and doc["note"] == f.note
    assert "webdataset: 2 shards, ran with 2 workers instead of 4" in bench.format_table([f])
    assert "2 shards, ran with 2 workers instead of 4" in bench.format_table([f], wide=True)


# -- the table ------------------------------------------------------------------------------
def _realistic_results(counted: bool = False) -> list[Figures]:
    """Figures like a real run's (the README's loopback figures), every method, one skipped."""
    rates = {
        "s5loader": 396.0,
        "s5loader-block": 591.0,
        "s5loader-sorted": 601.0,
        "boto3": 239.0,
        "s5cmd-run": 343.0,
        "s5cmd-bulk": 590.0,
        "webdataset": 1302.4,
        "s5loader-shards": 1881.2,
        "s5loader-iterable": 1453.0,
    }
    cpu = {
        "s5loader": 2.68,
        "s5loader-block": 1.98,
        "s5loader-sorted": 1.95,
        "boto3": 4.18,
        "s5cmd-run": 2.44,
        "s5cmd-bulk": 1.07,
        "webdataset": 0.83,
        "s5loader-shards": 0.64,
        "s5loader-iterable": 0.67,
    }
    out = []
    for m in METHODS:
        if m not in rates:
            out.append(
                Figures(
                    m,
                    status="skipped",
                    note=f"{m} is not installed (No module named '{m}'); pip install 's5loader[bench]'",
                )
            )
            continue
        f = Figures(
            m,
            samples=2000,
            bytes=200_002_000,
            steps=500,
            seconds=2000 / rates[m],
            samples_per_s=rates[m],
            mb_per_s=rates[m] * 0.100001,
            step100_mean_s=400 / rates[m],
            step100_var_s2=0.0123,
            step100_s=[400 / rates[m]] * 5,
            wait_fraction=0.87,
            cpu_s=cpu[m] * 2,
            cpu_util=1.43,
            cpu_s_per_1k_samples=cpu[m],
            cpu_split_s_per_1k_samples={
                "s5cmd": cpu[m] / 2,
                "main": cpu[m] / 4,
                "workers": cpu[m] / 4,
                "unattributed": 0.01,
            },
            peak_mem_mb=1234.5,
            ratio_to_s5loader=rates[m] / rates["s5loader"],
            first_batch_s=0.25,
            repeats_samples_per_s=[rates[m] * 0.9, rates[m], rates[m] * 1.1],
        )
        f.num_workers = None if m.startswith("s5cmd") else 4
        if counted:
            f.requests = {"GET": 4000, "HEAD": 0, "LIST": 2000, "other": 0}
            bench_methods.fill_request_rates(f)
        if m == "webdataset":
            f.note, f.num_workers = "2 shards, ran with 2 workers instead of 4", 2
        out.append(f)
    return out


@pytest.mark.parametrize("counted", [False, True])
def test_default_table_is_compact(counted: bool) -> None:
    results = _realistic_results(counted)
    table = bench.format_table(results)  # what main prints without --wide
    lines = table.splitlines()
    assert max(len(ln) for ln in lines) <= 100, "\n" + table
    header = lines[0].split("  ")
    expected = list(bench.COMPACT_COLUMNS) + (["$/M samples"] if counted else [])
    assert [c.strip() for c in header if c.strip()] == expected
    by_method = {ln.split()[0]: ln for ln in lines[1 : 1 + len(METHODS)]}
    assert list(by_method) == list(METHODS)
    assert by_method["s5loader"].split()[1:6] == ["396.0", "39.6", "0.25", "1.00x", "2.68"]
    assert by_method["s3torchconnector"].split()[1] == "skipped"
    # what the compact columns leave out is said under the table: notes, skips, medians
    assert "webdataset: 2 shards, ran with 2 workers instead of 4" in table
    assert "s3torchconnector: skipped: s3torchconnector is not installed" in table
    assert "samples/s: the median of 3 repeats" in table
    assert len(lines) <= len(METHODS) + 8, "\n" + table  # a note per method at most, not per figure
    if counted:  # 2 GETs and a LIST per sample at S3 list prices: 2 x $0.0004 + $0.005 per 1,000
        assert by_method["s5loader"].split()[6] == "5.80"
    for wide_only in (
        "s/100 steps (mean)",
        "GET/HEAD/LIST/other per sample",
        "peak mem MB",
        "waited",
        "new conns/request",
        "requests/sample",
    ):
        assert wide_only not in table
    assert "--wide" in lines[-1]


def test_wide_table_and_markdown_have_every_column() -> None:
    results = _realistic_results(counted=True)
    wide = bench.format_table(results, wide=True)
    header = wide.splitlines()[0]
    assert all(c in header for c in bench.COLUMNS) and header.rstrip().endswith("note")
    assert max(len(ln) for ln in wide.splitlines()) > 200  # the full table: why it is not the default
    assert "2 shards, ran with 2 workers instead of 4" in wide and "median of 3 repeats" in wide
    md = bench.format_table(results, markdown=True)
    assert md.splitlines()[0] == "| " + " | ".join(bench.COLUMNS) + " |"
    assert bench.build_parser().parse_args(["s3://b/p/", "--wide"]).wide
    assert not bench.build_parser().parse_args(["s3://b/p/"]).wide


def test_prices_are_s3_list_prices_unless_given() -> None:
    parse = bench.build_parser().parse_args
    assert parse(["s3://b/p/"]).prices == {"GET": 0.0004, "HEAD": 0.0004, "LIST": 0.005, "other": 0.005}
    assert parse(["s3://b/p/", "--prices", "list=0.0054,GET=0.00043"]).prices == {
        "GET": 0.00043,
        "HEAD": 0.0004,
        "LIST": 0.0054,
        "other": 0.005,
    }


def test_dollars_and_connections_per_request() -> None:
    f = Figures(
        "x",
        samples=2000,
        objects=4000,
        requests={"GET": 4000, "HEAD": 4000, "LIST": 4, "other": 0, "unreadable": 1},
        new_connections=800,
    )
    bench_methods.fill_request_rates(f, bench_methods.S3_PRICES)
    # (8,000 x $0.0004 + 4 x $0.005) / 1,000 per 2,000 samples
    assert f.dollars_per_million_samples == pytest.approx(1.61)
    assert f.connections_per_request == pytest.approx(800 / 8004)
    bench_methods.fill_request_rates(f, {**bench_methods.S3_PRICES, "HEAD": 0.0})
    assert f.dollars_per_million_samples == pytest.approx(0.81)


def test_readme_table_quotes_dollars_connections_and_the_first_batch() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_run", os.path.join(os.path.dirname(__file__), "..", "bench", "run.py")
    )
    assert spec is not None and spec.loader is not None
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)

    def doc(**by_method: dict) -> dict:  # type: ignore[type-arg]
        return {"results": [{"method": m, "status": "ok", **r} for m, r in by_method.items()]}

    counted = {
        "samples_per_s": 400.0,
        "first_batch_s": 0.3,
        "requests_per_sample": 4.0,
        "requests_per_sample_by_kind": {"GET": 2.0, "HEAD": 2.0, "LIST": 0.0},
        "dollars_per_million_samples": 1.61,
        "connections_per_request": 0.5,
        "peak_open_connections": 300,
    }
    runs = {
        "proxy": doc(
            **{"s5loader": counted, "s3torchconnector": {**counted, "dollars_per_million_samples": 0.81}}
        )
    }
    extra = {
        "first-direct": doc(s5loader={"first_batch_s": 0.21}, s3torchconnector={"first_batch_s": 0.35}),
        "first-proxy": doc(s5loader={"first_batch_s": 0.4}),
        "single": doc(s5loader={"dollars_per_million_samples": 0.8}),
    }
    table = run.readme_table(runs, 20.0, extra)
    rows = {
        cells[0]: cells[1:]
        for cells in ([c.strip() for c in ln.strip("|").split(" | ")] for ln in table.splitlines())
    }
    assert rows["first batch, s, batch 32 and 4 workers: direct / 20 ms proxy"][:2] == [
        "0.21 / 0.40",
        "0.35 / -",
    ]
    assert rows["$ per million samples at S3 list prices (image + label, proxy run)"][:2] == ["1.61", "0.81"]
    assert rows["$ per million samples at S3 list prices (one object per sample)"][0] == "0.80"
    assert rows["new TCP connections per request / most open at once (proxy run)"][0] == "0.500 / 300"


# -- the measuring parts -------------------------------------------------------------------
def test_recorder_windows_of_100_steps() -> None:
    rec = Recorder(batch_size=2, max_steps=300, seconds=None)
    rec.step_at = [0.01 * (k + 1) for k in range(250)]  # a step every 10 ms
    rec.samples, rec.bytes, rec.wait_s = 500, 5000, 1.0
    f = Figures("x")
    rec.fill(f)
    assert (
        f.steps == 250 and f.step100_mean_s == pytest.approx(1.0) and f.step100_var_s2 == pytest.approx(0.0)
    )
    assert f.samples_per_s == pytest.approx(200.0) and f.wait_fraction == pytest.approx(0.4)


def test_first_batch_is_timed_from_iter_of_the_first_epoch() -> None:
    class Slow:
        """A loader whose start (workers, staging) takes 0.2 s and whose batches take 0.01 s."""

        def __init__(self) -> None:
            self.epochs = 0

        def __iter__(self) -> Iterator[list[int]]:
            self.epochs += 1
            time.sleep(0.2)
            for k in range(5):
                time.sleep(0.01)
                yield [k, k]

    rec = Recorder(batch_size=2, max_steps=8, seconds=None)
    loader = Slow()
    time.sleep(0.3)  # before iter(loader): not part of the first batch
    drive(lambda epoch: loader, rec, compute_ms=0)
    f = Figures("x")
    rec.fill(f)
    assert loader.epochs == 2 and f.steps == 8
    assert f.first_batch_s is not None and 0.2 <= f.first_batch_s < 0.3  # the first epoch's start only
    assert f.step100_mean_s is None and rec.step_at[0] >= 0.5


def test_tree_monitor_counts_children() -> None:
    mon = TreeMonitor(interval=0.05).start()
    burn = "import time\nwhile time.process_time() < 0.4: pass"
    subprocess.run(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"],
        check=True,
    )
    cpu, peak = mon.stop()
    assert cpu >= 0.4 and peak > 0
    split = mon.cpu_split()
    assert sum(split.values()) == pytest.approx(cpu)
    assert split["s5cmd"] == 0.0


def test_tree_monitor_leaves_out_processes_started_before_it() -> None:
    burn = "import sys, time\nsys.stdin.readline()\nwhile time.process_time() < 0.6: pass"
    before = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE)
    mon = TreeMonitor(interval=0.05).start()
    assert before.stdin is not None
    before.stdin.close()  # burns now, while measured, and is reaped by this process
    before.wait()
    cpu, _ = mon.stop()
    assert cpu < 0.3, mon.cpu_split()


def test_tree_monitor_splits_s5cmd_from_the_rest(tmp_path) -> None:
    s5cmd = tmp_path / "s5cmd"  # a process the system names s5cmd
    s5cmd.symlink_to(sys.executable)
    burn = "import time\nwhile time.process_time() < 0.5: pass"
    mon = TreeMonitor(interval=0.05).start()
    subprocess.run([str(s5cmd), "-c", burn], check=True)
    subprocess.run([sys.executable, "-c", burn], check=True)
    cpu, _ = mon.stop()
    split = mon.cpu_split()
    assert split["s5cmd"] >= 0.4 and split["workers"] >= 0.4
    # each child burned 0.5 s; /proc counts in clock ticks, so allow a tick or two per process
    assert split["s5cmd"] + split["workers"] + split["unattributed"] >= 0.9
    assert sum(split.values()) == pytest.approx(cpu)


@pytest.mark.parametrize("delay_s", [0.005, 0.0])
def test_latency_proxy_passes_and_counts_s3_traffic(seaweed_server: str, delay_s: float) -> None:
    host, port = seaweed_server.removeprefix("http://").split(":")
    proxy = LatencyProxy(host, int(port), delay_s=delay_s).start_thread()
    try:
        c = _client(proxy.endpoint)
        body = os.urandom(300_000)
        key = f"proxy-{uuid.uuid4().hex[:8]}"
        c.put_object(Bucket="data", Key=key, Body=body)  # a body that must be skipped, not parsed
        assert c.get_object(Bucket="data", Key=key)["Body"].read() == body
        c.head_object(Bucket="data", Key=key)
        assert c.list_objects_v2(Bucket="data", Prefix=key)["KeyCount"] == 1
        assert c.get_object(Bucket="data", Key=key)["Body"].read() == body  # a kept-alive connection
        assert proxy.connections >= 1
        assert proxy.counts == {"GET": 2, "HEAD": 1, "LIST": 1, "other": 1}
    finally:
        proxy.stop()


def test_checkpoint_bench_runs_every_method_side_by_side(tmp_path) -> None:
    """``bench/checkpoint.py`` (run by ``make bench``), small: its own SeaweedFS and latency
    proxy, every method saved and loaded in rounds (each load checked tensor by tensor, else the
    script fails), a peer that is not installed reported as such, and the fetch of a split
    archive within its budget."""
    out = tmp_path / "checkpoint.json"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "checkpoint.py"),
            "--sizes",
            "6MiB",
            "--archive",
            "8MiB",
            "--volume",
            "5MiB",
            "--budget",
            "5MiB",
            "--repeat",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    size = str(6 * 1024**2)
    for mode in ("direct", "proxy"):
        rows = result["runs"][size][mode]
        for name in ("s5loader", "s5loader-mmap", "boto3"):
            assert rows[name]["status"] == "ok" and rows[name]["load_s"] > 0 and rows[name]["save_s"] > 0
            assert len(rows[name]["save_runs_s"]) == len(rows[name]["load_runs_s"]) == 2
            assert rows[name]["save_s"] in rows[name]["save_runs_s"]
        assert rows["s3torchconnector"]["status"] in ("ok", "not installed (s3torchconnector)")
    fetch = result["fetch"]
    assert fetch["extracted_bytes"] >= 8 * 1024**2 and fetch["files"] >= 1 and fetch["volumes"] >= 2
    assert fetch["peak_staged"] <= fetch["budget"] == 5 * 1024**2
    assert "ratios" in proc.stdout


# -- counting requests and splitting CPU: the logic on made-up inputs ----------------------
@pytest.mark.parametrize(
    ("method", "target", "kind"),
    [
        ("GET", "/data/train/0001.image", "GET"),
        ("GET", "/data/train/0001.image?x-id=GetObject", "GET"),
        ("GET", "/train/0001.image", "GET"),  # virtual-hosted
        ("HEAD", "/data/train/0001.image", "HEAD"),
        ("GET", "/data?list-type=2&prefix=train%2F&encoding-type=url", "LIST"),
        ("GET", "/data/?delimiter=%2F&prefix=", "LIST"),
        ("GET", "/?list-type=2", "LIST"),
        ("GET", "/", "LIST"),
        ("GET", "/data?location", "other"),
        ("PUT", "/data/train/0001.image", "other"),
        ("DELETE", "/data/train/0001.image", "other"),
        ("get", "http://127.0.0.1:8333/data/k", "GET"),  # an absolute target
    ],
)
def test_classify(method: str, target: str, kind: str) -> None:
    assert classify(method, target) == kind


def _feed_in_pieces(parser: RequestParser, data: bytes, size: int) -> None:
    for i in range(0, len(data), size):
        parser.feed(data[i : i + size])


@pytest.mark.parametrize("piece", [1, 7, 64, 100_000])
def test_request_parser_follows_bodies_and_kept_alive_connections(piece: int) -> None:
    fake = b"GET /data/fake HTTP/1.1\r\nHost: x\r\n\r\n"  # inside bodies: never a request
    stream = (
        b"GET /data/a HTTP/1.1\r\nHost: x\r\n\r\n"
        + b"PUT /data/b HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(fake)
        + fake
        + b"HEAD /data/a HTTP/1.1\r\n\r\n"
        + b"PUT /data/c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x;ext=1\r\n" % len(fake)
        + fake
        + b"\r\n"
        + b"3\r\nabc\r\n0\r\nx-trailer: 1\r\n\r\n"
        + b"GET /data?list-type=2&prefix=t HTTP/1.1\r\n\r\n"
    )
    counts: dict[str, int] = {}
    _feed_in_pieces(RequestParser(counts), stream, piece)
    assert counts == {"GET": 1, "other": 2, "HEAD": 1, "LIST": 1}


def test_request_parser_gives_up_on_what_is_not_http() -> None:
    counts: dict[str, int] = {}
    parser = RequestParser(counts)
    parser.feed(b"\x16\x03\x01 TLS hello\r\n\r\n")
    parser.feed(b"GET /data/a HTTP/1.1\r\n\r\n")  # the stream is not followed any more
    assert counts == {"unreadable": 1}


def _p(pid: int, kind: str, own: float, reaped: float = 0.0) -> ProcTimes:
    return ProcTimes((pid, 1.0), kind, own, reaped)


def test_cpu_split_follows_processes_that_end_between_samples() -> None:
    split = CpuSplit()
    split.add(1.0, 0.0, [_p(10, "workers", 0.5)])  # the start: only what comes after counts
    split.add(1.2, 0.0, [_p(10, "workers", 0.7), _p(11, "s5cmd", 0.4)])
    # s5cmd 11 ended and was reaped by the training process with 0.6 s: 0.2 s after its last sample
    split.add(1.3, 0.6, [_p(10, "workers", 0.8)])
    assert split.result() == pytest.approx({"main": 0.3, "workers": 0.3, "s5cmd": 0.6, "unattributed": 0.0})
    # a process that started and ended between two samples: nobody to give it to
    split.add(1.3, 0.9, [_p(10, "workers", 0.8)])
    assert split.result()["unattributed"] == pytest.approx(0.3)
    # the worker ends and is reaped, with an s5cmd child of its own it had reaped unseen
    split.add(1.4, 0.9 + 0.8 + 0.5, [])
    r = split.result()
    assert r == pytest.approx({"main": 0.4, "workers": 0.8, "s5cmd": 0.6, "unattributed": 0.3})
    assert sum(r.values()) == pytest.approx((1.4 + 2.2) - (1.0 + 0.5))


def test_cpu_split_of_a_grandchild_seen_alive() -> None:
    split = CpuSplit()
    split.add(0.0, 0.0, [])
    split.add(0.1, 0.0, [_p(20, "workers", 0.2), _p(21, "s5cmd", 0.5)])
    # s5cmd 21 (a worker's child) ended with 0.55 s, reaped by worker 20; worker still alive
    split.add(0.1, 0.0, [_p(20, "workers", 0.3, reaped=0.55)])
    r = split.result()
    assert r["s5cmd"] == pytest.approx(0.55) and r["workers"] == pytest.approx(0.3)
    assert r["unattributed"] == 0.0


def test_cpu_split_leaves_excluded_processes_out() -> None:
    split = CpuSplit()
    split.add(0.0, 0.0, [_p(30, "excluded", 5.0), _p(31, "workers", 0.0)])
    split.add(0.0, 0.0, [_p(30, "excluded", 5.4), _p(31, "workers", 0.3)])
    split.add(0.1, 5.6, [_p(31, "workers", 0.4)])  # the excluded one ended, reaped with 5.6 s
    assert split.result() == pytest.approx({"main": 0.1, "workers": 0.4, "s5cmd": 0.0, "unattributed": 0.0})


def test_wildcard_cover_names_exactly_the_needed_keys() -> None:
    keys = [f"train/{i:06d}.{f}" for i in range(1000) for f in ("image", "label")] + ["train/odd*key"]
    for count in (1, 2, 12, 137, 1000):
        needed = {f"train/{i:06d}.{f}" for i in range(count) for f in ("image", "label")}
        prefixes, singles = wildcard_cover(keys, needed, "train/")
        matched = {k for k in keys for p in prefixes if k.startswith(p)} | set(singles)
        assert matched == needed
        assert len(prefixes) <= 40  # wildcards, not one line per object
    prefixes, singles = wildcard_cover(keys, {"train/odd*key", "train/000003.image"}, "train/")
    assert singles == ["train/odd*key"] and prefixes == ["train/000003.image"]


def test_repeat_reports_the_median(
    data: dict[str, str], tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "r.json"
    assert (
        bench.main(
            [
                data["source"],
                "--endpoint-url",
                data["endpoint"],
                "--steps",
                "2",
                "--batch-size",
                "2",
                "--methods",
                "s5cmd-bulk",
                "--repeat",
                "3",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    r = json.loads(out_json.read_text())["results"][0]
    assert r["status"] == "ok" and len(r["repeats_samples_per_s"]) == 3
    assert r["samples_per_s"] == sorted(r["repeats_samples_per_s"])[1]
    assert "median of 3 repeats" in capsys.readouterr().out


# -- CPU split and requests in a real run ------------------------------------------------------
def _counted_run(data: dict[str, str], tmp_path, *args: str) -> dict[str, dict]:  # type: ignore[type-arg]
    out_json = tmp_path / f"r-{uuid.uuid4().hex[:6]}.json"
    rc = bench.main(
        [
            data["source"],
            "--endpoint-url",
            data["endpoint"],
            "--count-requests",
            "--batch-size",
            "2",
            "--num-workers",
            "2",
            "--samples-per-call",
            "4",
            "--json",
            str(out_json),
            *args,
        ]
    )
    by = {r["method"]: r for r in json.loads(out_json.read_text())["results"]}
    assert rc == 0, {m: r["note"] for m, r in by.items()}
    return by


def test_real_run_reports_cpu_split_and_requests(
    data: dict[str, str], tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    methods = ["s5loader", "s5loader-block", "boto3", "s5cmd-run", "s5cmd-bulk"]
    by = _counted_run(data, tmp_path, "--steps", "3", "--wide", "--methods", *methods)
    table = capsys.readouterr().out
    assert "requests/sample" in table and "GET/HEAD/LIST/other per sample" in table
    assert "blocks/256 samples" in table
    for m in ("s5loader", "s5loader-block"):  # the order's mixing, from S5Sampler.shuffle_quality
        assert by[m]["blocks_per_256"] >= 1 and 0 < by[m]["displacement"] < 1
    assert by["boto3"]["blocks_per_256"] is None
    for m in methods:
        r = by[m]
        assert r["status"] == "ok", (m, r["note"])
        assert r["objects"] == 2 * r["samples"] >= 6
        # every object delivered was fetched with a GET at least once
        assert r["requests"]["GET"] >= r["objects"], (m, r["requests"])
        assert r["requests_per_sample"] > 0 and r["requests_per_object"] > 0
        assert r["requests_per_sample_by_kind"]["GET"] == pytest.approx(r["requests"]["GET"] / r["samples"])
        split = r["cpu_split_s"]
        assert set(split) == {"s5cmd", "main", "workers", "unattributed"}
        assert min(split.values()) >= 0 and sum(split.values()) == pytest.approx(r["cpu_s"], abs=1e-3)
        assert set(r["cpu_split_s_per_1k_samples"]) == set(split)
    assert by["s5loader"]["cpu_split_s"]["main"] > 0
    assert by["boto3"]["cpu_split_s"]["s5cmd"] == 0 and by["boto3"]["requests"]["HEAD"] == 0
    for m in methods:  # what the requests cost, and the connections the proxy accepted for them
        r = by[m]
        assert r["dollars_per_million_samples"] > 0 and r["new_connections"] >= 1
        assert 0 < r["connections_per_request"] <= 1.01 and r["peak_open_connections"] >= 1
    assert by["s5cmd-bulk"]["requests"]["HEAD"] == 0 and by["s5cmd-bulk"]["requests"]["LIST"] >= 1
    for m in ("s5loader", "s5cmd-bulk"):  # s5cmd did the work: seen, or at least not given to another kind
        split = by[m]["cpu_split_s"]
        assert split["s5cmd"] + split["unattributed"] > 0


def test_steps_bound_s5cmd_bulk(data: dict[str, str], tmp_path) -> None:
    """16 samples of 2 objects: one step of 2 samples copies their 4 objects, not the 32 of a
    whole pass; 9 steps copy one pass and the 4 objects of 2 more samples."""
    one = _counted_run(data, tmp_path, "--steps", "1", "--methods", "s5cmd-bulk")["s5cmd-bulk"]
    assert one["samples"] == 2 and one["requests"]["GET"] == 4 and one["requests"]["HEAD"] == 0
    nine = _counted_run(data, tmp_path, "--steps", "9", "--methods", "s5cmd-bulk")["s5cmd-bulk"]
    assert nine["samples"] == 18 and nine["requests"]["GET"] == 32 + 4


def test_steps_bound_the_calls_of_s5cmd_run(data: dict[str, str], tmp_path) -> None:
    """--samples-per-call 1000 with one step of 2 samples: calls of 2 samples, not of the whole
    data set."""
    out_json = tmp_path / "r.json"
    rc = bench.main(
        [
            data["source"],
            "--endpoint-url",
            data["endpoint"],
            "--count-requests",
            "--batch-size",
            "2",
            "--steps",
            "1",
            "--samples-per-call",
            "1000",
            "--methods",
            "s5cmd-run",
            "--json",
            str(out_json),
        ]
    )
    doc = json.loads(out_json.read_text())
    assert rc == 0 and doc["settings"]["samples_per_call_used"] == 2
    r = doc["results"][0]
    assert r["samples"] == 2 and r["requests"]["GET"] < 32


def test_runtime_package_loads_no_benchmark_code(seaweed, staging_root: str) -> None:  # type: ignore[no-untyped-def]
    from support.stores import make_pairs

    seaweed.put(make_pairs(4, size=64))
    code = f"""
import json, sys
import s5loader
from s5loader import S5Dataset, S5Sampler
ds = S5Dataset.from_prefix({seaweed.uri()!r}, endpoint_url={seaweed.endpoint!r})
with S5Sampler(ds, budget="1MiB", staging_dir={staging_root!r}) as sampler:
    got = [ds[i]["label"] for i in sampler]
assert len(got) == 4, got
heavy = ("matplotlib", "webdataset", "s3torchconnector", "s5loader_bench", "psutil")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
    imported = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import s5loader"],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    assert "s5loader_bench" not in imported and "matplotlib" not in imported and "psutil" not in imported


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
