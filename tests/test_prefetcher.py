"""The daemon from Python (``s5loader.Prefetcher``), and the ``__key__`` file each delivered
folder carries: the folder name keeps only a shortened, file-name-safe form of the key.

A private module (``s5loader._daemon``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
from support.faults import FaultProxy, Rule
from support.stores import Store

from s5loader import DaemonError, Prefetcher, consume
from s5loader._daemon import main

LONG = "a dir/ünï côde & more/" + "long-name-" * 9  # > 64 characters, spaces, non-ASCII


def test_delivered_folder_carries_the_full_key(moto: Store, tmp_path) -> None:
    moto.put({f"{LONG}{i}.bin": bytes([i]) * 100 for i in range(3)})
    cache = tmp_path / "cache"
    rc = main(
        [
            moto.uri(),
            "--cache",
            str(cache),
            "--budget",
            "10000",
            "--endpoint-url",
            moto.endpoint,
            "--no-progress",
        ]
    )
    assert rc == 0
    got = []
    for sample in consume(cache, timeout=10):
        assert "ü" not in sample.name and len(sample.name) < len(sample.key)  # shortened and made safe
        with open(os.path.join(sample.path, "__key__"), encoding="utf-8") as f:
            assert f.read() == sample.key
        assert list(sample.files) == ["bin"]  # __key__ is not a field
        got.append((sample.key, sample.read("bin")))
    assert got == [(f"train/{LONG}{i}", bytes([i]) * 100) for i in range(3)]


def test_prefetcher_runs_the_daemon_and_stops_it_with_its_s5cmd(moto: Store, tmp_path) -> None:
    moto.put({f"{i:04d}.bin": bytes([i]) * 100 for i in range(8)})
    proxy = FaultProxy(moto.endpoint)
    proxy.rules.append(Rule("0003.bin", "hold", times=1))
    cache = tmp_path / "cache"
    args = {"cache": cache, "budget": "10KB", "endpoint_url": proxy.endpoint}
    try:
        with Prefetcher(moto.uri(), **args) as p:
            assert p.cache == str(cache) and psutil.pid_exists(p.pid)
            it = iter(p)
            first = [next(it).key for _ in range(3)]  # delivered while 0003 is held
            assert proxy.wait_held("0003.bin", 1, 30)
            daemon = psutil.Process(p.pid)
            s5cmd = [c for c in daemon.children(recursive=True) if "s5cmd" in c.name()]
            assert s5cmd, daemon.children(recursive=True)  # a copy is in flight
        assert p.proc is not None and p.proc.returncode == 0  # stopped by SIGTERM: exit code 0
        gone, alive = psutil.wait_procs(s5cmd, timeout=10)
        assert alive == []
        proxy.release.set()
        # the same arguments continue where it stopped; the sample left in the loop comes again
        with Prefetcher(moto.uri(), **args) as p:
            rest = [s.key for s in p]
            assert p.wait(timeout=30) == 0
    finally:
        proxy.close()
    assert first == [f"train/{i:04d}" for i in range(3)]
    assert rest == [f"train/{i:04d}" for i in range(2, 8)]


def test_prefetcher_that_cannot_start_names_the_source(moto: Store, tmp_path) -> None:
    with pytest.raises(DaemonError, match=r"s3://nosuchbucket/x/.*exited with code 1.*nosuchbucket"):
        with Prefetcher(
            "s3://nosuchbucket/x/", cache=tmp_path / "c", budget=1000, endpoint_url=moto.endpoint
        ):
            pass


def test_close_kills_a_daemon_that_ignores_sigterm(tmp_path) -> None:
    p = Prefetcher("s3://b/p/", cache=tmp_path / "c", budget=1000, stop_timeout=0.2)
    # stands in for a daemon stuck in a system call: it ignores SIGTERM
    p.proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    assert p.proc.stdout is not None and p.proc.stdout.readline() == b"ready\n"
    p.close()
    assert p.proc.returncode == -9
    p.close()  # twice is fine
    p.proc.stdout.close()
