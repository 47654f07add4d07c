"""The epoch cache on two torchrun nodes (``--nnodes 2``, two ranks each, each node its own staging
root, rendezvous on loopback) over raw objects behind a proxy that counts GETs: with a cache of
each node's share, the samples stay on their node across epochs (see ``Order.pin``), so later
epochs are read from the nodes' caches; with half of it, half of each later epoch is."""

from __future__ import annotations

import json
import os
import time
import urllib.parse

import pytest
from support.faults import FaultProxy
from support.ranks import run_ranks
from support.shards import make_shards, put_indexed, shard_gets
from support.stores import Store, free_port
from support.torchrun import torchrun

from s5loader import S5Dataset

N, SIZE = 240, 3000

SCRIPT = """
import json, os, sys, time
import torch.distributed as dist
from torch.utils.data import DataLoader
from s5loader import S5Dataset, S5Sampler

dist.init_process_group("gloo")
source, endpoint, out, root, budget, cache, form = sys.argv[1:8]
rank, world = dist.get_rank(), dist.get_world_size()
ds = (S5Dataset.from_shards if form == "shards" else S5Dataset.from_prefix)(source, endpoint_url=endpoint)
sampler = S5Sampler(ds, shuffle=True, seed=7, budget=int(budget), epoch_cache=int(cache), staging_dir=root)
loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=1, collate_fn=lambda b: b)
epochs = []
for epoch in range(3):
    sampler.set_epoch(epoch)
    epochs.append([os.path.basename(s["__key__"]) for b in loader for s in b])
    dist.barrier()
    if rank == 0:  # the test counts the epoch's requests, then lets the job go on
        open(os.path.join(out, f"done{epoch}"), "w").close()
        while not os.path.exists(os.path.join(out, f"go{epoch}")):
            time.sleep(0.05)
    dist.barrier()
state = sampler.state_dict()
sampler.close()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"epochs": epochs, "pin": state.get("pin")}, f)
dist.barrier()
dist.destroy_process_group()
"""


def object_gets(requests: list, prefix: str) -> int:  # type: ignore[type-arg]
    """GETs of one object (not listings) below ``prefix``."""
    return sum(
        1
        for method, path, _ in requests
        if method == "GET" and "list-type" not in path and urllib.parse.urlsplit(path).path.startswith(prefix)
    )


@pytest.mark.parametrize(("form", "share"), [("objects", 1.0), ("objects", 0.5), ("shards", 1.0)])
def test_each_node_keeps_its_share_across_epochs(seaweed: Store, tmp_path, form: str, share: float) -> None:
    if form == "shards":  # 12 shards of 20 samples: three whole shards a rank
        tars, _ = make_shards(12, N // 12, size=SIZE)
        source = put_indexed(seaweed, tars)
        names = [f"s{k:05d}" for k in range(N)]
        total = sum(map(len, tars.values()))
    else:
        names = [f"{i:04d}" for i in range(N)]
        seaweed.put({f"{name}.bin": os.urandom(SIZE) for name in names})
        source, total = seaweed.uri(), N * SIZE
    cache = int(total // 2 * share) + 4 * SIZE  # the node's share (or half), a few samples spare
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    proxy = FaultProxy(seaweed.endpoint)
    path = f"/{seaweed.bucket}/{seaweed.prefix}"
    fetched = []
    try:
        port = free_port()
        args = [source, proxy.endpoint, str(out)]
        budget = str(max(20 * SIZE, 3 * total // 12))
        nodes = [
            torchrun(str(script), 2, n, port, [*args, str(tmp_path / f"node{n}"), budget, str(cache), form])
            for n in range(2)
        ]
        mark = 0
        for epoch in range(3):
            deadline = time.monotonic() + 240
            while not (out / f"done{epoch}").exists():
                assert time.monotonic() < deadline and all(p.poll() is None for p in nodes), [
                    p.communicate()[1][-3000:] for p in nodes if p.poll() is not None
                ]
                time.sleep(0.05)
            now = len(proxy.requests)
            if form == "shards":
                fetched.append(sum(len(tars[k]) * c for k, c in shard_gets(proxy.requests[mark:now]).items()))
            else:
                fetched.append(object_gets(proxy.requests[mark:now], path) * SIZE)
            mark = now
            (out / f"go{epoch}").touch()
        for p in nodes:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    finally:
        proxy.close()
    for e in range(3):  # every sample once per epoch across the job
        assert sorted(k for r in ranks for k in r["epochs"][e]) == names, e
    for node in (0, 1):  # a node's ranks read the same share every epoch
        shares = [{k for r in ranks[2 * node : 2 * node + 2] for k in r["epochs"][e]} for e in range(3)]
        assert shares[0] == shares[1] == shares[2] and len(shares[0]) == N // 2
    assert all(r["pin"] == [2, 4] for r in ranks)  # the state says how the order kept them
    assert fetched[0] == total, fetched  # the first epoch: each sample (shard) once
    most = 0.15 if share == 1.0 else 0.60
    assert max(fetched[1:]) <= most * fetched[0], (fetched, most)


def raw_objects(store: Store, n: int) -> S5Dataset:
    store.put({f"{i:03d}.bin": bytes([i]) * 100 for i in range(n)})
    return S5Dataset.from_prefix(store.uri(), endpoint_url=store.endpoint)


@pytest.fixture
def two_nodes_here(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Ranks of this process placed two to a node (``LOCAL_WORLD_SIZE=2``, no local rank)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return monkeypatch


def test_a_pinned_epoch_saved_on_two_nodes_resumes_on_one_rank(
    moto: Store, staging_root: str, two_nodes_here: pytest.MonkeyPatch
) -> None:
    # four ranks of two nodes in one process, stopped mid-epoch; the rest of that epoch on one
    # rank continues the order the two nodes laid out
    n = 40
    ds = raw_objects(moto, n)
    before, state = run_ranks(ds, staging_root, 4, None, 3, shuffle=True, epoch_cache=4000)
    assert state is not None and state["pin"] == [2, 4] and not state["complete"]
    two_nodes_here.delenv("LOCAL_WORLD_SIZE")
    after, _ = run_ranks(ds, staging_root, 1, state, None, shuffle=True, epoch_cache=4000)
    assert sorted(before + after) == list(range(n))  # every sample of the epoch once
    # the next epoch on the two nodes: each node's ranks read the share they read before
    two_nodes_here.setenv("LOCAL_WORLD_SIZE", "2")
    whole, _ = run_ranks(ds, staging_root, 4, None, None, shuffle=True, epoch_cache=4000)
    ended = {**state, "complete": True}  # the next epoch
    again, _ = run_ranks(ds, staging_root, 4, ended, None, shuffle=True, epoch_cache=4000)
    assert set(whole[: n // 2]) == set(again[: n // 2]) and sorted(again) == list(range(n))
    assert again != whole  # shuffled anew within each node


def test_an_iterable_keeps_each_nodes_share_too(
    moto: Store, staging_root: str, two_nodes_here: pytest.MonkeyPatch
) -> None:
    from torch.utils.data import DataLoader

    from s5loader import S5IterableDataset

    n = 48
    ds = raw_objects(moto, n)
    its = [
        S5IterableDataset(ds, num_replicas=4, rank=r, seed=2, epoch_cache=2400, staging_dir=staging_root)
        for r in range(4)
    ]
    try:
        epochs = []
        for epoch in (0, 1):
            parts = []
            for it in its:
                it.set_epoch(epoch)
                parts.append(
                    [
                        s["__key__"].rsplit("/", 1)[-1]
                        for b in DataLoader(it, batch_size=4, collate_fn=lambda b: b)
                        for s in b
                    ]
                )
            epochs.append(parts)
        state = its[0].state_dict()
    finally:
        for it in its:
            it.close()
    for e in (0, 1):
        assert sorted(k for p in epochs[e] for k in p) == sorted(f"{i:03d}" for i in range(n))
    nodes = [[set(epochs[e][0] + epochs[e][1]), set(epochs[e][2] + epochs[e][3])] for e in (0, 1)]
    assert nodes[0] == nodes[1] and epochs[0] != epochs[1]  # the same share, shuffled anew
    assert state["pin"] == [2, 4]
