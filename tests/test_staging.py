"""The staging area: the byte budget, free space, release, no leaks, no silent stall.

Everything here runs the real s5cmd against real local S3 servers.

A private module (``s5loader._engine``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import psutil
import pytest
from support.stores import Peak, Store, make_pairs, mount_tmpfs, staged_bytes, staged_samples
from support.waits import wait_for
from torch.utils.data import DataLoader

from s5loader import BudgetError, S5Dataset, S5Sampler, StagingSpaceError, StallError
from s5loader.testing import SeaweedFS


def collate(batch):
    return batch


def keys_of(source: dict[str, bytes]) -> list[str]:
    return sorted({k.rsplit(".", 1)[0] for k in source})


def test_peak_staged_bytes_never_exceeds_budget(seaweed: Store, staging_root: str) -> None:
    source = seaweed.put(make_pairs(200, size=2000))
    ds = S5Dataset.from_prefix(seaweed.uri(), endpoint_url=seaweed.endpoint)
    budget = ds.total_bytes // 10
    with S5Sampler(ds, budget=budget, samples_per_call=50, staging_dir=staging_root) as sampler:
        loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=4, collate_fn=collate)
        with Peak(lambda: staged_bytes(staging_root)) as watcher:
            got = [s for b in loader for s in b]
    assert sorted(s["__key__"] for s in got) == keys_of(source)
    assert all(s["image"] == source[s["__key__"] + ".image"] for s in got)
    assert watcher.looks > 50
    assert 0 < watcher.peak <= budget, f"peak {watcher.peak} > budget {budget}"


def test_a_pass_s_first_call_runs_a_worker_per_copy_the_rest_the_default(
    seaweed: Store, staging_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from s5loader._s5cmd import S5cmd

    source = seaweed.put(make_pairs(300, size=500))
    ds = S5Dataset.from_prefix(seaweed.uri(), endpoint_url=seaweed.endpoint)
    workers: list[int] = []
    real = S5cmd.run_file

    def recording(self: S5cmd, command_file: str, numworkers: int | None = None) -> subprocess.Popen[bytes]:
        workers.append(numworkers or self.numworkers)
        return real(self, command_file, numworkers)

    monkeypatch.setattr(S5cmd, "run_file", recording)
    with S5Sampler(ds, shuffle=True, seed=0, staging_dir=staging_root) as sampler:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            start = len(workers)
            assert sorted(ds[i]["__key__"] for i in sampler) == keys_of(source)
            # each pass's first call: 32 samples of 2 objects, a worker for each of its copies
            assert workers[start] == 64 and len(workers) - start > 1
            assert set(workers[start + 1 :]) == {32}


def test_budget_smaller_than_one_call_finishes(moto: Store, staging_root: str) -> None:
    source = moto.put(make_pairs(30, size=1000))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    three = 3 * max(s.size for s in ds.samples)
    with S5Sampler(ds, budget=three, samples_per_call=1000, staging_dir=staging_root) as sampler:
        got = [s for b in DataLoader(ds, sampler=sampler, batch_size=2, collate_fn=collate) for s in b]
        assert sampler.stats is not None and sampler.stats.peak_reserved <= three
        assert sampler.stats.calls >= 10  # cut into calls that fit
    assert sorted(s["__key__"] for s in got) == keys_of(source)


def test_sample_larger_than_budget(moto: Store, staging_root: str) -> None:
    moto.put({"0001.image": b"x" * 5000, "0001.label": b"1", "0002.image": b"y" * 10, "0002.label": b"2"})
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    with pytest.raises(BudgetError) as e:
        S5Sampler(ds, budget=4000, staging_dir=staging_root)
    msg = str(e.value)
    assert "train/0001" in msg and f"s3://data/{moto.prefix}0001.image" in msg
    assert "4.9 KiB" in msg and "3.9 KiB" in msg  # both sizes


@pytest.fixture
def small_fs() -> Iterator[str]:
    """A 256 KiB tmpfs made for the test."""
    with mount_tmpfs("256k", "s5loader-smallfs-") as d:
        yield d


def test_budget_larger_than_free_space(moto: Store, small_fs: str, caplog: pytest.LogCaptureFixture) -> None:
    moto.put(make_pairs(20, size=20000))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    assert ds.total_bytes > 256 * 1024
    with pytest.raises(BudgetError, match=f"does not fit .* free in {small_fs}"):
        S5Sampler(ds, budget="1MiB", staging_dir=small_fs)
    with S5Sampler(ds, budget="1MiB", staging_dir=small_fs, shrink_budget=True) as sampler:
        assert sampler.budget < 256 * 1024
        assert "budget shrunk" in caplog.text
        assert len([s for s in DataLoader(ds, sampler=sampler, batch_size=2)]) == 10


def test_full_file_system_stops_with_clear_error(moto: Store, small_fs: str) -> None:
    moto.put(make_pairs(12, size=40000))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    sampler = S5Sampler(ds, budget=200 * 1024, staging_dir=small_fs, samples_per_call=4, retries=5)
    filler = os.path.join(small_fs, "someone-elses-file")
    with open(filler, "wb") as f:  # someone else fills the disk after the check
        try:
            f.write(b"\0" * 200 * 1024)
        except OSError:
            pass
    with pytest.raises(StagingSpaceError, match="ran out of space") as e:
        for _ in DataLoader(ds, sampler=sampler, batch_size=2):
            pass
    assert sampler.staging_dir in str(e.value)
    assert sampler.stats is not None and sampler.stats.retries == 0  # a full disk is not retried
    assert os.path.exists(filler)  # never deletes what it did not stage
    sampler.close()
    assert os.listdir(small_fs) == ["someone-elses-file"]


SCRIPT = """
import os, signal, sys, time
from torch.utils.data import DataLoader
from s5loader import S5Dataset, S5Sampler
ds = S5Dataset.from_prefix({uri!r}, endpoint_url={endpoint!r})
sampler = S5Sampler(ds, staging_dir={root!r}, samples_per_call=5, budget=ds.total_bytes // 3)
loader = DataLoader(ds, sampler=sampler, batch_size=2, num_workers={workers})
for i, batch in enumerate(loader):
    if i == 0:
        print(sampler.staging_dir, flush=True)
    if i == 3:
        {action}
    time.sleep(0.05)
"""

ACTIONS = {
    "exception": "raise RuntimeError('boom')",
    "keyboardinterrupt": "raise KeyboardInterrupt",
    "sigterm": "os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)",
    "finish": "pass",
}


def s5cmd_children_of(staging: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if any(staging in part for part in cmd):
            out.append(p)
    return out


@pytest.mark.parametrize("how", sorted(ACTIONS))
def test_staging_directory_removed_on_every_exit(
    seaweed: Store, staging_root: str, tmp_path, how: str
) -> None:
    seaweed.put(make_pairs(60, size=500))
    script = tmp_path / "loader.py"
    script.write_text(
        SCRIPT.format(
            uri=seaweed.uri(), endpoint=seaweed.endpoint, root=staging_root, workers=2, action=ACTIONS[how]
        )
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    staging = proc.stdout.strip().splitlines()[0]
    assert staging.startswith(staging_root)
    expected_rc = {
        "exception": 1,
        "keyboardinterrupt": -signal.SIGINT,
        "sigterm": -signal.SIGTERM,
        "finish": 0,
    }[how]
    assert proc.returncode == expected_rc, proc.stderr[-2000:]
    assert not os.path.exists(staging)
    assert s5cmd_children_of(staging) == []


def test_abandoned_iterator_then_new_epoch(seaweed: Store, staging_root: str) -> None:
    source = seaweed.put(make_pairs(40, size=500))
    ds = S5Dataset.from_prefix(seaweed.uri(), endpoint_url=seaweed.endpoint)
    with S5Sampler(ds, staging_dir=staging_root, samples_per_call=10, shuffle=False) as sampler:
        for i, _ in enumerate(DataLoader(ds, sampler=sampler, batch_size=2, num_workers=2)):
            if i == 2:
                # Its workers were handed batches 0-6 at most (two each ahead of the three read),
                # so samples 14 and on stay staged, unread, once the second call has landed.
                wait_for(
                    lambda: any(int(s.split("/")[1]) >= 14 for s in staged_samples(sampler.staging_dir)),
                    30,
                    "the second call to stage a sample no worker was handed",
                )
                break
        import gc

        gc.collect()  # the abandoned iterator is gone: its s5cmd calls must be too
        assert s5cmd_children_of(sampler.staging_dir) == []
        abandoned = {s.split("/")[0] for s in staged_samples(sampler.staging_dir)}
        assert abandoned  # its staged files wait for the next pass (a worker may still read them)
        sampler.set_epoch(1)
        got = []
        for b in DataLoader(ds, sampler=sampler, batch_size=2, num_workers=2, collate_fn=collate):
            got += b
            assert not abandoned & {s.split("/")[0] for s in staged_samples(sampler.staging_dir)}
        assert sorted(s["__key__"] for s in got) == keys_of(source)
        assert staged_samples(sampler.staging_dir) == []
        staging = sampler.staging_dir
    assert not os.path.exists(staging)


def test_sigkilled_loader_leftovers_removed_by_next(seaweed: Store, staging_root: str, tmp_path) -> None:
    seaweed.put(make_pairs(60, size=500))
    script = tmp_path / "loader.py"
    script.write_text(
        SCRIPT.format(
            uri=seaweed.uri(),
            endpoint=seaweed.endpoint,
            root=staging_root,
            workers=2,
            action="time.sleep(60)",
        )
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    staging = proc.stdout.readline().strip()
    wait_for(lambda: staged_samples(staging), 30, "the loader to stage samples")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    wait_for(lambda: s5cmd_children_of(staging) == [], 15, "no orphaned downloader", interval=0.2)

    # The loader's DataLoader workers end by themselves: one waiting for the sampler's word on a
    # sample handed out early sees the sampler's socket close, and torch's watchdog sees its
    # parent gone.
    def workers() -> list[int]:
        return [
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] and str(script) in " ".join(p.info["cmdline"])
        ]

    wait_for(lambda: workers() == [], 60, "the killed loader's workers to end", interval=0.2)
    assert os.path.isdir(staging)  # SIGKILL leaves it behind ...
    ds = S5Dataset.from_prefix(seaweed.uri(), endpoint_url=seaweed.endpoint)
    alive = S5Sampler(ds, staging_dir=staging_root)  # a live loader's directory is never touched
    next(iter(alive))
    with S5Sampler(ds, staging_dir=staging_root) as sampler:
        next(iter(sampler))  # ... and the next loader on the same root removes it
        assert not os.path.exists(staging)
        assert os.path.isdir(alive.staging_dir)
    alive.close()


@pytest.fixture
def own_server(tmp_path) -> Iterator[SeaweedFS]:
    """A SeaweedFS of the test's own, to stop and resume."""
    with SeaweedFS(str(tmp_path / "weed"), ("data",)) as server:
        yield server
        server.resume()


def _put(server: SeaweedFS, n: int) -> dict[str, bytes]:
    store = Store("own", server.endpoint, "data", "train/")
    return store.put(make_pairs(n, size=500))


def test_server_that_stops_answering_ends_in_stall_error(own_server: SeaweedFS, staging_root: str) -> None:
    _put(own_server, 40)
    ds = S5Dataset.from_prefix("s3://data/train/", endpoint_url=own_server.endpoint)
    sampler = S5Sampler(
        ds,
        staging_dir=staging_root,
        samples_per_call=2,
        calls_in_flight=1,
        budget=4 * 600,
        stall_timeout=1.5,
        retries=1,
    )
    it = iter(DataLoader(ds, sampler=sampler, batch_size=1))
    next(it)
    own_server.pause()
    with pytest.raises(StallError, match="no progress for 1.5s") as e:  # the stall timer, not a hang
        for _ in it:
            pass
    assert "s3://data/train/" in str(e.value)
    sampler.close()


def test_server_back_within_retry_window(own_server: SeaweedFS, staging_root: str) -> None:
    source = _put(own_server, 40)
    ds = S5Dataset.from_prefix("s3://data/train/", endpoint_url=own_server.endpoint)
    with S5Sampler(
        ds,
        staging_dir=staging_root,
        samples_per_call=2,
        calls_in_flight=1,
        budget=4 * 600,
        stall_timeout=1.0,
        retries=4,
    ) as sampler:
        got = []
        for i, b in enumerate(DataLoader(ds, sampler=sampler, batch_size=1, collate_fn=collate)):
            got += b
            if i == 3:
                own_server.pause()
                threading.Timer(2.5, own_server.resume).start()
        assert sampler.stats is not None and sampler.stats.stalls >= 1
    assert sorted(s["__key__"] for s in got) == keys_of(source)
    assert len(got) == 40


def test_keep_staged_fetches_once_across_epochs(seaweed: Store, staging_root: str, caplog) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="s5loader")
    source = seaweed.put(make_pairs(30, size=200))
    ds = S5Dataset.from_prefix(seaweed.uri(), endpoint_url=seaweed.endpoint)
    with pytest.raises(BudgetError, match="keep_staged=True needs a budget that holds the whole data set"):
        S5Sampler(ds, keep_staged=True, budget=ds.total_bytes - 1, staging_dir=staging_root)
    with S5Sampler(
        ds, keep_staged=True, budget=ds.total_bytes, staging_dir=staging_root, samples_per_call=8
    ) as sampler:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            got = [
                s
                for b in DataLoader(ds, sampler=sampler, batch_size=3, num_workers=2, collate_fn=collate)
                for s in b
            ]
            assert sorted(s["__key__"] for s in got) == keys_of(source)
            assert all(s["image"] == source[s["__key__"] + ".image"] for s in got)
            stats = sampler.stats
            assert stats is not None
            assert (stats.calls, stats.staged_units) == ((4, 30) if epoch == 0 else (0, 0))
        assert len(staged_samples(sampler.staging_dir)) == 30
        staging = sampler.staging_dir
    assert not os.path.exists(staging)
    assert "waited" in caplog.text and "epoch 1: 0 samples" in caplog.text  # the per-epoch staging report


def test_budget_smaller_than_a_batch_is_a_clear_error(moto: Store, staging_root: str) -> None:
    moto.put(make_pairs(12, size=1000))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    one = max(s.size for s in ds.samples)
    sampler = S5Sampler(ds, budget=one, staging_dir=staging_root, stall_timeout=1.0)
    with pytest.raises(BudgetError, match="must hold at least one batch"):  # not a StallError
        for _ in DataLoader(ds, sampler=sampler, batch_size=4):  # the batch holds 1 sample of 4
            pass
    sampler.close()


def test_starvation_is_reported_at_warning(moto: Store, staging_root: str, caplog) -> None:
    import logging

    from s5loader._engine import Stats

    moto.put(make_pairs(2))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    with S5Sampler(ds, staging_dir=staging_root) as sampler, caplog.at_level(logging.INFO, logger="s5loader"):
        sampler._run.report(Stats(samples=10, wait_s=30.0, first_wait_s=0.5), 60.0, True, sampler.epoch)
        sampler._run.report(Stats(samples=10, wait_s=0.6, first_wait_s=0.5), 60.0, True, sampler.epoch)
    levels = [
        (r.levelname, r.getMessage().startswith("data starvation"))
        for r in caplog.records
        if "waited" in r.getMessage()
    ]
    assert levels == [("WARNING", True), ("INFO", False)]
    advice = next(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "calls_in_flight" in advice and "samples_per_call" in advice and "shuffle='block'" in advice


def test_own_sigterm_handler_is_left_alone(moto: Store, staging_root: str, tmp_path) -> None:
    moto.put(make_pairs(4))
    script = tmp_path / "own_handler.py"
    script.write_text(
        textwrap.dedent(f"""
        import signal
        from s5loader import S5Dataset, S5Sampler
        def mine(signum, frame):
            raise SystemExit(3)
        signal.signal(signal.SIGTERM, mine)
        ds = S5Dataset.from_prefix({moto.uri()!r}, endpoint_url={moto.endpoint!r})
        sampler = S5Sampler(ds, staging_dir={staging_root!r})
        it = iter(sampler); next(it)
        assert signal.getsignal(signal.SIGTERM) is mine
        print(sampler.staging_dir, flush=True)
        signal.raise_signal(signal.SIGTERM)
    """)
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr[-2000:]  # the program's handler ran
    assert not os.path.exists(r.stdout.strip())  # and atexit still cleaned up
