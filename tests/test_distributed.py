"""Distributed training (torchrun, gloo) and mid-epoch resume with StatefulDataLoader."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.stores import Store, free_port, make_pairs

from s5loader import S5Dataset, S5Sampler, StateError

DDP_SCRIPT = """
import json, os, sys
import torch.distributed as dist
from torch.utils.data import DataLoader
from s5loader import S5Dataset, S5Sampler

dist.init_process_group("gloo")
uri, endpoint, out, drop_last = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
ds = S5Dataset.from_prefix(uri, endpoint_url=endpoint)
sampler = S5Sampler(ds, seed=3, drop_last=drop_last, samples_per_call=4)
loader = DataLoader(ds, sampler=sampler, batch_size=2, num_workers=2, collate_fn=lambda b: b)
epochs = []
for epoch in range(2):
    sampler.set_epoch(epoch)
    epochs.append([s["__key__"] for b in loader for s in b])
    dist.barrier()
# resume from a state saved at the end of epoch 0, in a new loader on a new sampler
from torchdata.stateful_dataloader import StatefulDataLoader
def stateful(s):
    return StatefulDataLoader(ds, sampler=s, batch_size=2, num_workers=2, collate_fn=lambda b: b)
first = S5Sampler(ds, seed=3, drop_last=drop_last, samples_per_call=4)
saver = stateful(first)
first.set_epoch(0)
list(saver)
state = saver.state_dict()
first.close()
again = S5Sampler(ds, seed=3, drop_last=drop_last, samples_per_call=4)
resumer = stateful(again)
again.set_epoch(1)
resumer.load_state_dict(state)
resumed = [s["__key__"] for b in resumer for s in b]
again.close()
rank = dist.get_rank()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": dist.get_world_size(), "len": len(sampler), "epochs": epochs,
               "staging": sampler.staging_dir, "resumed": resumed}, f)
sampler.close()
dist.destroy_process_group()
"""


def torchrun(tmp_path, store: Store, drop_last: bool) -> list[dict]:
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    out = tmp_path / ("drop" if drop_last else "pad")
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(script),
        store.uri(),
        store.endpoint,
        str(out),
        "1" if drop_last else "0",
    ]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]


@pytest.mark.parametrize("drop_last", [False, True])
def test_torchrun_two_ranks(seaweed: Store, tmp_path, drop_last: bool) -> None:
    source = seaweed.put(make_pairs(15, size=64))  # 15 samples: does not divide by 2
    keys = sorted({k.rsplit(".", 1)[0] for k in source})
    r0, r1 = torchrun(tmp_path, seaweed, drop_last)
    assert (r0["world"], r1["world"]) == (2, 2)
    assert r0["staging"] != r1["staging"]  # each rank stages into its own directory
    per_rank = 7 if drop_last else 8
    assert r0["len"] == r1["len"] == per_rank
    for e in range(2):
        a, b = r0["epochs"][e], r1["epochs"][e]
        assert len(a) == len(b) == per_rank  # equal counts: no rank waits at a collective
        assert len(set(a)) == len(a) and len(set(b)) == len(b)
        if drop_last:
            assert not set(a) & set(b)
            assert len(set(a) | set(b)) == 14 and set(a) | set(b) <= set(keys)
        else:
            assert sorted(set(a) | set(b)) == keys  # together they cover the data set
            assert len(set(a) & set(b)) == 1  # padding repeated exactly one sample
    assert r0["epochs"][0] != r0["epochs"][1]  # a new order each epoch
    # a state saved at the end of epoch 0 resumes into exactly epoch 1, on each rank
    assert (r0["resumed"], r1["resumed"]) == (r0["epochs"][1], r1["epochs"][1])


RESUME_SCRIPT = """
import json, sys
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from s5loader import S5Dataset, S5Sampler

uri, endpoint, mode, state_file, workers, k = sys.argv[1:7]
workers, k = int(workers), int(k)
ds = S5Dataset.from_prefix(uri, endpoint_url=endpoint)
sampler = S5Sampler(ds, seed=7, samples_per_call=3, budget=2000)
sampler.set_epoch(1)
loader = StatefulDataLoader(ds, sampler=sampler, batch_size=2, num_workers=workers, collate_fn=lambda b: b)
seen = []
if mode == "resume":
    loader.load_state_dict(torch.load(state_file))
for i, batch in enumerate(loader):
    seen += [s["__key__"] for s in batch]
    if mode == "first" and i + 1 == k:
        torch.save(loader.state_dict(), state_file)
        break
print(json.dumps(seen))
sampler.close()
"""


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resume(seaweed: Store, tmp_path, num_workers: int) -> None:
    source = seaweed.put(make_pairs(21, size=64))
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT)
    state = str(tmp_path / "state.pt")

    def run(mode: str) -> list[str]:
        r = subprocess.run(
            [
                sys.executable,
                str(script),
                seaweed.uri(),
                seaweed.endpoint,
                mode,
                state,
                str(num_workers),
                "4",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    full = run("full")
    first = run("first")
    rest = run("resume")
    assert len(first) == 8
    assert first + rest == full  # the same order as an uninterrupted run, each sample once
    assert sorted(full) == sorted({k.rsplit(".", 1)[0] for k in source})


def test_elastic_resume_with_fewer_ranks(moto: Store, staging_root: str) -> None:
    moto.put(make_pairs(20, size=16))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    full = list(S5Sampler(ds, seed=1, num_replicas=1, rank=0, staging_dir=staging_root))
    # two ranks consume 3 samples each, then the job comes back with one rank
    states, consumed = [], []
    for rank in range(2):
        s = S5Sampler(ds, seed=1, num_replicas=2, rank=rank, staging_dir=staging_root)
        it = iter(s)
        consumed += [next(it) for _ in range(3)]
        states.append(s.state_dict())
        s.close()
    assert sorted(consumed) == sorted(full[:6])
    one = S5Sampler(ds, seed=999, num_replicas=1, rank=0, staging_dir=staging_root)
    one.load_state_dict(states[0])
    rest = list(one)
    assert rest == full[6:]  # the same global order, nothing repeated or skipped
    one.close()


def test_load_state_dict_checks_what_it_is_given(moto: Store, staging_root: str) -> None:
    moto.put(make_pairs(5, size=16))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    with S5Sampler(ds, staging_dir=staging_root) as s:
        good = s.state_dict()
        with pytest.raises(StateError, match="data set of 6 samples; this one has 5"):
            s.load_state_dict({**good, "dataset_len": 6})
        with pytest.raises(StateError, match="yielded"):
            s.load_state_dict({**good, "yielded": -1})
        with pytest.raises(StateError, match="lacks seed"):
            s.load_state_dict({k: v for k, v in good.items() if k != "seed"})
        with pytest.raises(StateError, match="expected a dict"):
            s.load_state_dict([1, 2])  # type: ignore[arg-type]
        s.load_state_dict({**good, "yielded": 2, "epoch": 3})
        assert s.epoch == 3 and len(list(s)) == 3


NO_LAUNCHER = """
import json, os, sys
import torch.distributed as dist
from s5loader import ConfigError, S5Dataset, S5IterableDataset, S5Sampler

rank, world = int(sys.argv[1]), 2
port, uri, endpoint, root = sys.argv[2:6]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
ds = S5Dataset.from_prefix(uri, endpoint_url=endpoint)
out = {}
for name, make in (("sampler", lambda: S5Sampler(ds, epoch_cache="1MB", staging_dir=root)),
                   ("iterable", lambda: S5IterableDataset(ds, epoch_cache="1MB", staging_dir=root))):
    try:
        make().close()
        out[name] = "made"
    except ConfigError as exc:
        out[name] = str(exc)
print(json.dumps(out))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("local_vars", [False, True])
def test_an_epoch_cache_in_a_process_group_without_launcher_variables(
    moto: Store, tmp_path, local_vars: bool
) -> None:
    moto.put(make_pairs(8))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_", "SLURM_", "OMPI_", "MPI_"))}
    procs = []
    for rank in range(2):
        extra = {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"} if local_vars else {}
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    NO_LAUNCHER,
                    str(rank),
                    str(port),
                    moto.uri(),
                    moto.endpoint,
                    str(tmp_path),
                ],
                env={**env, **extra, "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    for stdout, _ in outs:
        got = json.loads(stdout.strip().splitlines()[-1])
        for form in ("sampler", "iterable"):
            if local_vars:  # the node's ranks are known: one cache for the two
                assert got[form] == "made", got[form]
            else:  # no silent cache per rank: an error that names what to set
                assert "LOCAL_WORLD_SIZE" in got[form] and "torchrun" in got[form], got[form]
