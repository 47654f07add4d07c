"""Lifetimes: several samplers on one dataset, persistent workers after a ``break``.

Private modules (``s5loader._engine``, ``s5loader._s5cmd``) are imported only where they are the
seam under test; the rest goes through the public API."""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from support.stores import Store, make_pairs, staged_samples
from support.waits import wait_for
from torch.utils.data import DataLoader, DistributedSampler

from s5loader import S5Dataset, S5Sampler


def collate(batch):
    return batch


class CountingEndpoint:
    """A TCP port that accepts connections, counts them and closes them: an S3 endpoint that
    can never answer, so that a dataset pointed at it proves it fetched nothing directly."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def no_direct_fetch() -> Iterator[CountingEndpoint]:
    endpoint = CountingEndpoint()
    yield endpoint
    endpoint.close()


def expected(ds: S5Dataset, shuffle: bool, seed: int, epoch: int) -> list[str]:
    ref = DistributedSampler(range(len(ds)), num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
    ref.set_epoch(epoch)
    return [ds.samples[i].key for i in ref]


def check(got: list[dict[str, Any]], want: list[str], source: dict[str, bytes]) -> None:
    assert [s["__key__"] for s in got] == want
    for s in got:
        assert s["image"] == source[s["__key__"] + ".image"] and s["label"] == source[s["__key__"] + ".label"]


def test_two_samplers_on_one_dataset(
    moto: Store, staging_root: str, no_direct_fetch: CountingEndpoint
) -> None:
    """A training and an evaluation sampler on the same dataset, used one after the other and
    with both iterators alive at once: each loader reads its own staging directory."""
    source = moto.put(make_pairs(30, size=200))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    budget = 8 * max(s.size for s in ds.samples)  # two batches and the workers' prefetch
    train = S5Sampler(
        ds,
        shuffle=True,
        seed=3,
        budget=budget,
        samples_per_call=4,
        staging_dir=staging_root,
        stall_timeout=20,
    )
    evaluation = S5Sampler(
        ds, shuffle=False, budget=budget, samples_per_call=4, staging_dir=staging_root, stall_timeout=20
    )
    ds.endpoint_url = no_direct_fetch.url  # the samplers stage with s5cmd; the dataset cannot fetch
    assert train.staging_dir != evaluation.staging_dir
    train_loader = DataLoader(ds, sampler=train, batch_size=2, num_workers=2, collate_fn=collate)
    eval_loader = DataLoader(ds, sampler=evaluation, batch_size=2, num_workers=2, collate_fn=collate)
    with train, evaluation:
        for epoch in range(2):  # one after the other
            train.set_epoch(epoch)
            check([s for b in train_loader for s in b], expected(ds, True, 3, epoch), source)
            check([s for b in eval_loader for s in b], expected(ds, False, 0, 0), source)
        train.set_epoch(2)  # interleaved: both iterators alive at once
        got: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
        iters = {"train": iter(train_loader), "eval": iter(eval_loader)}
        while iters:
            for name, it in list(iters.items()):
                batch = next(it, None)
                if batch is None:
                    del iters[name]
                else:
                    got[name] += batch
        check(got["train"], expected(ds, True, 3, 2), source)
        check(got["eval"], expected(ds, False, 0, 0), source)
        for s in (train, evaluation):
            assert staged_samples(s.staging_dir) == []  # every staged file read and released
            assert s.stats is not None and s.stats.skipped == [] and s.stats.staged_units == 30
    assert no_direct_fetch.connections == 0  # nothing was fetched around the staging directories
    assert not os.path.exists(train.staging_dir) and not os.path.exists(evaluation.staging_dir)


class GatedDataset(S5Dataset):
    """Each DataLoader worker reads ``free`` samples, then waits until ``gate`` exists."""

    gate = ""
    free = 0

    def __getitem__(self, index: int) -> Any:
        self.free -= 1
        if self.free < 0:
            while not os.path.exists(self.gate):
                time.sleep(0.01)
        return super().__getitem__(index)


def test_persistent_workers_after_a_break(
    moto: Store, staging_root: str, tmp_path, no_direct_fetch: CountingEndpoint
) -> None:
    """A ``break``, then the next epoch: the persistent workers read the samples still queued
    for them from the abandoned pass (while iter(loader) waits for them) and the new epoch is
    complete and exact, with no sample fetched around the staging directory."""
    source = moto.put(make_pairs(24, size=200))
    ds = GatedDataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    ds.gate, ds.free = str(tmp_path / "gate"), 2  # each worker's first batch, then the gate
    with S5Sampler(ds, seed=9, samples_per_call=4, staging_dir=staging_root) as sampler:
        ds.endpoint_url = no_direct_fetch.url
        loader = DataLoader(
            ds, sampler=sampler, batch_size=2, num_workers=2, persistent_workers=True, collate_fn=collate
        )
        sampler.set_epoch(0)
        it = iter(loader)
        first = next(it)
        check(first, expected(ds, True, 9, 0)[:2], source)
        del it  # the break: batches 1..3 stay queued in the workers, behind the gate
        old = weakref.ref(loader._iterator._sampler_iter)  # type: ignore[union-attr]

        def open_gate() -> None:
            # once the next iter(loader) has dropped the old pass (the sampler's iterator is
            # replaced, and so closed, before the workers are drained), let the workers read
            deadline = time.monotonic() + 60
            while old() is not None and time.monotonic() < deadline:
                time.sleep(0.005)
            open(ds.gate, "w").close()

        opener = threading.Thread(target=open_gate)
        opener.start()
        sampler.set_epoch(1)
        got = [s for b in loader for s in b]
        opener.join()
        check(got, expected(ds, True, 9, 1), source)
        assert no_direct_fetch.connections == 0  # no queued read found its sample gone
        assert staged_samples(sampler.staging_dir) == []
        del loader


class BlackHole:
    """An S3 endpoint that accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


WAITING_SCRIPT = """
import sys, time
from s5loader import S5Dataset, S5Sampler
uri, endpoint, hole, root, where = sys.argv[1:6]
ds = S5Dataset.from_prefix(uri, endpoint_url=endpoint)
ds.endpoint_url = hole  # staging requests go to a server that never answers
sampler = S5Sampler(ds, staging_dir=root, samples_per_call=2, stall_timeout=3600)
print(sampler.staging_dir, flush=True)
if where != "waiting":
    # The moment a signal can land between two instructions of the waiting loop: the main
    # thread holds the staging engine's lock, which the engine's thread needs to go on.
    from s5loader._engine import stager as _stager

    def wait(self, pos):
        with self._cond:
            time.sleep(3600)

    _stager.Stager.wait = wait
next(iter(sampler))  # waits for the first sample, for ever
"""


@pytest.mark.parametrize("where", ["waiting", "holding the engine's lock"])
def test_sigterm_while_the_sampler_waits(moto: Store, staging_root: str, tmp_path, where: str) -> None:
    import signal
    import subprocess
    import sys

    import psutil

    moto.put(make_pairs(10, size=100))
    hole = BlackHole()
    script = tmp_path / "wait.py"
    script.write_text(WAITING_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), moto.uri(), moto.endpoint, hole.url, staging_root, where],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        staging = proc.stdout.readline().strip()
        assert staging.startswith(staging_root)
        wait_for(lambda: hole.held, 60, "s5cmd to connect")  # its request hangs: the sampler waits
        s5cmd = [c for c in psutil.Process(proc.pid).children(recursive=True) if "s5cmd" in c.name()]
        assert s5cmd
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=10)  # promptly, not blocked on a lock the main thread holds
        assert rc == -signal.SIGTERM, proc.stderr.read()[-2000:] if proc.stderr else ""
        assert not os.path.exists(staging)
        assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in s5cmd)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        hole.close()


def test_a_fork_while_s5cmd_starts_does_not_hold_the_start() -> None:
    """A process forked by one thread while another starts s5cmd (a DataLoader forking its
    workers while a staging pass runs) must not keep that start waiting until it exits: the
    main thread may be waiting for the starting thread meanwhile (a replaced pass closing)."""
    import signal

    from s5loader._s5cmd import S5cmd

    s5 = S5cmd()
    done = threading.Event()
    starts: list[int] = []  # the pids of the s5cmd started

    def start_again_and_again() -> None:
        while not done.is_set():
            proc = s5.start(["version"])
            starts.append(proc.pid)
            proc.communicate()

    starter = threading.Thread(target=start_again_and_again, daemon=True)
    starter.start()
    children = []
    try:
        for _ in range(40):
            pid = os.fork()
            if pid == 0:  # a worker that never execs, and outlives the test unless killed
                time.sleep(60)
                os._exit(0)
            children.append(pid)
            time.sleep(0.01)
        done.set()
        starter.join(timeout=20)
        assert not starter.is_alive(), "starting s5cmd waits for a forked process to exit"
    finally:
        done.set()
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        starter.join()
    assert len(starts) > 1  # s5cmd started again and again while the forked workers lived


def _s5cmd_children() -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process().children(recursive=True) if p.name() == "s5cmd"]


def test_a_notebook_that_retries_a_loader_whose_transform_raises_leaves_nothing(
    moto: Store, staging_root: str
) -> None:
    import gc

    moto.put(make_pairs(200, size=2000))

    def transform(sample: dict[str, Any]) -> dict[str, Any]:
        if sample["__key__"].endswith("0009"):
            raise ValueError("a bad sample")
        return sample

    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint, transform=transform)
    runs = []
    for _ in range(3):  # no with, no close(): as a notebook cell run again after each error
        sampler = S5Sampler(ds, staging_dir=staging_root, shuffle=False, budget=40_000, samples_per_call=16)
        loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=2, collate_fn=collate)
        try:
            for _batch in loader:
                pass
        except ValueError:
            pass
        runs.append(weakref.ref(sampler))
        # the samplers of earlier tries were collected when this one was made: one folder left
        # once their closing (joining their engine threads) is done
        mine = [os.path.basename(sampler.staging_dir)]
        wait_for(lambda mine=mine: os.listdir(staging_root) == mine, 30, "the earlier tries' folders to go")
    del loader, sampler
    gc.collect()  # torch's re-raise holds the last try's loader in a reference cycle until then
    assert all(r() is None for r in runs)
    wait_for(lambda: os.listdir(staging_root) == [], 30, "the staging folders to go")
    wait_for(lambda: _s5cmd_children() == [], 30, "the s5cmd children to end")


@pytest.mark.parametrize("how", ["setpriv", "preexec_fn"])
def test_s5cmd_dies_with_the_process_that_started_it(tmp_path, how: str) -> None:
    """s5cmd starts through util-linux's ``setpriv --pdeathsig KILL`` where there is one (so
    Python starts it by vfork), else with a ``preexec_fn`` that asks the kernel the same; either
    way a loader killed with SIGKILL takes its s5cmd with it."""
    import subprocess
    import sys
    import textwrap

    import psutil

    from s5loader._s5cmd import process

    if how == "setpriv" and not process.death_prefix():
        pytest.skip("no setpriv that takes --pdeathsig on this machine")
    # s5cmd reads its lines from a pipe this test holds open: it ends only if it is killed
    r, w = os.pipe()
    script = tmp_path / "starter.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import time
            from s5loader._s5cmd import process
            if {how!r} == "preexec_fn":
                process._SETPRIV = []
            proc = process.S5cmd(endpoint_url="http://127.0.0.1:9").start(["run"], stdin={r})
            print(proc.pid, flush=True)
            time.sleep(120)
            """
        )
    )
    argv = [sys.executable, str(script)]
    starter = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, pass_fds=(r,))
    os.close(r)
    try:
        assert starter.stdout is not None
        child = psutil.Process(int(starter.stdout.readline()))
        wait_for(lambda: child.name() == "s5cmd", 10, "setpriv to run s5cmd in its place")
        assert child.ppid() == starter.pid
        starter.kill()
        starter.wait()
        wait_for(
            lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE,
            10,
            "s5cmd to die with the process that started it",
        )
    finally:
        starter.kill()
        os.close(w)


RACE = """
import os, threading, time
from s5loader._s5cmd.process import S5cmd
stop, kids = False, []
def forker():
    while not stop:
        pid = os.fork()
        if pid == 0:
            time.sleep(0.3)
            os._exit(0)
        kids.append(pid)
        time.sleep(0.0005)
t = threading.Thread(target=forker)
t.start()
time.sleep(0.05)
S5cmd().start(["version"]).communicate()
stop = True
t.join()
for k in kids:
    os.waitpid(k, 0)
"""


def test_a_fork_while_the_first_s5cmd_starts_neither_waits_nor_errs() -> None:
    """The first start registers the at-fork hooks, which a fork under way in another thread at
    that moment meets half: its end must not release a lock its beginning did not take (an
    exception printed on every such fork), and the start must not wait for the forked children."""
    import subprocess
    import sys

    for _ in range(5):
        run = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
