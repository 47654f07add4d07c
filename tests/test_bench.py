"""``s5loader bench``: argument errors, ``--generate``, a short run of every method against a
real local S3 server, peers reported as skipped when absent, the tree CPU monitor and the
latency proxy. No timing assertions."""

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

from s5loader import bench
from s5loader._bench_methods import METHODS, Figures, Recorder, TreeMonitor
from s5loader.cli import main as cli_main

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
    ],
)
def test_argument_errors(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "usage: s5loader bench" in err


def test_argument_error_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "s3://b/p/", "--methods", "nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert bench.main(["s3://b/p/", "--plot", "x.png"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


# -- against a real local S3 ---------------------------------------------------------------
@pytest.fixture(scope="module")
def data(seaweed_server: str) -> dict[str, str]:
    """16 samples of 2 KB under a fresh prefix, and 4 tar shards of them beside it."""
    base = f"bench-{uuid.uuid4().hex[:8]}/"
    source = f"s3://data/{base}train/"
    rc = bench.main(["--generate", "16", source, "--endpoint-url", seaweed_server, "--sample-size", "2KB",
                     "--shard-samples", "4"])
    assert rc == 0
    return {"endpoint": seaweed_server, "source": source, "base": base}


def test_generate_writes_the_expected_objects(data: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    samples = _keys(data["endpoint"], "data", data["base"] + "train/")
    assert len(samples) == 32
    for i in range(16):
        assert samples[f"{data['base']}train/{i:06d}.image"] == 2000
        assert 1 <= samples[f"{data['base']}train/{i:06d}.label"] <= 4
    shards = _keys(data["endpoint"], "data", data["base"] + "train-shards/")
    assert sorted(shards) == [f"{data['base']}train-shards/shard-{n:06d}.tar" for n in range(4)]
    body = _client(data["endpoint"]).get_object(Bucket="data", Key=sorted(shards)[1])["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        names = tar.getnames()
        assert names == [f"{i:06d}.{f}" for i in range(4, 8) for f in ("image", "label")]
        label = tar.extractfile("000005.label").read()  # type: ignore[union-attr]
    direct = _client(data["endpoint"]).get_object(Bucket="data", Key=f"{data['base']}train/000005.label")
    assert label == direct["Body"].read() == b"5"


def test_generate_shows_progress_on_stderr(seaweed_server: str, capsys: pytest.CaptureFixture[str]) -> None:
    source = f"s3://data/bench-{uuid.uuid4().hex[:8]}/p/"
    assert bench.main(["--generate", "3", source, "--endpoint-url", seaweed_server, "--sample-size", "10",
                       "--shards-prefix", source + "tars/"]) == 0
    out = capsys.readouterr()
    assert "objects" in out.err and "[" in out.err and "wrote 3 samples" in out.out


def _installed(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def test_short_run_of_every_method(data: dict[str, str], tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_md, out_png = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"
    argv = [data["source"], "--endpoint-url", data["endpoint"], "--steps", "3", "--batch-size", "2",
            "--num-workers", "2", "--samples-per-call", "4", "--json", str(out_json), "--markdown", str(out_md)]
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
    assert s["source"] == data["source"] and s["batch_size"] == 2 and s["steps"] == 3 and s["methods"] == list(METHODS)
    assert doc["machine"]["logical_cpus"] >= 1 and doc["machine"]["versions"]["torch"]
    assert out_md.read_text().startswith("| method |")
    if _installed("matplotlib"):
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_absent_peer_is_reported_not_faked(data: dict[str, str], tmp_path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "s3torchconnector", None)
    monkeypatch.setitem(sys.modules, "webdataset", None)
    out_json = tmp_path / "r.json"
    rc = bench.main([data["source"], "--endpoint-url", data["endpoint"], "--steps", "2", "--batch-size", "2",
                     "--methods", "s3torchconnector,webdataset", "s5cmd-bulk", "--json", str(out_json)])
    assert rc == 0
    table = capsys.readouterr().out
    by = {r["method"]: r for r in json.loads(out_json.read_text())["results"]}
    for peer in ("s3torchconnector", "webdataset"):
        r = by[peer]
        assert r["status"] == "skipped" and f"{peer} is not installed" in r["note"]
        assert r["samples"] == 0 and r["samples_per_s"] is None and r["cpu_s"] is None
        assert f"skipped: {peer} is not installed" in table
    assert by["s5cmd-bulk"]["status"] == "ok" and by["s5cmd-bulk"]["ratio_to_s5loader"] is None


def test_missing_shards_are_a_skip(data: dict[str, str], tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    if not _installed("webdataset"):
        pytest.skip("webdataset is not installed")
    out_json = tmp_path / "r.json"
    rc = bench.main([data["source"], "--endpoint-url", data["endpoint"], "--steps", "1", "--methods", "webdataset",
                     "--shards-prefix", f"s3://data/{data['base']}nothing-here/", "--json", str(out_json)])
    assert rc == 0
    r = json.loads(out_json.read_text())["results"][0]
    assert r["status"] == "skipped" and "no tar shards under" in r["note"]


# -- the measuring parts -------------------------------------------------------------------
def test_recorder_windows_of_100_steps() -> None:
    rec = Recorder(batch_size=2, max_steps=300, seconds=None)
    rec.step_at = [0.01 * (k + 1) for k in range(250)]  # a step every 10 ms
    rec.samples, rec.bytes, rec.wait_s = 500, 5000, 1.0
    f = Figures("x")
    rec.fill(f)
    assert f.steps == 250 and f.step100_mean_s == pytest.approx(1.0) and f.step100_var_s2 == pytest.approx(0.0)
    assert f.samples_per_s == pytest.approx(200.0) and f.wait_fraction == pytest.approx(0.4)


def test_tree_monitor_counts_children() -> None:
    mon = TreeMonitor(interval=0.05).start()
    burn = "import time\nwhile time.process_time() < 0.4: pass"
    subprocess.run([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"],
                   check=True)
    cpu, peak = mon.stop()
    assert cpu >= 0.4 and peak > 0


def test_latency_proxy_passes_s3_traffic(seaweed_server: str) -> None:
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        from latency_proxy import LatencyProxy
    finally:
        sys.path.pop(0)
    host, port = seaweed_server.removeprefix("http://").split(":")
    proxy = LatencyProxy(host, int(port), delay_s=0.005).start_thread()
    try:
        c = _client(proxy.endpoint)
        body = os.urandom(300_000)
        key = f"proxy-{uuid.uuid4().hex[:8]}"
        c.put_object(Bucket="data", Key=key, Body=body)
        assert c.get_object(Bucket="data", Key=key)["Body"].read() == body
        assert proxy.connections >= 1
    finally:
        proxy.stop()


def test_repeat_reports_the_median(data: dict[str, str], tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "r.json"
    assert bench.main([data["source"], "--endpoint-url", data["endpoint"], "--steps", "2", "--batch-size", "2",
                       "--methods", "s5cmd-bulk", "--repeat", "3", "--json", str(out_json)]) == 0
    r = json.loads(out_json.read_text())["results"][0]
    assert r["status"] == "ok" and len(r["repeats_samples_per_s"]) == 3
    assert r["samples_per_s"] == sorted(r["repeats_samples_per_s"])[1]
    assert "median of 3 repeats" in capsys.readouterr().out
