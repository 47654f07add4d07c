"""The daemon's hand-over: `prefetch --fresh` on a finished cache with a consumer started at
once, the crash-safe shell consumer of docs/daemon.md, the restart message, the help text.

A private module (``s5loader._daemon``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.stores import Store, make_pairs
from support.waits import wait_for

from s5loader.consume import END_MARKER, consume, ready_names
from s5loader.exceptions import StallError

ROOT = Path(__file__).resolve().parents[1]
PAIR = 2017  # bytes of one make_pairs(n, 2000) sample


def daemon_argv(store: Store, cache: Path, budget: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "s5loader",
        "prefetch",
        store.uri(),
        "--cache",
        str(cache),
        "--budget",
        str(budget),
        "--endpoint-url",
        store.endpoint,
        *extra,
    ]


def run_daemon(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as f:
        return subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ), stdout=f, stderr=subprocess.STDOUT)


def finished_cache(store: Store, cache: Path, tmp_path: Path, n: int) -> str:
    """A cache whose run ended and whose samples were all consumed; returns its END."""
    store.put(make_pairs(n, size=2000))
    d = run_daemon(daemon_argv(store, cache, 3 * PAIR, "--samples-per-call", "2"), tmp_path / "first.log")
    assert len(list(consume(cache, timeout=30))) == n
    assert d.wait(30) == 0, (tmp_path / "first.log").read_text()
    assert ready_names(str(cache)) == []
    return (cache / END_MARKER).read_text()


def test_fresh_with_a_consumer_started_at_once(seaweed: Store, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    old_end = finished_cache(seaweed, cache, tmp_path, 6)
    # Only the old run's END is there: the consumer waits for a new run instead of ending.
    with pytest.raises(StallError, match="finished run"):
        list(consume(cache, timeout=0.5, poll_interval=0.01))
    # The consumer first (it sees the old END), then the daemon with --fresh.
    out = tmp_path / "got.txt"
    consumer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys\nfrom s5loader.consume import consume\n"
                "out = open(sys.argv[2], 'w'); print('ready', file=out, flush=True)\n"
                "for s in consume(sys.argv[1], timeout=60):\n    print(s.name, file=out, flush=True)\n"
            ),
            str(cache),
            str(out),
        ],
        cwd=ROOT,
        env=dict(os.environ),
    )

    def consumer_up() -> bool:  # the consumer is up and looking
        assert consumer.poll() is None, "the consumer exited"
        return out.exists() and bool(out.read_text())

    wait_for(consumer_up, 60, "the consumer to start")
    daemon = run_daemon(
        daemon_argv(seaweed, cache, 3 * PAIR, "--samples-per-call", "2", "--fresh"), tmp_path / "d.log"
    )
    assert consumer.wait(60) == 0
    assert daemon.wait(60) == 0, (tmp_path / "d.log").read_text()  # it exits by itself after END
    names = out.read_text().split()
    assert names[0] == "ready" and len(names[1:]) == 6, names
    new_end = json.loads((cache / END_MARKER).read_text())
    assert new_end["samples"] == 6 and new_end["run"] != json.loads(old_end)["run"]


def doc_shell_consumer() -> str:
    text = (ROOT / "docs" / "daemon.md").read_text()
    block = re.search(r"```bash\n(mkdir -p /data/cache && cd /data/cache .*?)```", text, re.S)
    assert block is not None
    return block.group(1)


def test_doc_shell_consumer_with_fresh_and_a_crash(seaweed: Store, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    finished_cache(seaweed, cache, tmp_path, 6)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    step = bin_dir / "train-step"
    step.write_text(f'#!/bin/sh\necho "$1" >> {calls}\ncat "$2"\n')  # the result: the label
    step.chmod(0o755)
    script = doc_shell_consumer().replace("/data/cache", str(cache))
    done = tmp_path / "done"
    done.mkdir()
    env = dict(
        os.environ, PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}"
    )  # s5loader too
    shell = subprocess.Popen(["bash", "-c", script], env=env)
    daemon = run_daemon(
        daemon_argv(seaweed, cache, 3 * PAIR, "--samples-per-call", "2", "--fresh"), tmp_path / "d.log"
    )
    assert daemon.wait(60) == 0, (tmp_path / "d.log").read_text()
    assert shell.wait(60) == 0
    results = sorted(p.name for p in done.iterdir())
    assert len(results) == 6 and not any(n.startswith(".") for n in results)
    assert len(calls.read_text().splitlines()) == 6  # each sample's work ran once
    # A restart after a crash between the record and the rm does not repeat the work.
    first = results[0]
    (cache / END_MARKER).unlink()
    (cache / first).mkdir()
    (cache / first / "label").write_text("x")
    (cache / END_MARKER).write_text('{"run": "next"}\n')
    assert subprocess.run(["bash", "-c", script], env=env, timeout=60).returncode == 0
    assert len(calls.read_text().splitlines()) == 6 and not (cache / first).exists()


def test_restart_starvation_is_catching_up(seaweed: Store, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    seaweed.put(make_pairs(10, size=2000))
    argv = daemon_argv(
        seaweed, cache, 2 * PAIR, "--samples-per-call", "2", "--json-log", str(tmp_path / "j.jsonl")
    )
    first = run_daemon(argv, tmp_path / "first.log")
    got = []
    for s in consume(cache, timeout=30):
        got.append(s.name)
        if len(got) == 3:
            break
    first.send_signal(signal.SIGTERM)
    assert first.wait(30) == 0
    for name in ready_names(str(cache)):  # the consumer uses up what was delivered
        got.append(name)
        shutil.rmtree(cache / name)
    second = run_daemon(argv, tmp_path / "second.log")
    got += [s.name for s in consume(cache, timeout=30)]
    assert second.wait(30) == 0
    assert len(set(got)) == 10
    text = (tmp_path / "second.log").read_text()
    # The first starvation after the restart is catching up, not blamed on the network (a
    # budget of two samples and an eager consumer starve later on for real).
    first_starved = next(line for line in text.splitlines() if "catching up" in line or "starved:" in line)
    assert "catching up after a restart at sample" in first_starved and "WARNING" not in first_starved, text
