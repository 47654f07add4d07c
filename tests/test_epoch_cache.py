"""The epoch cache through the real path: s5cmd against SeaweedFS behind a proxy that counts
requests, a DataLoader with workers reading and handing samples back.

A private module (``s5loader._daemon``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

import glob
import json
import os
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any

import pytest
from support.faults import FaultProxy
from support.stores import Peak, Store, make_pairs, staged_bytes
from torch.utils.data import DataLoader

from s5loader import S5Dataset, S5IterableDataset, S5Sampler, consume
from s5loader._daemon import PrefetchDaemon, PrefetchOptions
from s5loader._daemon.protocol import EPOCH_DIR
from s5loader.handover import sample_bytes

N = 40
SIZE = 2000


def collate(batch):
    return batch


@pytest.fixture
def proxy(seaweed: Store) -> Iterator[FaultProxy]:
    p = FaultProxy(seaweed.endpoint)
    yield p
    p.close()


@pytest.fixture
def data(seaweed: Store, proxy: FaultProxy) -> tuple[dict[str, bytes], S5Dataset]:
    source = seaweed.put(make_pairs(N, size=SIZE))
    ds = S5Dataset.from_prefix(seaweed.uri(), endpoint_url=proxy.endpoint)
    return source, ds


def object_reads(proxy: FaultProxy, since: int = 0, methods: tuple[str, ...] = ("GET", "HEAD")) -> list[str]:
    """The keys of the object GETs and HEADs the proxy saw after its ``since``-th request."""
    out = []
    for method, path, _ in proxy.requests[since:]:
        parsed = urllib.parse.urlsplit(path)
        if method in methods and not parsed.query.startswith("list") and "list-type" not in parsed.query:
            key = urllib.parse.unquote(parsed.path).split("/", 2)[-1]
            if key:
                out.append(key)
    return out


def images(keys: list[str]) -> list[str]:
    """The sample keys of the ``.image`` objects among ``keys``."""
    return [k[: -len(".image")] for k in keys if k.endswith(".image")]


def epoch(sampler: S5Sampler, ds: S5Dataset, e: int, workers: int = 2) -> list[dict]:
    sampler.set_epoch(e)
    loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=workers, collate_fn=collate)
    return [s for b in loader for s in b]


def check(got: list[dict], source: dict[str, bytes]) -> None:
    assert sorted(s["__key__"] for s in got) == sorted({k.rsplit(".", 1)[0] for k in source})
    assert all(s["image"] == source[s["__key__"] + ".image"] for s in got)


def test_a_data_set_that_fits_is_fetched_once(data, proxy: FaultProxy, staging_root: str) -> None:
    source, ds = data
    with S5Sampler(
        ds,
        budget=ds.total_bytes // 4,
        epoch_cache=ds.total_bytes,
        samples_per_call=8,
        staging_dir=staging_root,
    ) as sampler:
        check(epoch(sampler, ds, 0), source)
        first = len(object_reads(proxy))
        assert first >= 2 * N
        mark = len(proxy.requests)
        for e in (1, 2):
            check(epoch(sampler, ds, e), source)
            m = sampler.metrics()
            assert (m.epoch_cache_hits, m.fetched_bytes, m.fetched_units) == (N, 0, 0)
        assert object_reads(proxy, mark) == []  # not one request after the first epoch
        assert m.epoch_cache_bytes == ds.total_bytes
        cache_dirs = glob.glob(os.path.join(staging_root, "s5loader-cache-*"))
        assert len(cache_dirs) == 1
    assert not os.path.exists(cache_dirs[0])  # removed with the sampler


def test_half_cache_fetches_half_and_never_exceeds_budget_plus_cache(
    data, proxy: FaultProxy, staging_root: str
) -> None:
    source, ds = data
    budget, cache = ds.total_bytes // 5, ds.total_bytes // 2
    with S5Sampler(
        ds, budget=budget, epoch_cache=cache, samples_per_call=8, staging_dir=staging_root
    ) as sampler:
        with Peak(lambda: staged_bytes(staging_root) - _manifests(staging_root)) as watcher:
            check(epoch(sampler, ds, 0), source)
            fetched = [sampler.metrics().fetched_bytes]
            reads = [len(object_reads(proxy))]
            for e in (1, 2, 3):
                mark = len(proxy.requests)
                check(epoch(sampler, ds, e), source)
                fetched.append(sampler.metrics().fetched_bytes)
                reads.append(len(object_reads(proxy, mark)))
                assert sampler.metrics().epoch_cache_hits > 0
    assert fetched[0] == ds.total_bytes
    for f in fetched[1:]:
        assert f <= 0.52 * fetched[0], fetched
    for r in reads[1:]:
        assert r <= 0.52 * reads[0], reads
    assert watcher.looks > 20
    assert 0 < watcher.peak <= budget + cache, f"peak {watcher.peak} > {budget} + {cache}"


def _manifests(root: str) -> int:
    return sum(
        os.path.getsize(p) for p in glob.glob(os.path.join(root, "s5loader-cache-*", ".manifest.json"))
    )


def test_the_order_does_not_change(data, staging_root: str) -> None:
    source, ds = data
    orders = []
    for cache in (0, ds.total_bytes // 2):
        with S5Sampler(
            ds, budget=ds.total_bytes // 4, epoch_cache=cache, seed=7, staging_dir=staging_root
        ) as sampler:
            orders.append([[s["__key__"] for s in epoch(sampler, ds, e, workers=0)] for e in range(3)])
    assert orders[0] == orders[1]
    assert orders[0][0] != orders[0][1]  # a shuffled order each epoch


@pytest.mark.parametrize("survives", [True, False])
def test_resume_with_a_cache_fetches_no_sample_twice_in_an_epoch(
    data, proxy: FaultProxy, staging_root: str, survives: bool
) -> None:
    source, ds = data
    opts = dict(
        budget=ds.total_bytes // 4,
        epoch_cache=ds.total_bytes // 2,
        seed=3,
        staging_dir=staging_root,
        samples_per_call=8,
    )
    with S5Sampler(ds, **opts) as ref:
        want = [[s["__key__"] for s in epoch(ref, ds, e, workers=0)] for e in range(3)]
    a = S5Sampler(ds, keep_epoch_cache=survives, **opts)
    epoch(a, ds, 0)
    mark = len(proxy.requests)
    a.set_epoch(1)
    got: list[str] = []
    for batch in DataLoader(ds, sampler=a, batch_size=4, num_workers=0, collate_fn=collate):
        got += [s["__key__"] for s in batch]
        if len(got) >= 12:
            break
    state = a.state_dict()
    a.close()
    assert bool(glob.glob(os.path.join(staging_root, "s5loader-cache-*"))) == survives
    mark = len(proxy.requests)
    b = S5Sampler(ds, **opts)
    b.load_state_dict(state)
    got += [
        s["__key__"] for batch in DataLoader(ds, sampler=b, batch_size=4, collate_fn=collate) for s in batch
    ]
    assert got == want[1]
    by_b = images(object_reads(proxy, mark, methods=("GET",)))
    assert len(by_b) == len(set(by_b)) and not set(by_b) & set(got[:12])  # nothing the first run read
    if survives:
        assert b.metrics().epoch_cache_hits > 0  # found the cache the first run left
    assert [s["__key__"] for s in epoch(b, ds, 2, workers=0)] == want[2]
    b.close()


def test_two_local_ranks_share_one_cache(
    data, proxy: FaultProxy, staging_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, ds = data
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    samplers = [
        S5Sampler(
            ds,
            num_replicas=2,
            rank=r,
            budget=ds.total_bytes // 4,
            epoch_cache=ds.total_bytes,
            samples_per_call=8,
            staging_dir=staging_root,
        )
        for r in (0, 1)
    ]
    try:
        seen = [s["__key__"] for sp in samplers for s in epoch(sp, ds, 0)]
        assert sorted(seen) == sorted({k.rsplit(".", 1)[0] for k in source})
        assert len(glob.glob(os.path.join(staging_root, "s5loader-cache-*"))) == 1
        mark = len(proxy.requests)
        for sp in samplers:
            got = epoch(sp, ds, 1)
            assert sp.metrics().epoch_cache_hits == len(got) == N // 2
        assert object_reads(proxy, mark) == []  # each rank read samples the other one kept
    finally:
        samplers[0].close()
        cache = glob.glob(os.path.join(staging_root, "s5loader-cache-*"))
        assert cache  # the other rank still uses it
        samplers[1].close()
    assert not os.path.exists(cache[0])


def test_a_damaged_entry_is_fetched_again(data, proxy: FaultProxy, staging_root: str) -> None:
    source, ds = data
    with S5Sampler(
        ds, budget=ds.total_bytes // 4, epoch_cache=ds.total_bytes, staging_dir=staging_root
    ) as sampler:
        epoch(sampler, ds, 0)
        (cache,) = glob.glob(os.path.join(staging_root, "s5loader-cache-*"))
        entry = sorted(n for n in os.listdir(cache) if n.isdigit())[0]
        with open(os.path.join(cache, entry, "image"), "r+b") as fh:
            fh.truncate(10)
        mark = len(proxy.requests)
        check(epoch(sampler, ds, 1), source)
        assert sampler.metrics().epoch_cache_hits == N - 1
        stem = ds.samples[int(entry)].key.rsplit("/", 1)[-1]
        refetched = {k.rsplit("/", 1)[-1] for k in object_reads(proxy, mark)}
        assert f"{stem}.image" in refetched and {k.rsplit(".", 1)[0] for k in refetched} == {stem}


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_iterable_workers_share_one_cache(data, proxy: FaultProxy, staging_root: str, share: float) -> None:
    source, ds = data
    it = S5IterableDataset(
        ds,
        budget=ds.total_bytes // 4,
        epoch_cache=int(ds.total_bytes * share),
        samples_per_call=8,
        staging_dir=staging_root,
    )
    try:
        reads = []
        for e in range(3):
            it.set_epoch(e)
            mark = len(proxy.requests)
            check(
                [s for b in DataLoader(it, batch_size=4, num_workers=2, collate_fn=collate) for s in b],
                source,
            )
            reads.append(len(object_reads(proxy, mark)))
        assert len(glob.glob(os.path.join(staging_root, "s5loader-cache-*"))) == 1
    finally:
        it.close()
    assert reads[0] >= 2 * N
    if share == 1.0:
        assert reads[1:] == [0, 0]
    else:
        # Each worker admits within its own share of the cache (no talk between processes), and
        # which worker reads a kept sample in the epoch before is random: a few admissions are
        # refused where one worker reads more kept samples than its share holds.
        assert all(0 < r <= 0.6 * reads[0] for r in reads[1:]), reads
    assert not glob.glob(os.path.join(staging_root, "s5loader-cache-*"))


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_the_daemon_keeps_samples_for_the_next_epoch(data, proxy: FaultProxy, tmp_path, share: float) -> None:
    source, ds = data
    cache, log = tmp_path / "cache", tmp_path / "progress.jsonl"
    size = int(ds.total_bytes * share)
    opts = PrefetchOptions.of(
        ds.source,
        str(cache),
        ds.total_bytes // 4,
        endpoint_url=proxy.endpoint,
        shuffle=True,
        epochs=3,
        samples_per_call=8,
        epoch_cache=size,
        json_log=str(log),
    )
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with PrefetchDaemon(opts) as daemon:
                daemon.open()
                daemon.run()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    with Peak(lambda: sample_bytes(cache) if cache.exists() else 0, interval=0.002) as peak:
        got = [
            (s.key, s.read("image")) for s in consume(cache, timeout=30, finished=lambda: not t.is_alive())
        ]
        t.join(30)
    assert not errors, errors
    assert len(got) == 3 * N
    assert all(image == source[key + ".image"] for key, image in got)
    for e in range(3):
        assert sorted(k for k, _ in got[e * N : (e + 1) * N]) == sorted(s.key for s in ds.samples)
    gets = [k for k in object_reads(proxy, methods=("GET",)) if k.endswith(".image")]
    if share == 1.0:
        assert len(gets) == N  # each sample fetched once over three epochs
    else:
        assert len(gets) <= N * (1 + 2 * 0.52), len(gets)
    last = [e for e in map(json.loads, log.read_text().splitlines()) if e.get("event") == "done"][-1]
    if share == 1.0:  # the last epoch's figures
        assert (last["epoch_cache_hits"], last["epoch_fetched_bytes"]) == (N, 0)
    else:
        assert last["epoch_cache_hits"] > 0 and 0 < last["epoch_fetched_bytes"] <= 0.52 * ds.total_bytes
    assert not (cache / EPOCH_DIR).exists()  # removed after the last epoch, folder and all
    # The folder holds the budget's samples and the epoch cache's, no more; the log says which
    # is which: what the budget limits, and the delivered hits beside it.
    budget = opts.budget
    assert peak.looks > 10 and peak.peak <= budget + size, (peak.peak, budget, size)
    progress = [e for e in map(json.loads, log.read_text().splitlines()) if "cache_bytes" in e]
    assert all(e["cache_bytes"] - e["epoch_hit_bytes"] <= budget for e in progress)
    assert all(e["cache_bytes"] <= budget + size for e in progress)


def _rank_opens_the_cache(
    ds: S5Dataset, root: str, env: dict[str, str], start: Barrier, out: Queue[tuple[Any, ...]]
) -> None:
    """One rank of a job that a launcher other than torchrun started: its variables set, the
    node's ranks opening the epoch cache at once (a forked child)."""
    try:
        os.environ.update(env)
        with S5Sampler(
            ds, budget=ds.total_bytes // 4, epoch_cache=ds.total_bytes, samples_per_call=4, staging_dir=root
        ) as sampler:
            start.wait(60)
            got = [
                s["__key__"]
                for b in DataLoader(ds, sampler=sampler, batch_size=2, collate_fn=collate)
                for s in b
            ]
            assert sampler._run.cache is not None
            out.put((env["RANK"], sampler._run.cache.cache.path, sorted(got), ""))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback

        out.put((env.get("RANK"), "", [], f"{exc!r}\n{traceback.format_exc()}"))
        raise


def _launch(ds: S5Dataset, root: str, local: Callable[[int], dict[str, str]], ranks: int = 8) -> list[tuple]:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Barrier(ranks), ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_opens_the_cache,
            args=(ds, root, {"RANK": str(r), "WORLD_SIZE": str(ranks), **local(r)}, start, out),
        )
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(60)
    assert [(r, err) for r, _, _, err in results if err] == []
    assert [p.exitcode for p in procs] == [0] * ranks
    return results


NOT_TORCHRUN = (
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "SLURM_LOCALID",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_NODEID",
)


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_eight_ranks_that_srun_or_mpirun_started_open_one_cache_at_once(
    launcher: str, data, staging_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, ds = data
    for var in NOT_TORCHRUN:
        monkeypatch.delenv(var, raising=False)

    def local(r: int) -> dict[str, str]:
        if launcher == "srun":
            return {"SLURM_LOCALID": str(r), "SLURM_STEP_TASKS_PER_NODE": "8", "SLURM_NODEID": "0"}
        return {"OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}

    for _ in range(2):  # again: the first round's cache is gone, and nothing else was left
        results = _launch(ds, staging_root, local)
        assert len({path for _, path, _, _ in results}) == 1  # one cache for the node
        assert sorted(k for _, _, keys, _ in results for k in keys) == sorted(
            {k.rsplit(".", 1)[0] for k in source}
        )
        assert os.listdir(staging_root) == []


def test_eight_ranks_without_local_variables_never_crash_and_keep_a_cache_each(
    data, staging_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, ds = data
    for var in NOT_TORCHRUN:
        monkeypatch.delenv(var, raising=False)
    for _ in range(2):
        results = _launch(ds, staging_root, lambda r: {})
        assert len({path for _, path, _, _ in results}) == 8  # no launcher says which ranks share a node
        assert os.listdir(staging_root) == []


EXIT_WITHOUT_CLOSE = """
import sys
from torch.utils.data import DataLoader
from s5loader import S5Dataset, S5IterableDataset

uri, endpoint, root, workers = sys.argv[1:5]
ds = S5Dataset.from_prefix(uri, endpoint_url=endpoint)
it = S5IterableDataset(ds, budget=ds.total_bytes // 4, epoch_cache=ds.total_bytes, samples_per_call=8,
                       staging_dir=root)
n = sum(len(b) for b in DataLoader(it, batch_size=4, num_workers=int(workers), collate_fn=lambda b: b))
assert n == len(ds), n
print("read", n)  # and exits without close(), the dataset still referenced
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterables_epoch_cache_goes_with_a_process_that_exits_without_close(
    seaweed: Store, tmp_path, workers: int
) -> None:
    import subprocess
    import sys

    seaweed.put(make_pairs(N, size=SIZE))
    root = tmp_path / "staging"
    root.mkdir()
    r = subprocess.run(
        [sys.executable, "-c", EXIT_WITHOUT_CLOSE, seaweed.uri(), seaweed.endpoint, str(root), str(workers)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0 and f"read {N}" in r.stdout, r.stderr[-3000:]
    assert os.listdir(root) == []  # neither the staging folder nor the epoch cache is left
