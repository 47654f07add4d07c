"""The daemon's cache directory as a consumer sees it, on folders made by hand: claims, the
daemon's status from its lock and markers, the bytes the budget counts, the ledger of what
consumers took, the lock a probe holds; and sizes and flags as the command line says them.

Private modules (``s5loader._util``, ``s5loader._daemon``) are imported on purpose: their own
behaviour is what these tests check."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from pathlib import Path

import pytest

from s5loader._daemon.cache_state import Ledger
from s5loader._daemon.lock import CacheLock
from s5loader._util.uri import for_cli, format_size
from s5loader.consume import consume
from s5loader.exceptions import DaemonError, StallError
from s5loader.handover import (
    CLAIMED_DIR,
    END_MARKER,
    ERROR_MARKER,
    LOCK_FILE,
    STAGING_DIR,
    STATE_FILE,
    claim,
    daemon_status,
    lock_held,
    sample_bytes,
    unclaim,
)


def deliver(cache: Path, name: str, size: int = 10) -> Path:
    folder = cache / name
    folder.mkdir(parents=True)
    (folder / "data").write_bytes(b"x" * size)
    (folder / "__key__").write_text("k/" + name)
    (folder / "__epoch__").write_text("0")
    return folder


def test_a_claim_goes_to_one_consumer_and_can_be_handed_back(tmp_path: Path) -> None:
    deliver(tmp_path, "000000000000-a")
    assert claim(str(tmp_path), "000000000000-a") == str(tmp_path / CLAIMED_DIR / "000000000000-a")
    assert claim(str(tmp_path), "000000000000-a") is None  # another consumer was first
    assert unclaim(str(tmp_path), "000000000000-a") and (tmp_path / "000000000000-a" / "data").exists()
    assert not unclaim(str(tmp_path), "000000000000-a")


def test_status_from_the_lock_and_the_markers(tmp_path: Path) -> None:
    cache = str(tmp_path)
    assert daemon_status(cache).state == "absent" and lock_held(cache) is None
    (tmp_path / LOCK_FILE).write_text("4242\n")
    (tmp_path / STATE_FILE).write_text(json.dumps({"delivered": 3, "samples": 5, "epochs": 2, "done": False}))
    gone = daemon_status(cache)
    assert (gone.state, gone.pid, gone.delivered, gone.total, gone.alive) == ("gone", 4242, 3, 10, False)
    assert "3 of 10 samples delivered" in gone.describe() and cache in gone.describe()
    fd = os.open(tmp_path / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as the daemon holds it
        assert lock_held(cache) and daemon_status(cache).state == "running"
        (tmp_path / ERROR_MARKER).write_text("boom\n")
        assert daemon_status(cache).state == "running"  # the new daemon removes an old ERROR
    finally:
        os.close(fd)
    failed = daemon_status(cache)
    assert (failed.state, failed.error) == ("failed", "boom") and "failed: boom" in failed.describe()
    with pytest.raises(DaemonError, match="failed: boom"):
        list(consume(cache, grace=0))
    (tmp_path / ERROR_MARKER).unlink()
    (tmp_path / STATE_FILE).write_text(json.dumps({"delivered": 10, "samples": 5, "epochs": 2, "done": True}))
    (tmp_path / END_MARKER).write_text("{}\n")
    assert daemon_status(cache).state == "done"


def test_a_consumer_waits_for_a_daemon_that_never_ran_on_the_cache(tmp_path: Path) -> None:
    with pytest.raises(StallError):  # not a DaemonError: the daemon may start after the consumer
        list(consume(tmp_path, grace=0, timeout=0.3, poll_interval=0.01))


def test_a_consumer_gives_a_missing_daemon_its_grace(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).write_text("4242\n")
    (tmp_path / STATE_FILE).write_text(json.dumps({"delivered": 0, "samples": 5, "epochs": 1}))

    def restart() -> None:  # a daemon takes the cache within the grace, delivers, ends
        fd = os.open(tmp_path / LOCK_FILE, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        # made aside and renamed into place, as a daemon delivers: a consumer may claim a folder
        # the moment it appears
        os.rename(deliver(tmp_path / ".making", "000000000000-a"), tmp_path / "000000000000-a")
        (tmp_path / END_MARKER).write_text("{}\n")
        os.close(fd)

    names = []
    timer = threading.Timer(0.3, restart)
    timer.start()
    for s in consume(tmp_path, grace=30, poll_interval=0.01, timeout=60):
        names.append(s.name)
    timer.join()
    assert names == ["000000000000-a"]


def test_sample_bytes_counts_what_the_budget_counts(tmp_path: Path) -> None:
    deliver(tmp_path, "000000000000-a", 100)
    deliver(tmp_path / CLAIMED_DIR, "000000000001-b", 20)
    staged = tmp_path / STAGING_DIR / "s5loader-1-x" / "2"
    staged.mkdir(parents=True)
    (staged / "data").write_bytes(b"y" * 7)
    (staged.parent / ".lock").write_text("{}")
    (staged.parent / ".calls").mkdir()
    (staged.parent / ".calls" / "c1.txt").write_text("cp ... " * 10)
    (tmp_path / ".epoch-cache").mkdir()
    (tmp_path / ".epoch-cache" / "big").write_bytes(b"z" * 1000)
    (tmp_path / STATE_FILE).write_text("{}" * 50)
    assert sample_bytes(tmp_path) == 127


def test_the_ledger_counts_a_claimed_sample_until_it_is_deleted(tmp_path: Path) -> None:
    ledger = Ledger(str(tmp_path))
    deliver(tmp_path, "000000000000-a")
    ledger.add(0, "000000000000-a", 10)
    claimed = claim(str(tmp_path), "000000000000-a")
    assert claimed is not None
    ledger.refresh(force=True)
    assert not ledger.is_released(0) and ledger.count == 1
    unclaim(str(tmp_path), "000000000000-a")  # handed back: still not consumed
    ledger.refresh(force=True)
    assert not ledger.is_released(0)
    os.rename(tmp_path / "000000000000-a", claimed)
    (Path(claimed) / "data").unlink()
    (Path(claimed) / "__key__").unlink()
    (Path(claimed) / "__epoch__").unlink()
    os.rmdir(claimed)
    ledger.refresh(force=True)
    assert ledger.is_released(0) and ledger.count == 0


def test_a_starting_daemon_waits_for_a_probe_but_not_for_a_live_daemon(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lock = tmp_path / LOCK_FILE
    lock.write_text("999999999\n")  # the pid of a daemon long gone
    probe = os.open(lock, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH)
    threading.Timer(0.3, os.close, (probe,)).start()  # the probe lets go
    with caplog.at_level(logging.INFO):
        held = CacheLock(str(tmp_path)).acquire()
    assert "is held for now" in caplog.text and lock.read_text() == f"{os.getpid()}\n"
    # a second daemon: the pid in the lock is alive, so it is refused at once
    other = tmp_path / "other"
    other.mkdir()
    (other / LOCK_FILE).write_text(f"{os.getppid()}\n")
    first = CacheLock(str(other)).acquire()
    (other / LOCK_FILE).write_text(f"{os.getppid()}\n")  # as a daemon in another process writes it
    with pytest.raises(DaemonError, match=rf"another s5loader prefetch daemon \(pid {os.getppid()}\)"):
        CacheLock(str(other)).acquire()
    first.release()
    held.release()


def test_sizes_read_as_typed_and_errors_name_flags() -> None:
    assert format_size(300_000) == "293.0 KiB (300 kB)"
    assert format_size(1_500_000) == "1.4 MiB (1.5 MB)"
    assert format_size(2 * 1024**3) == "2.0 GiB" and format_size(10_089) == "9.9 KiB"
    text = "check the store. The endpoint is endpoint_url= (--endpoint-url), else AWS_ENDPOINT_URL"
    assert for_cli(text) == "check the store. The endpoint is --endpoint-url, else AWS_ENDPOINT_URL"
