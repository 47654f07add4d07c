"""Several consumers on one cache, each claiming what it takes, and a slow consumer that costs
few s5cmd processes: the daemon runs as ``s5loader prefetch`` against the real s5cmd and a
local S3 server, consumers in other processes (``consume`` and the shell loop of the docs)."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time
from pathlib import Path

from support.stores import Peak, Store, make_pairs
from test_daemon import PAIR, ROOT, daemon_argv, expected_names, finish, json_events, start
from test_daemon_liveness import no_process_left, run_shell_loop  # noqa: F401 (a fixture)

from s5loader import find_s5cmd
from s5loader.consume import END_MARKER, consume
from s5loader.handover import CLAIMED_DIR, sample_bytes

CONSUMER = """
import sys, time
from s5loader.consume import consume
out = open(sys.argv[2], "a")
for s in consume(sys.argv[1], timeout=60):
    out.write(s.name + " " + s.read("label").decode() + "\\n")
    out.flush()
    time.sleep(float(sys.argv[3]))  # the work: the sample stays claimed meanwhile
"""


def test_consumers_in_several_processes_take_each_sample_once(seaweed: Store, tmp_path: Path) -> None:
    source = seaweed.put(make_pairs(60, size=2000))
    want = {name: source[sample.key + ".label"].decode() for name, sample in expected_names(seaweed)}
    cache = tmp_path / "cache"
    budget = 6 * PAIR
    daemon = start(
        daemon_argv(
            seaweed.uri(), cache, budget, "--endpoint-url", seaweed.endpoint, "--samples-per-call", "4"
        ),
        tmp_path / "d.log",
    )
    outs = [tmp_path / f"got{i}.txt" for i in range(3)]
    consumers = [
        subprocess.Popen([sys.executable, "-c", CONSUMER, str(cache), str(out), "0.03"], cwd=ROOT)
        for out in outs
    ]
    shell = run_shell_loop(cache, tmp_path)  # the docs' loop beside them, claiming with mv
    with Peak(lambda: sample_bytes(cache) if cache.exists() else 0, interval=0.002) as peak:
        assert finish(daemon, timeout=120) == 0, (tmp_path / "d.log").read_text()
        assert all(finish(c, timeout=60) == 0 for c in consumers)
        shell.communicate(timeout=60)
    assert shell.returncode == 0
    rows = [line.split() for out in outs for line in out.read_text().splitlines()]
    rows += [[p.name, p.read_text()] for p in (tmp_path / "done").iterdir()]
    counts = collections.Counter(name for name, _ in rows)
    assert sorted(counts) == sorted(want) and set(counts.values()) == {1}  # each sample exactly once
    assert all(label == want[name] for name, label in rows)  # and its own bytes
    # claimed samples count against the budget until they are deleted
    assert 2 * PAIR <= peak.peak <= budget, (peak.peak, budget)
    assert os.listdir(cache / CLAIMED_DIR) == [] and (cache / END_MARKER).exists()


def test_leaving_the_loop_hands_the_sample_back(seaweed: Store, tmp_path: Path) -> None:
    seaweed.put(make_pairs(4, size=2000))
    cache = tmp_path / "cache"
    daemon = start(
        daemon_argv(seaweed.uri(), cache, 4 * PAIR, "--endpoint-url", seaweed.endpoint), tmp_path / "d.log"
    )
    for sample in consume(cache, timeout=60):
        assert os.path.dirname(sample.path) == str(cache / CLAIMED_DIR)  # claimed while it is ours
        first = sample.name
        break
    assert (cache / first).is_dir() and not (
        cache / CLAIMED_DIR / first
    ).exists()  # handed back, in its place
    names = [s.name for s in consume(cache, timeout=60)]
    assert finish(daemon) == 0, (tmp_path / "d.log").read_text()
    assert names[0] == first and len(names) == 4


def s5cmd_counter(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose s5cmd (``$S5LOADER_S5CMD``) is the real one behind a script that
    writes each start's arguments to a file first."""
    runs = tmp_path / "s5cmd-runs.txt"
    wrapper = tmp_path / "s5cmd"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {runs}\nexec {find_s5cmd()} "$@"\n')
    wrapper.chmod(0o755)
    return dict(os.environ, S5LOADER_S5CMD=str(wrapper)), runs


def test_a_slow_consumer_costs_few_s5cmd_processes(seaweed: Store, tmp_path: Path) -> None:
    seaweed.put(make_pairs(40, size=2000))
    cache, events = tmp_path / "cache", tmp_path / "events.jsonl"
    env, runs = s5cmd_counter(tmp_path)
    budget = 20 * PAIR
    with open(tmp_path / "d.log", "wb") as log:
        daemon = subprocess.Popen(
            daemon_argv(
                seaweed.uri(), cache, budget, "--endpoint-url", seaweed.endpoint, "--json-log", str(events)
            ),
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    consumed = 0
    for _ in consume(cache, timeout=60):
        consumed += 1
        time.sleep(0.35)  # slower than the daemon looks for releases: it sees one freed sample at a time
    assert finish(daemon) == 0, (tmp_path / "d.log").read_text()
    calls = [line for line in runs.read_text().splitlines() if line.startswith("run ") or " run " in line]
    # One call fills the budget, then each waits until a quarter of it (5 samples) is free:
    # about 5 calls in all (5 measured), where starting a call per freed sample made one for
    # each of the last 20 (21 measured).
    assert consumed == 40 and len(calls) <= 8, calls
    assert max(e.get("cache_bytes", 0) for e in json_events(events)) <= budget
