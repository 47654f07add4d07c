"""``s5loader bench`` against a real local S3 server: ``--generate``, a short run of every
method, peers reported as skipped when absent, the tree CPU monitor and its split by process
kind, the latency proxy and its request counts, ``--steps`` bounding every method, and the
runtime package loading none of it. The parts that need no server are in
``tests/unit/test_bench_*.py``. No timing assertions."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import tarfile
import uuid

import boto3
import pytest

from s5loader_bench import cli as bench
from s5loader_bench import methods as bench_methods
from s5loader_bench.methods import METHODS, Context, Figures, Settings
from s5loader_bench.monitor import TreeMonitor
from s5loader_bench.proxy import LatencyProxy

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


# -- the measuring parts -------------------------------------------------------------------


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
