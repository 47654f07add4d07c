"""``s5loader prefetch`` end to end: the daemon runs as a subprocess exactly as a user runs it,
against the real s5cmd and a real local S3 server; consumers run in other processes (Python's
``consume`` and a shell loop with ``ls``, ``head`` and ``rm``).

Private modules (``s5loader._sampling``, ``s5loader._daemon``) are imported only where they are
the seam under test; the rest goes through the public API."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.stores import Peak, Store, make_pairs
from support.waits import wait_for

from s5loader._daemon import STAGING_DIR, STATE_FILE, PrefetchDaemon, PrefetchOptions, sample_folder_name
from s5loader._sampling.order import Order
from s5loader.consume import END_MARKER, consume, ready_names
from s5loader.dataset import S5Dataset
from s5loader.handover import sample_bytes

ROOT = Path(__file__).resolve().parents[1]
PAIR = 2017  # bytes of one make_pairs(n, 2000) sample: a 2016-byte image and a 1-byte label

CONSUMER = """
import hashlib, json, sys, time
from s5loader.consume import consume
out = open(sys.argv[2], "a")
for s in consume(sys.argv[1], timeout=60):
    files = {k: hashlib.sha256(open(p, "rb").read()).hexdigest() for k, p in s.files.items()}
    out.write(json.dumps({"name": s.name, "files": files}) + "\\n")
    out.flush()
    time.sleep(float(sys.argv[3]))
"""

SHELL_CONSUMER = r"""
until [ -d "$1" ]; do sleep 0.05; done
cd "$1"
while :; do
  first=$(ls | head -n 1)
  if [ -z "$first" ]; then sleep 0.05; continue; fi
  if [ "$first" = END ]; then break; fi
  echo "$first $(cat "$first/label") $(sha256sum < "$first/image" | cut -c1-64)"
  rm -r "$first"
done
"""


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def daemon_argv(source: str, cache: Path, budget: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "s5loader",
        "prefetch",
        source,
        "--cache",
        str(cache),
        "--budget",
        str(budget),
        *extra,
    ]


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start a process with the test's AWS_* credentials, its output going to ``log``."""
    with open(log, "ab") as f:
        return subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ), stdout=f, stderr=subprocess.STDOUT)


def start_consumer(cache: Path, out: Path, delay: float = 0.0) -> subprocess.Popen[bytes]:
    return start([sys.executable, "-c", CONSUMER, str(cache), str(out), str(delay)], out.with_suffix(".log"))


def finish(proc: subprocess.Popen[bytes], timeout: float = 25) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def received(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def expected_names(
    store: Store, group_by: str = "stem", shuffle: bool = False, seed: int = 0, epochs: int = 1
):
    """Folder names in delivery order, and the samples they hold, from the library's index."""
    ds = S5Dataset.from_prefix(store.uri(), endpoint_url=store.endpoint, group_by=group_by)
    order = Order(shuffle, seed, 1, 0, False)
    out = []
    for epoch in range(epochs):
        for idx in order.indices(len(ds), epoch):
            sample = ds.samples[idx]
            out.append((sample_folder_name(len(out), sample.key), sample))
    return out


def cache_bytes(cache: Path) -> int:
    """Sample bytes in the cache now, as ``s5loader prefetch --status`` counts them: delivered
    folders (claimed or not) and ``.staging``, not the lock, state and key files; a lower bound
    of the bytes at the end of the look (see :func:`s5loader.handover.sample_bytes`)."""
    return sample_bytes(cache)


def state(cache: Path) -> dict:
    try:
        return json.loads((cache / STATE_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}


def s5cmd_on(cache: Path) -> list[int]:
    """Pids of live processes whose command line names the cache (s5cmd runs a command file there)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"s5cmd" in cmd and str(cache).encode() in cmd:
            pids.append(int(pid))
    return pids


def json_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "cache"


# -- delivery -----------------------------------------------------------------------------------
def test_stem_samples_shuffled_epochs_once_in_order_within_budget(
    seaweed: Store, cache: Path, tmp_path: Path
) -> None:
    source = seaweed.put(make_pairs(24, size=2000))
    want = expected_names(seaweed, shuffle=True, seed=7, epochs=2)
    budget = 5 * PAIR
    out = tmp_path / "got.jsonl"
    log = tmp_path / "progress.jsonl"
    consumer = start_consumer(cache, out, delay=0.03)  # started first: it waits for the daemon
    with Peak(lambda: cache_bytes(cache), interval=0.002) as peak:
        daemon = start(
            daemon_argv(
                seaweed.uri(),
                cache,
                budget,
                "--endpoint-url",
                seaweed.endpoint,
                "--shuffle",
                "--seed",
                "7",
                "--epochs",
                "2",
                "--samples-per-call",
                "3",
                "--json-log",
                str(log),
            ),
            tmp_path / "daemon.log",
        )
        assert finish(daemon) == 0, (tmp_path / "daemon.log").read_text()
        assert finish(consumer) == 0, out.with_suffix(".log").read_text()
    got = received(out)
    assert [g["name"] for g in got] == [name for name, _ in want]
    for g, (_, sample) in zip(got, want, strict=True):
        key = sample.key
        assert g["files"] == {"image": sha(source[key + ".image"]), "label": sha(source[key + ".label"])}
    assert peak.looks > 10 and 2 * PAIR <= peak.peak <= budget, (peak.peak, budget)
    assert ready_names(str(cache)) == [] and (cache / END_MARKER).exists()
    events = json_events(log)
    assert events[0]["event"] == "start" and events[-1]["event"] == "done"
    assert events[-1]["delivered"] == 48 and max(e.get("cache_bytes", 0) for e in events) <= budget


def test_folder_samples_text_and_video(moto: Store, cache: Path, tmp_path: Path) -> None:
    objects = {}
    for i in range(6):
        objects[f"clip{i:03d}/text.txt"] = f"caption of clip {i}: ünïcode".encode()
        objects[f"clip{i:03d}/video.mp4"] = os.urandom(3000 + 100 * i)
    source = moto.put(objects)
    want = expected_names(moto, group_by="folder")
    out = tmp_path / "got.jsonl"
    daemon = start(
        daemon_argv(moto.uri(), cache, 10_000, "--endpoint-url", moto.endpoint, "--group-by", "folder"),
        tmp_path / "daemon.log",
    )
    consumer = start_consumer(cache, out)
    assert finish(daemon) == 0, (tmp_path / "daemon.log").read_text()
    assert finish(consumer) == 0, out.with_suffix(".log").read_text()
    got = received(out)
    assert [g["name"] for g in got] == [name for name, _ in want]
    for g, (_, sample) in zip(got, want, strict=True):
        assert g["files"] == {
            "text.txt": sha(source[sample.key + "/text.txt"]),
            "video.mp4": sha(source[sample.key + "/video.mp4"]),
        }


def test_shell_consumer_with_ls_head_rm(seaweed: Store, cache: Path, tmp_path: Path) -> None:
    source = seaweed.put(make_pairs(12, size=2000))
    want = expected_names(seaweed)
    shell = subprocess.Popen(
        ["bash", "-c", SHELL_CONSUMER, "consumer", str(cache)], stdout=subprocess.PIPE, text=True
    )
    daemon = start(
        daemon_argv(
            seaweed.uri(), cache, 3 * PAIR, "--endpoint-url", seaweed.endpoint, "--samples-per-call", "2"
        ),
        tmp_path / "daemon.log",
    )
    assert finish(daemon) == 0, (tmp_path / "daemon.log").read_text()
    lines, _ = shell.communicate(timeout=20)
    got = [line.split(" ") for line in lines.splitlines()]
    assert [g[0] for g in got] == [name for name, _ in want]
    for (_, label, image), (_, sample) in zip(got, want, strict=True):
        assert label.encode() == source[sample.key + ".label"]
        assert image == sha(source[sample.key + ".image"])


# -- stopping, restarting, locking -------------------------------------------------------------
def test_sigterm_then_sigkill_then_restart_delivers_every_sample_once(
    seaweed: Store, cache: Path, tmp_path: Path
) -> None:
    source = seaweed.put(make_pairs(30, size=2000))
    want = expected_names(seaweed)
    out = tmp_path / "got.jsonl"
    consumer = start_consumer(cache, out, delay=0.04)
    argv = daemon_argv(
        seaweed.uri(), cache, 4 * PAIR, "--endpoint-url", seaweed.endpoint, "--samples-per-call", "2"
    )

    def run(name: str) -> subprocess.Popen[bytes]:
        return start(argv + ["--json-log", str(tmp_path / f"{name}.jsonl")], tmp_path / f"{name}.log")

    first = run("first")
    wait_for(lambda: state(cache).get("delivered", 0) >= 8, what="8 deliveries")
    first.send_signal(signal.SIGTERM)
    assert finish(first, timeout=10) == 0, (tmp_path / "first.log").read_text()
    stopped_at = state(cache)["delivered"]
    assert 8 <= stopped_at < 30 and state(cache)["pending"] is None
    assert s5cmd_on(cache) == []  # s5cmd was killed
    assert [n for n in os.listdir(cache / STAGING_DIR) if not n.startswith(".")] == []  # partial files gone
    assert not (cache / END_MARKER).exists()

    second = run("second")  # killed without a chance to clean up
    wait_for(lambda: state(cache).get("delivered", 0) >= stopped_at + 6, what="6 more deliveries")
    second.kill()
    second.wait()
    assert json_events(tmp_path / "second.jsonl")[0]["resumed_from"] == stopped_at

    third = run("third")
    assert finish(third) == 0, (tmp_path / "third.log").read_text()
    assert finish(consumer) == 0, out.with_suffix(".log").read_text()
    got = received(out)
    assert [g["name"] for g in got] == [name for name, _ in want]  # every sample once, in order
    for g, (_, sample) in zip(got, want, strict=True):
        assert g["files"]["image"] == sha(source[sample.key + ".image"])
    events = json_events(tmp_path / "third.jsonl")
    resumed = events[0]["resumed_from"]
    assert resumed >= stopped_at + 6
    assert events[-1]["fetched_bytes"] == (30 - resumed) * PAIR  # nothing delivered was fetched again
    assert os.listdir(cache / STAGING_DIR) == []  # the killed daemon's leftovers were removed


@pytest.mark.parametrize("renamed", [False, True])
def test_restart_completes_a_delivery_cut_by_a_crash(
    seaweed: Store, cache: Path, tmp_path: Path, renamed: bool
) -> None:
    """A daemon killed between recording a pending rename and recording the delivery."""
    source = seaweed.put(make_pairs(4, size=2000))
    want = expected_names(seaweed)
    argv = daemon_argv(seaweed.uri(), cache, 2 * PAIR, "--endpoint-url", seaweed.endpoint)
    opts = PrefetchOptions.of(seaweed.uri(), str(cache), 2 * PAIR, endpoint_url=seaweed.endpoint)
    with PrefetchDaemon(opts) as p:  # lays the cache out and writes the state of this run
        p.open()
    name0, sample0 = want[0]
    dead = cache / STAGING_DIR / "s5loader-999999-deadbeef"  # a dead daemon's staging area
    staged = dead / "0"
    staged.mkdir(parents=True)
    (dead / ".lock").write_text('{"pid": 999999}')  # its lock file, no longer locked
    for f in ("image", "label"):
        (staged / f).write_bytes(source[sample0.key + "." + f])
    if renamed:
        os.rename(staged, cache / name0)
    st = state(cache)
    st["pending"] = {"seq": 0, "from": str(staged), "to": str(cache / name0)}
    (cache / STATE_FILE).write_text(json.dumps(st))

    log = tmp_path / "progress.jsonl"
    daemon = start(argv + ["--json-log", str(log)], tmp_path / "daemon.log")
    got = [(s.name, s.read("image")) for s in consume(cache, timeout=20)]
    assert finish(daemon) == 0, (tmp_path / "daemon.log").read_text()
    assert got == [(name, source[sample.key + ".image"]) for name, sample in want]
    assert json_events(log)[-1]["fetched_bytes"] == 3 * PAIR  # sample 0 was not fetched again
    assert os.listdir(cache / STAGING_DIR) == []


def test_second_daemon_refused_and_sigint_leaves_ready_samples(
    seaweed: Store, cache: Path, tmp_path: Path
) -> None:
    seaweed.put(make_pairs(10, size=2000))
    argv = daemon_argv(
        seaweed.uri(), cache, 3 * PAIR, "--endpoint-url", seaweed.endpoint, "--samples-per-call", "1"
    )
    first = start(argv, tmp_path / "first.log")
    try:
        wait_for(lambda: len(ready_names(str(cache))) == 3, what="a full cache")  # nobody consumes
        second = subprocess.run(
            argv, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=20
        )
        assert second.returncode == 1
        assert str(cache) in second.stderr and f"pid {first.pid}" in second.stderr, second.stderr
        first.send_signal(signal.SIGINT)
        assert finish(first, timeout=10) == 0, (tmp_path / "first.log").read_text()
    finally:
        if first.poll() is None:
            first.kill()
    assert len(ready_names(str(cache))) == 3  # ready samples stay for the consumer
    changed = argv + ["--shuffle", "--seed", "5"]
    refused = subprocess.run(changed, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True)
    assert refused.returncode == 1 and "another run" in refused.stderr, refused.stderr
    fresh = start(changed + ["--fresh"], tmp_path / "fresh.log")  # starts over: the old samples go
    wait_for(lambda: state(cache).get("seed") == 5, what="the new run's state")
    names = [s.name for s in consume(cache, timeout=20)]
    assert finish(fresh) == 0, (tmp_path / "fresh.log").read_text()
    assert names == [name for name, _ in expected_names(seaweed, shuffle=True, seed=5)]


def test_sample_larger_than_budget_fails_before_download(seaweed: Store, cache: Path, tmp_path: Path) -> None:
    seaweed.put(make_pairs(3, size=2000))
    proc = subprocess.run(
        daemon_argv(seaweed.uri(), cache, PAIR - 1, "--endpoint-url", seaweed.endpoint),
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert proc.returncode == 1
    assert "larger than the budget" in proc.stderr, proc.stderr
    assert ready_names(str(cache)) == [] and cache_bytes(cache) == 0
    foreign = tmp_path / "home"
    (foreign / "2023-photos").mkdir(parents=True)
    proc = subprocess.run(
        daemon_argv(seaweed.uri(), foreign, 10 * PAIR, "--fresh"),
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert proc.returncode == 1 and "not empty" in proc.stderr, proc.stderr
    assert os.listdir(foreign) == ["2023-photos"]  # untouched, not even a lock file
    usage = subprocess.run(
        daemon_argv(seaweed.uri(), cache, 0), cwd=ROOT, env=dict(os.environ), capture_output=True, text=True
    )
    assert usage.returncode == 2


# -- visibility ---------------------------------------------------------------------------------
def test_starvation_and_progress_are_reported(seaweed: Store, cache: Path, tmp_path: Path) -> None:
    seaweed.put(make_pairs(5, size=2000))
    log = tmp_path / "progress.jsonl"
    # A budget of one sample: each sample is fetched only after the last was consumed, so the
    # consumer always waits on the daemon.
    daemon = start(
        daemon_argv(
            seaweed.uri(),
            cache,
            PAIR,
            "--endpoint-url",
            seaweed.endpoint,
            "--samples-per-call",
            "1",
            "--json-log",
            str(log),
            "--progress",
        ),
        tmp_path / "daemon.log",
    )
    names = [s.name for s in consume(cache, timeout=20)]
    assert finish(daemon) == 0
    assert len(names) == 5
    events = json_events(log)
    starved = [e for e in events if e["event"] == "starved"]
    assert len(starved) >= 1 and all(e["consumed"] >= 1 for e in starved)
    assert events[-1]["event"] == "done" and events[-1]["delivered"] == 5
    text = (tmp_path / "daemon.log").read_text()
    assert "MB/s" in text and "starved" in text


def test_the_daemon_under_block_shuffle_sends_the_samplers_requests_per_sample(
    seaweed: Store, counting_proxy: Any, tmp_path: Path
) -> None:
    """``shuffle="block"`` with calls of 50 samples and a window of all 256: both front ends
    widen a call to whole windows, so a block whole in a window is one wildcard line (a LIST, no
    HEADs), and the daemon sends what the sampler sends, request for request."""
    from torch.utils.data import DataLoader

    from s5loader import S5Sampler

    seaweed.put(make_pairs(256, size=1000))
    budget = 1_000_000

    def requests() -> dict[str, int]:
        return dict(counting_proxy.counts)

    def spent(before: dict[str, int]) -> dict[str, int]:
        now = requests()
        return {k: now.get(k, 0) - before.get(k, 0) for k in ("GET", "HEAD", "LIST")}

    before = requests()
    ds = S5Dataset.from_prefix(seaweed.uri(), endpoint_url=counting_proxy.endpoint)  # a LIST, as the daemon's
    sampler = S5Sampler(
        ds, shuffle="block", seed=1, budget=budget, samples_per_call=50, staging_dir=str(tmp_path)
    )
    with sampler:
        keys = [x["__key__"] for x in DataLoader(ds, sampler=sampler, batch_size=None)]
    assert sorted(keys) == sorted(f"{seaweed.prefix}{i:04d}" for i in range(256))
    by_sampler = spent(before)
    cache = tmp_path / "cache"
    argv = [sys.executable, "-m", "s5loader", "prefetch", seaweed.uri(), "--cache", str(cache)]
    argv += ["--shuffle", "block", "--endpoint-url", counting_proxy.endpoint, "--no-progress"]
    argv += ["--budget", str(budget), "--samples-per-call", "50", "--seed", "1"]
    before = requests()
    daemon = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    delivered = [s.key for s in consume(str(cache), timeout=60)]
    assert daemon.wait(60) == 0, daemon.stderr.read() if daemon.stderr else ""
    assert sorted(delivered) == sorted(keys)
    by_daemon = spent(before)
    # a wildcard line for every block: a call never ends inside a window, not even the first
    # calls, which are smaller than a window (each a whole window of the first ones, which grow
    # from 32 samples for a quick first batch), so no object goes alone with its HEAD
    assert by_sampler["LIST"] > 0 and by_sampler["HEAD"] == 0, by_sampler
    assert by_daemon == by_sampler, (by_daemon, by_sampler)
