"""The prefetch daemon as a user leaves it running: it warns about folder-per-sample data read
by stem, waits for a consumer without spending CPU however many samples wait, and never holds
more than its budget, however often it is stopped and started again.

A private module (``s5loader._daemon``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.stores import Peak, Store, make_pairs
from support.waits import wait_for
from test_daemon import (
    PAIR,
    cache_bytes,
    daemon_argv,
    expected_names,
    finish,
    received,
    s5cmd_on,
    sha,
    start,
    start_consumer,
    state,
)

from s5loader import find_s5cmd
from s5loader._daemon import LOCK_FILE, STAGING_DIR, PrefetchDaemon, PrefetchOptions
from s5loader._daemon.cache_state import Ledger
from s5loader.consume import ready_names


# -- 1. folder-per-sample data read by stem ------------------------------------------------------
def test_stem_over_folder_per_sample_data_warns_with_the_cli_flag(
    moto: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The report's layout: video/folderN/text.txt + video/folderN/video.mp4 under the prefix,
    read with the default --group-by stem: 120 one-file samples."""
    moto.put(
        {f"video/folder{i}/{name}": b"x" * 10 for i in range(1, 61) for name in ("text.txt", "video.mp4")}
    )
    caplog.set_level(logging.INFO)
    opts = PrefetchOptions.of(moto.uri(), str(tmp_path / "cache"), 10**6, endpoint_url=moto.endpoint)
    with PrefetchDaemon(opts) as daemon:
        daemon.open()
        assert daemon.summary.total == 120
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    said = [w for w in warnings if "120 samples of one file each" in w]
    assert said, warnings
    assert moto.uri() in said[0] and "--group-by folder" in said[0], said[0]


# -- 2. an idle daemon ---------------------------------------------------------------------------


@contextlib.contextmanager
def _fast_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder in /dev/shm (a cache of thousands of samples fills fast there), else tmp_path."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="s5loader-test-") as d:
            yield Path(d)
    else:
        yield tmp_path


def test_an_idle_daemon_with_a_full_cache_of_many_samples_looks_without_listing_it(
    seaweed: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report: 21 CPU s in 10 minutes while a full cache waited for its consumer, a cost
    that grew with the samples in the cache because each look listed them all. Here 2800 small
    samples wait: the daemon goes on looking at its cache (the engine asks the ledger about each
    delivered sample), and once the cache has been still for a while, no look lists it."""
    n, size, held = 3000, 100, 2800
    objects = tmp_path / "objects"
    objects.mkdir()
    for i in range(n):
        (objects / f"{i:05d}.bin").write_bytes(bytes([i % 256]) * size)
    subprocess.run(
        [find_s5cmd(), "--endpoint-url", seaweed.endpoint, "cp", f"{objects}/*", seaweed.uri()],
        check=True,
        capture_output=True,
        timeout=120,
    )
    with _fast_dir(tmp_path) as fast:
        cache = fast / "cache"
        listed: list[str] = []  # each listing of the cache or its claimed folder, by anyone
        looks = [0]  # the ledger's looks at the cache
        real_listdir, real_refresh = os.listdir, Ledger.refresh

        def listdir(path: str = ".") -> list[str]:
            if os.fspath(path).startswith(str(cache)) and ".staging" not in os.fspath(path):
                listed.append(os.fspath(path))
            return real_listdir(path)

        def refresh(self: Ledger, force: bool = False) -> None:
            looks[0] += 1
            real_refresh(self, force)

        monkeypatch.setattr(os, "listdir", listdir)
        monkeypatch.setattr(Ledger, "refresh", refresh)
        opts = PrefetchOptions.of(seaweed.uri(), str(cache), held * size, endpoint_url=seaweed.endpoint)
        daemon = PrefetchDaemon(opts)
        errors: list[BaseException] = []

        def run() -> None:
            try:
                with daemon:
                    daemon.open()
                    daemon.run()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        t = threading.Thread(target=run)
        t.start()
        try:
            wait_for(lambda: state(cache).get("delivered", 0) >= held, 120, f"{held} deliveries")
            since = {"at": time.monotonic(), "looks": looks[0], "listed": len(listed)}

            def still() -> bool:  # two seconds and twenty looks since the last listing
                assert not errors and t.is_alive(), errors
                if len(listed) != since["listed"]:
                    since.update(at=time.monotonic(), looks=looks[0], listed=len(listed))
                return time.monotonic() - since["at"] >= 2.0 and looks[0] - since["looks"] >= 20

            wait_for(still, 30, "two seconds in which the idle daemon looked at its full cache unlisted")
            assert state(cache)["delivered"] == held
        finally:
            daemon.stop.set()
            t.join(60)
        assert not errors, errors
        assert len(ready_names(str(cache))) == held  # nothing was consumed, nothing more delivered


# -- 3. the budget across SIGTERM and restart ----------------------------------------------------
def test_a_restart_removes_every_leftover_of_a_stopped_run_before_it_fetches(
    moto: Store, tmp_path: Path
) -> None:
    """What a killed run can leave in .staging: its area (lock free), an area it was still
    setting up, and a folder that one of its s5cmd copies recreated after the area was
    removed (s5cmd creates a missing destination folder), which has no lock to test. None of
    it is counted in the budget, so none of it may stay while the restarted daemon fetches."""
    moto.put(make_pairs(6, size=2000))
    cache = tmp_path / "cache"
    opts = PrefetchOptions.of(moto.uri(), str(cache), 4 * PAIR, endpoint_url=moto.endpoint)
    with PrefetchDaemon(opts) as daemon:  # lays the cache out and writes the state of this run
        daemon.open()
    staging = cache / STAGING_DIR
    dead = staging / "s5loader-999999-deadbeef"
    (dead / "3").mkdir(parents=True)
    (dead / ".lock").write_text('{"pid": 999999}')
    (dead / "3" / "image").write_bytes(b"x" * 2016)
    init = staging / ".init-s5loader-999998-deadbeef"
    init.mkdir()
    (init / ".lock").write_text('{"pid": 999998}')
    recreated = staging / "s5loader-999997-deadbeef" / ".c2" / ".r"
    recreated.mkdir(parents=True)
    (recreated / "5.0123456").write_bytes(b"x" * 2 * PAIR)  # a copy under way when its daemon died
    assert cache_bytes(cache) == 2016 + 2 * PAIR
    with PrefetchDaemon(opts) as daemon:
        daemon.open()
        assert (
            os.listdir(staging) == []
        )  # the dead runs' folders are gone; this run's comes with its first pass
        assert cache_bytes(cache) == 0  # before the first fetch, the cache holds nothing uncounted
        daemon.stop.set()
        daemon.run()


def test_budget_holds_across_sigterm_and_restart_at_any_moment(seaweed: Store, tmp_path: Path) -> None:
    """Eight SIGTERMs at different moments (while the daemon opens the cache, after a few
    deliveries, while calls are in flight), each followed by a restart, with a consumer
    deleting samples all along: the cache never holds more than the budget, and every
    sample is consumed exactly once, in order."""
    n = 80
    source = seaweed.put(make_pairs(n, size=2000))
    want = expected_names(seaweed)
    cache = tmp_path / "cache"
    out = tmp_path / "got.jsonl"
    budget = 6 * PAIR
    argv = daemon_argv(
        seaweed.uri(), cache, budget, "--endpoint-url", seaweed.endpoint, "--samples-per-call", "3"
    )
    rng = random.Random(3)
    consumer = start_consumer(cache, out, delay=0.03)
    codes = []
    try:
        with Peak(lambda: cache_bytes(cache) if cache.exists() else 0, interval=0.002) as peak:
            for cycle in range(8):
                log = tmp_path / f"run{cycle}.log"
                done = state(cache).get("delivered", 0)
                proc = start(argv, log)
                try:
                    if cycle % 3 == 0:  # as soon as it holds the lock: while it lists and opens
                        wait_for(
                            lambda p=proc: (
                                (cache / LOCK_FILE).exists()
                                and (cache / LOCK_FILE).read_text().strip() == str(p.pid)
                                or p.poll() is not None
                            ),
                            30,
                            "the lock",
                        )
                    else:  # after a few deliveries, then at once or a moment later (calls in flight)
                        more = rng.randint(1, 5)
                        wait_for(
                            lambda d=done, k=more, p=proc: (
                                state(cache).get("delivered", 0) >= min(n, d + k) or p.poll() is not None
                            ),
                            30,
                            "deliveries",
                        )
                        time.sleep(rng.choice([0.0, 0.05, 0.2]))
                finally:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
                    codes.append(finish(proc, timeout=15))
                assert codes[-1] == 0, log.read_text()
                assert s5cmd_on(cache) == []  # nothing of this run fetches on behind the next
            last = start(argv, tmp_path / "last.log")
            assert finish(last, timeout=60) == 0, (tmp_path / "last.log").read_text()
            assert finish(consumer, timeout=60) == 0, out.with_suffix(".log").read_text()
    finally:
        if consumer.poll() is None:
            consumer.kill()
    got = received(out)
    assert [g["name"] for g in got] == [name for name, _ in want]  # every sample once, in order
    for g, (_, sample) in zip(got, want, strict=True):
        assert g["files"] == {
            "image": sha(source[sample.key + ".image"]),
            "label": sha(source[sample.key + ".label"]),
        }
    assert peak.looks > 100 and 2 * PAIR <= peak.peak <= budget, f"peak {peak.peak} of a budget of {budget}"
    assert os.listdir(cache / STAGING_DIR) == []
