"""A consumer learns that the daemon failed or is gone, and probing the daemon's lock is
harmless: the daemon and its consumers run as subprocesses (``s5loader prefetch``, the shell
loop of docs/daemon.md, ``consume``) against the real s5cmd and a local S3 server; the daemon is
killed with SIGKILL and stopped with SIGTERM at the moments a user hits.

A private module (``s5loader._daemon``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from support.stores import Store, free_port, make_pairs
from support.waits import wait_for
from test_daemon import PAIR, ROOT, daemon_argv, finish, json_events, s5cmd_on, start, state
from test_handover import doc_shell_consumer

from s5loader._daemon import LOCK_FILE
from s5loader._daemon.protocol import EPOCH_DIR
from s5loader.consume import END_MARKER, ERROR_MARKER, consume, ready_names
from s5loader.exceptions import DaemonError
from s5loader.handover import daemon_status

CONSUME = """
import sys
from s5loader.consume import consume
from s5loader.exceptions import DaemonError
out = open(sys.argv[2], "a")
try:
    for s in consume(sys.argv[1], grace=float(sys.argv[3])):
        out.write(s.name + "\\n")
        out.flush()
except DaemonError as exc:
    print(f"DaemonError: {exc}", file=sys.stderr)
    sys.exit(3)
"""


@pytest.fixture(autouse=True)
def no_process_left(tmp_path: Path) -> Iterator[None]:
    """Every process a test started whose command line names its folder ends with the test,
    whatever the test's outcome (a daemon, s5cmd, a shell loop, a consumer)."""
    yield
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if proc.pid != os.getpid() and any(str(tmp_path) in a for a in proc.info["cmdline"] or ()):
                proc.kill()


def prefetch(*args: str) -> list[str]:
    return [sys.executable, "-m", "s5loader", "prefetch", *args]


def shell_env(tmp_path: Path) -> dict[str, str]:
    """The environment of the docs' shell loop: ``train-step`` prints the label; ``s5loader`` is
    this environment's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    step = bin_dir / "train-step"
    step.write_text('#!/bin/sh\ncat "$2"\n')
    step.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}")


def run_shell_loop(cache: Path, tmp_path: Path) -> subprocess.Popen[str]:
    (tmp_path / "done").mkdir(exist_ok=True)
    script = doc_shell_consumer().replace("/data/cache", str(cache))
    return subprocess.Popen(
        ["bash", "-c", script], env=shell_env(tmp_path), stderr=subprocess.PIPE, text=True
    )


def sigcaught(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (from /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def loaded(pid: int, library: str) -> bool:
    return library in Path(f"/proc/{pid}/maps").read_text()


# -- 3. a consumer can tell that the daemon failed or is gone --------------------------------------
def test_a_start_up_failure_reaches_every_consumer_with_its_message(seaweed: Store, tmp_path: Path) -> None:
    seaweed.put(make_pairs(3, size=2000))
    cache = tmp_path / "cache"
    cache.mkdir()
    shell = run_shell_loop(cache, tmp_path)  # the consumers first, as a pipeline starts them
    log = tmp_path / "events.jsonl"
    daemon = subprocess.run(  # a budget smaller than a sample: it fails after listing, with the lock held
        prefetch(
            seaweed.uri(),
            "--cache",
            str(cache),
            "--budget",
            "1kB",
            "--endpoint-url",
            seaweed.endpoint,
            "--json-log",
            str(log),
        ),
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert daemon.returncode == 1 and "larger than the budget" in daemon.stderr, daemon.stderr
    error = (cache / ERROR_MARKER).read_text()
    assert "larger than the budget of 1000 B" in error and error.count("\n") == 1
    assert json_events(log)[-1]["event"] == "failed" and json_events(log)[-1]["error"] == error.strip()
    assert daemon_status(cache).state == "failed"
    with pytest.raises(DaemonError) as info:
        list(consume(cache, grace=0))
    assert str(cache) in str(info.value) and "larger than the budget" in str(info.value)
    # the shell loop of the docs ends with the daemon's message once no daemon took the cache
    _, err = shell.communicate(timeout=60)
    assert shell.returncode == 1 and "larger than the budget" in err and str(cache) in err, err
    status = subprocess.run(prefetch("--status", str(cache)), capture_output=True, text=True, timeout=60)
    assert (
        status.returncode == 1 and "failed: " in status.stderr and "larger than the budget" in status.stderr
    )
    # a daemon started again with a budget that holds the samples takes over: ERROR goes
    fixed = start(
        daemon_argv(seaweed.uri(), cache, 3 * PAIR, "--endpoint-url", seaweed.endpoint), tmp_path / "d.log"
    )
    assert len(list(consume(cache, timeout=60))) == 3
    assert finish(fixed) == 0, (tmp_path / "d.log").read_text()
    assert not (cache / ERROR_MARKER).exists() and daemon_status(cache).state == "done"


def test_kill_9_ends_the_consumers_and_a_restart_serves_them_again(seaweed: Store, tmp_path: Path) -> None:
    seaweed.put(make_pairs(20, size=2000))
    cache = tmp_path / "cache"
    argv = daemon_argv(
        seaweed.uri(), cache, 3 * PAIR, "--endpoint-url", seaweed.endpoint, "--samples-per-call", "2"
    )
    daemon = start(argv, tmp_path / "first.log")
    wait_for(lambda: daemon_status(cache).state == "running", timeout=60, what="the daemon to take the cache")
    got = tmp_path / "got.txt"
    consumer = subprocess.Popen(
        [sys.executable, "-c", CONSUME, str(cache), str(got), "2"],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    shell = run_shell_loop(cache, tmp_path)
    wait_for(lambda: state(cache).get("delivered", 0) >= 6, what="6 deliveries")
    assert daemon_status(cache).state == "running"
    daemon.kill()  # no chance to write anything
    daemon.wait()
    _, err = consumer.communicate(timeout=60)
    assert consumer.returncode == 3, err
    assert "DaemonError" in err and str(cache) in err and "ended before the end" in err, err
    _, shell_err = shell.communicate(timeout=60)
    assert shell.returncode == 1 and "start it again with the same arguments" in shell_err, shell_err
    status = subprocess.run(prefetch("--status", str(cache)), capture_output=True, text=True, timeout=60)
    assert status.returncode == 1 and f"pid {daemon.pid}" in status.stderr, status.stderr
    wait_for(lambda: s5cmd_on(cache) == [], what="the killed daemon's s5cmd to end")
    # the same arguments continue; the consumers started again get the rest, each sample once
    again = start(argv, tmp_path / "second.log")
    more = [s.name for s in consume(cache, timeout=60)]
    assert finish(again) == 0, (tmp_path / "second.log").read_text()
    seen = (got.read_text().split() if got.exists() else []) + sorted(
        p.name for p in (tmp_path / "done").iterdir()
    )
    assert sorted(seen + more) == sorted(set(seen + more)) and len(seen + more) == 20


def test_a_probe_of_the_lock_never_fails_a_restart(seaweed: Store, tmp_path: Path) -> None:
    seaweed.put(make_pairs(4, size=2000))
    cache = tmp_path / "cache"
    argv = daemon_argv(
        seaweed.uri(), cache, 2 * PAIR, "--endpoint-url", seaweed.endpoint, "--samples-per-call", "1"
    )
    first = start(argv, tmp_path / "first.log")
    wait_for(lambda: len(ready_names(str(cache))) == 2, what="a full cache")
    first.kill()
    first.wait()
    assert (cache / LOCK_FILE).read_text().strip() == str(first.pid)  # a dead daemon's pid
    # a consumer's probe holds the lock when the daemon starts again (util-linux flock; an
    # exclusive one, the obvious check, which the docs' shared one is gentler than)
    probe = subprocess.Popen(["flock", "-n", str(cache / LOCK_FILE), "cat"], stdin=subprocess.PIPE)
    wait_for(
        lambda: daemon_status(cache).state == "running", what="the probe to hold the lock"
    )  # as if a daemon
    log = tmp_path / "second.log"
    second = start(argv, log)
    wait_for(lambda: "is held for now" in log.read_text(), what="the daemon to wait for the lock")
    assert second.poll() is None
    probe.communicate(timeout=10)  # the probe lets go
    names = [s.name for s in consume(cache, timeout=60)]
    assert finish(second) == 0, log.read_text()
    assert len(names) == 4 and (cache / END_MARKER).exists()
    assert f"pid {first.pid}" not in log.read_text()


def test_sigterm_while_python_loads_the_daemon_exits_0_and_says_so(seaweed: Store, tmp_path: Path) -> None:
    seaweed.put(make_pairs(2, size=100))
    log = tmp_path / "d.log"
    daemon = start(
        daemon_argv(seaweed.uri(), tmp_path / "cache", 10 * PAIR, "--endpoint-url", seaweed.endpoint), log
    )
    # SIGTERM once the command has a handler for it, and torch is not loaded yet

    def handler_or_exit() -> bool:
        assert daemon.poll() is None, "the daemon exited before it took a SIGTERM handler"
        return sigcaught(daemon.pid, signal.SIGTERM)

    wait_for(handler_or_exit, 30, "the daemon to take a SIGTERM handler", interval=0.002)
    assert not loaded(daemon.pid, "libtorch"), "the daemon took SIGTERM only after loading torch"
    daemon.send_signal(signal.SIGTERM)
    assert finish(daemon, timeout=60) == 0, log.read_text()
    assert "stopped by SIGTERM before" in log.read_text()
    cache = tmp_path / "cache"
    assert not cache.exists() or os.listdir(cache) == [LOCK_FILE]  # at most the cache's lock, released


def test_sigterm_stops_a_daemon_whose_samples_are_always_ready(seaweed: Store, tmp_path: Path) -> None:
    seaweed.put({f"{i:04d}.bin": b"x" for i in range(600)})
    cache, events = tmp_path / "cache", tmp_path / "events.jsonl"
    daemon = start(
        daemon_argv(
            seaweed.uri(), cache, 10**6, "--endpoint-url", seaweed.endpoint, "--json-log", str(events)
        ),
        tmp_path / "d.log",
    )
    wait_for(lambda: state(cache).get("delivered", 0) >= 5, timeout=60, what="5 deliveries")
    daemon.send_signal(signal.SIGTERM)
    assert finish(daemon, timeout=60) == 0, (tmp_path / "d.log").read_text()
    assert json_events(events)[-1]["event"] == "stopped" and not (cache / END_MARKER).exists()
    assert state(cache)["delivered"] < 600


def test_status_of_a_running_daemon_counts_the_budget_as_du_cannot(seaweed: Store, tmp_path: Path) -> None:
    seaweed.put(make_pairs(40, size=2000))
    cache = tmp_path / "cache"
    budget = 20 * PAIR
    daemon = start(
        daemon_argv(
            seaweed.uri(), cache, budget, "--endpoint-url", seaweed.endpoint, "--samples-per-call", "20"
        ),
        tmp_path / "d.log",
    )
    try:
        wait_for(lambda: len(ready_names(str(cache))) == 20, timeout=60, what="a full cache")
        status = subprocess.run(prefetch("--status", str(cache)), capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and status.stdout.startswith("running: "), status.stderr
        assert f"{20 * PAIR} bytes of samples in the cache" in status.stdout, status.stdout
        du = int(subprocess.run(["du", "-sb", str(cache)], capture_output=True, text=True).stdout.split()[0])
        assert du > budget  # the folders and control files, which the budget does not count
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert finish(daemon) == 0


def test_cli_errors_name_the_flag_and_echo_the_size_as_typed(tmp_path: Path) -> None:
    port = free_port()  # nobody listens
    cache = tmp_path / "cache"
    r = subprocess.run(
        prefetch(
            "s3://demo/train/",
            "--cache",
            str(cache),
            "--budget",
            "300kB",
            "--endpoint-url",
            f"http://127.0.0.1:{port}",
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert "--endpoint-url" in r.stderr and "endpoint_url=" not in r.stderr, r.stderr
    assert "endpoint_url=" not in (cache / ERROR_MARKER).read_text()


def test_a_budget_too_small_names_it_as_typed(seaweed: Store, tmp_path: Path) -> None:
    seaweed.put(make_pairs(2, size=300_500))
    r = subprocess.run(
        prefetch(
            seaweed.uri(),
            "--cache",
            str(tmp_path / "cache"),
            "--budget",
            "300kB",
            "--endpoint-url",
            seaweed.endpoint,
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "budget of 293.0 KiB (300 kB)" in r.stderr, r.stderr


def test_the_start_event_and_each_sample_say_the_epoch(seaweed: Store, tmp_path: Path) -> None:
    seaweed.put(make_pairs(5, size=100))
    cache, events = tmp_path / "cache", tmp_path / "events.jsonl"
    daemon = start(
        daemon_argv(
            seaweed.uri(),
            cache,
            10**5,
            "--endpoint-url",
            seaweed.endpoint,
            "--epochs",
            "3",
            "--shuffle",
            "--json-log",
            str(events),
        ),
        tmp_path / "d.log",
    )
    got = [(s.seq, s.epoch, sorted(s.files)) for s in consume(cache, timeout=60)]
    assert finish(daemon) == 0, (tmp_path / "d.log").read_text()
    assert [(seq, epoch) for seq, epoch, _ in got] == [(i, i // 5) for i in range(15)]
    assert all(files == ["image", "label"] for _, _, files in got)  # __epoch__ is not a field
    start_event = json_events(events)[0]
    assert (start_event["total"], start_event["epochs"], start_event["per_epoch"]) == (15, 3, 5)
    end = json.loads((cache / END_MARKER).read_text())
    assert end["samples"] == 15


def test_the_epoch_cache_folder_goes_after_the_end_through_kill_9_and_restarts(
    seaweed: Store, tmp_path: Path
) -> None:
    seaweed.put(make_pairs(12, size=2000))
    cache = tmp_path / "cache"
    argv = daemon_argv(
        seaweed.uri(),
        cache,
        3 * PAIR,
        "--endpoint-url",
        seaweed.endpoint,
        "--samples-per-call",
        "2",
        "--epochs",
        "2",
        "--shuffle",
        "--epoch-cache",
        str(12 * PAIR),
    )
    names = []
    # in the first epoch, twice (the second epoch's samples come from the epoch cache, beside the
    # budget, and a daemon delivers them all at once)
    for kill_at in (4, 8):
        daemon = start(argv, tmp_path / f"d{kill_at}.log")
        for s in consume(cache, timeout=60):
            if len(names) == kill_at:
                break  # this sample goes back to the cache, for the next run's consumer
            names.append(s.name)
        daemon.kill()
        daemon.wait()
        assert (cache / EPOCH_DIR).is_dir(), (
            kill_at,
            os.listdir(cache),
            (tmp_path / f"d{kill_at}.log").read_text()[-3000:],
        )  # kept for the next run
    last = start(argv, tmp_path / "last.log")
    try:
        names += [s.name for s in consume(cache, timeout=60)]
    except DaemonError as exc:
        raise AssertionError((tmp_path / "last.log").read_text()[-4000:]) from exc
    assert finish(last) == 0, (tmp_path / "last.log").read_text()
    assert sorted(names) == sorted(set(names)) and len(names) == 24
    assert sorted(os.listdir(cache)) == [".claimed", ".lock", ".staging", ".state.json", END_MARKER]
    assert os.listdir(cache / ".claimed") == [] and os.listdir(cache / ".staging") == []


@contextlib.contextmanager
def silent_endpoint() -> Iterator[str]:
    """An endpoint on loopback that accepts connections and never answers: a daemon that lists
    it stays in its start-up (the lock taken, no state yet) until it is stopped. Closing it on
    exit ends the orphaned s5cmd of a killed daemon."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


def started(daemon: subprocess.Popen[bytes], cache: Path) -> bool:
    """Whether the daemon has taken the cache (its pid in the lock) and written no state yet."""
    assert daemon.poll() is None, "the daemon ended during its start-up"
    lock = cache / LOCK_FILE
    taken = lock.exists() and lock.read_text().strip() == str(daemon.pid)
    assert not taken or not state(cache), "the daemon wrote its state: the start-up window is gone"
    return taken


@pytest.mark.parametrize("how", ["kill -9", "SIGTERM"])
def test_a_daemon_stopped_while_it_starts_ends_its_consumers(how: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    log = tmp_path / "d.log"
    with silent_endpoint() as endpoint:
        daemon = start(daemon_argv("s3://demo/train/", cache, 10**6, "--endpoint-url", endpoint), log)
        got = tmp_path / "got.txt"
        consumer = subprocess.Popen(  # the consumers first, as a pipeline starts them
            [sys.executable, "-c", CONSUME, str(cache), str(got), "3"],
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        shell = run_shell_loop(cache, tmp_path)
        wait_for(
            lambda: started(daemon, cache), timeout=60, what="the daemon to take the cache", interval=0.005
        )
        if how == "kill -9":
            daemon.kill()
            daemon.wait()
        else:
            daemon.send_signal(signal.SIGTERM)
            assert finish(daemon, timeout=60) == 0, log.read_text()
            assert "stopped by SIGTERM before the first delivery" in log.read_text()
        # the status of the cache says so: the pid in the lock, gone while it started
        found = daemon_status(cache)
        assert found.state == "gone" and found.pid == daemon.pid, found
        status = subprocess.run(prefetch("--status", str(cache)), capture_output=True, text=True, timeout=60)
        assert status.returncode == 1, status.stdout
        assert f"pid {daemon.pid}" in status.stderr and "while it started" in status.stderr, status.stderr
        # a consumer that waited ends within its grace with the reason; so does the docs' shell loop
        _, err = consumer.communicate(timeout=60)
        assert consumer.returncode == 3 and "while it started" in err and str(cache) in err, err
        _, shell_err = shell.communicate(timeout=60)
        assert shell.returncode == 1 and "while it started" in shell_err, shell_err
        with pytest.raises(DaemonError, match="while it started"):
            list(consume(cache, grace=0.5))
