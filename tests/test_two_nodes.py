"""A job of two torchrun nodes on one machine (``--nnodes 2``, two ranks each, each node its own
staging root, rendezvous on loopback) over tar shards behind a proxy that counts requests: one
index read per job, each shard fetched once per job and epoch, one epoch cache per node, and an
end-of-epoch state resumed by a job of another world size."""

from __future__ import annotations

import json
import urllib.parse

from support.faults import FaultProxy
from support.shards import class_sorted_shards, shard_gets
from support.stores import Store, free_port
from support.torchrun import torchrun

SHARDS, PER_SHARD = 12, 6

SCRIPT = """
import glob, json, os, sys
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from s5loader import S5Dataset, S5Sampler

dist.init_process_group("gloo")
source, endpoint, out, root, budget, cache = sys.argv[1:7]
state_in = sys.argv[7] if len(sys.argv) > 7 else ""
rank, world = dist.get_rank(), dist.get_world_size()
ds = S5Dataset.from_shards(source, endpoint_url=endpoint)
sampler = S5Sampler(ds, shuffle=True, seed=4, budget=int(budget), epoch_cache=int(cache), staging_dir=root)
loader = StatefulDataLoader(ds, sampler=sampler, batch_size=3, num_workers=1, collate_fn=lambda b: b)
epochs = []
if state_in:
    loader.load_state_dict(torch.load(state_in + f".rank{rank % 2}"))
    epochs.append([s["__key__"] for b in loader for s in b])
else:
    for epoch in range(2):
        sampler.set_epoch(epoch)
        epochs.append([s["__key__"] for b in loader for s in b])
        if epoch == 0:
            torch.save(loader.state_dict(), os.path.join(out, f"state.rank{rank}"))
        dist.barrier()
caches = sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, "s5loader-cache-*")))
hits = sampler.metrics().epoch_cache_hits
sampler.close()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "epochs": epochs, "caches": caches, "hits": hits,
               "local": [os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]]}, f)
dist.barrier()
dist.destroy_process_group()
"""


def index_reads(proxy: FaultProxy) -> tuple[int, int]:
    """Listings of the shards' folder and reads of their index."""
    lists = reads = 0
    for method, path, _ in proxy.requests:
        parsed = urllib.parse.urlsplit(path)
        lists += method == "GET" and "list-type" in parsed.query
        reads += method == "GET" and parsed.path.endswith("wids.json")
    return lists, reads


def test_two_torchrun_nodes_fetch_each_shard_once_per_epoch_and_resume_on_another_world_size(
    seaweed: Store, tmp_path
) -> None:
    source, tars, big = class_sorted_shards(seaweed, n_shards=SHARDS, per_shard=PER_SHARD, size=1500)
    total = sum(map(len, tars.values()))
    keys = sorted(f"c{s}-{j:03d}" for s in range(SHARDS) for j in range(PER_SHARD))
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proxy = FaultProxy(seaweed.endpoint)
    try:
        port = free_port()
        roots = [tmp_path / f"node{n}" for n in range(2)]
        out = tmp_path / "out"
        out.mkdir()
        args = [source, proxy.endpoint, str(out), "", str(3 * big), str(total // 2)]
        nodes = [torchrun(str(script), 2, n, port, [*args[:3], str(roots[n]), *args[4:]]) for n in range(2)]
        for p in nodes:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
        gets = shard_gets(proxy.requests)
        index = index_reads(proxy)

        # the state of the end of epoch 0, resumed by a job of one node (two ranks): epoch 1
        again = tmp_path / "again"
        again.mkdir()
        state = str(out / "state")
        one = torchrun(
            str(script),
            1,
            0,
            free_port(),
            [source, proxy.endpoint, str(again), str(tmp_path / "node9"), str(3 * big), "0", state],
        )
        _, err = one.communicate(timeout=300)
        assert one.returncode == 0, err[-3000:]
        resumed = [json.loads((again / f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        proxy.close()

    assert [r["world"] for r in ranks] == [4] * 4 and [r["local"] for r in ranks] == [
        ["0", "2"],
        ["1", "2"],
    ] * 2
    for e in range(2):
        got = [k for r in ranks for k in r["epochs"][e]]
        assert sorted(got) == keys, e  # every sample once per epoch across the job
    # the folder listed and the index read by one process of the job, not by every rank
    assert index == (1, 1), index
    # each shard fetched once per epoch by the whole job (a shard that a rank's part boundary
    # cuts, by both ranks that share it: three boundaries), less the epoch cache's hits
    hits = sum(r["hits"] for r in ranks)
    assert set(gets) == set(tars) and max(gets.values()) <= 4, gets
    assert sum(gets.values()) <= 2 * (SHARDS + 3) - hits and hits > 0, (gets, hits)
    # one epoch cache per node, shared by the node's two ranks
    assert ranks[0]["caches"] == ranks[1]["caches"] and len(ranks[0]["caches"]) == 1
    assert ranks[2]["caches"] == ranks[3]["caches"] and len(ranks[2]["caches"]) == 1
    # another world size resumes the saved end of epoch 0 with the next epoch, whole
    assert [r["world"] for r in resumed] == [2, 2]
    assert sorted(k for r in resumed for k in r["epochs"][0]) == keys
