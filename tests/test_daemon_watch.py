"""The prefetch daemon as a user leaves it running: it warns about folder data read by stem,
waits for a consumer without spending CPU, and never holds more than its budget, however often
it is stopped and started again."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import psutil
from support.stores import Store, make_pairs
from test_daemon import (
    PAIR,
    cache_bytes,
    daemon_argv,
    expected_names,
    finish,
    received,
    start,
    start_consumer,
    state,
    wait_for,
)


def _log_says(log: Path, text: str) -> bool:
    return log.exists() and text in log.read_text()


def test_stem_over_folder_samples_is_warned(seaweed: Store, tmp_path: Path) -> None:
    seaweed.put({f"video/clip{i}/{name}": b"x" * 10 for i in range(12) for name in ("text.txt", "video.mp4")})
    log = tmp_path / "daemon.log"
    proc = start(daemon_argv(seaweed.uri("video/"), tmp_path / "cache", 10_000, "--endpoint-url", seaweed.endpoint), log)
    try:
        wait_for(lambda: _log_says(log, "group_by='stem' made 24 samples of one file each"), 30, "the warning")
    finally:
        proc.send_signal(signal.SIGTERM)
        finish(proc)
    text = log.read_text()
    assert seaweed.uri("video/") in text and "--group-by folder" in text


def _cpu_seconds(proc: psutil.Process) -> float:
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def test_an_idle_daemon_spends_little_cpu(seaweed: Store, tmp_path: Path) -> None:
    seaweed.put(make_pairs(20, size=2000))
    cache = tmp_path / "cache"
    log = tmp_path / "daemon.log"
    # a cache that holds 4 of 20 samples and no consumer: the daemon fills it, then waits
    proc = start(daemon_argv(seaweed.uri(), cache, 4 * PAIR, "--endpoint-url", seaweed.endpoint), log)
    try:
        wait_for(lambda: state(cache).get("delivered", 0) >= 4, 30, "a full cache")
        time.sleep(2)
        p = psutil.Process(proc.pid)
        before, t0 = _cpu_seconds(p), time.monotonic()
        time.sleep(10)
        used, took = _cpu_seconds(p) - before, time.monotonic() - t0
        assert proc.poll() is None, log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        finish(proc)
    per_minute = used * 60 / took
    print(f"idle daemon: {used:.2f} CPU s in {took:.0f} s, {per_minute:.2f} per minute")
    assert per_minute < 1.5, f"{used:.2f} CPU s in {took:.0f} s idle ({per_minute:.2f} per minute)"


def test_budget_holds_across_many_stops_and_starts(seaweed: Store, tmp_path: Path) -> None:
    source = seaweed.put(make_pairs(40, size=2000))
    want = expected_names(seaweed)
    cache = tmp_path / "cache"
    out = tmp_path / "got.jsonl"
    budget = 4 * PAIR
    consumer = start_consumer(cache, out, delay=0.03)
    argv = daemon_argv(seaweed.uri(), cache, budget, "--endpoint-url", seaweed.endpoint, "--samples-per-call", "2")
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, cache_bytes(cache) if cache.exists() else 0)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        for cycle in range(6):
            proc = start(argv, tmp_path / f"run{cycle}.log")
            done = state(cache).get("delivered", 0)
            try:
                wait_for(lambda d=done, p=proc: state(cache).get("delivered", 0) >= min(40, d + 3) or p.poll() is not None,
                         30, "deliveries")
            finally:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                finish(proc, timeout=15)
        last = start(argv, tmp_path / "last.log")
        assert finish(last, timeout=60) == 0, (tmp_path / "last.log").read_text()
        assert finish(consumer, timeout=60) == 0, out.with_suffix(".log").read_text()
    finally:
        stop.set()
        watcher.join()
        if consumer.poll() is None:
            consumer.kill()
    got = received(out)
    assert [g["name"] for g in got] == [name for name, _ in want]  # every sample once, in order
    assert len({g["name"] for g in got}) == 40
    assert source and peak <= budget, f"the cache held {peak} bytes, over its budget of {budget}"
