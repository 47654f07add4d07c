"""A training process whose parent is PID 1, as in a container (docker ``--init``, tini, ``sh -c
"python train.py"`` as the entrypoint): run under ``unshare -pf --mount-proc``, in a pid
namespace of its own where its shell is PID 1. Readers know the sampler by its pid and start
time, not by their parent's pid: every sample once, 2 GETs per sample of two objects (counted
at the bench's proxy in front of SeaweedFS), nothing staged after the epoch, with and without
DataLoader workers."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.stores import Store, make_pairs

from s5loader_bench.proxy import LatencyProxy

TRAIN = """
import json, os, sys
from torch.utils.data import DataLoader
from s5loader import S5Dataset, S5Sampler

uri, listing_endpoint, endpoint, root, workers = sys.argv[1:6]
ds = S5Dataset.from_prefix(uri, endpoint_url=listing_endpoint)
ds.endpoint_url = endpoint  # staging and any direct GET go through the counting proxy
sampler = S5Sampler(ds, shuffle=True, seed=1, staging_dir=root, budget=20 * 2017, samples_per_call=8)
loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=int(workers), collate_fn=lambda b: b)
keys = [s["__key__"] for batch in loader for s in batch]
left = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if not f.startswith(".")
        and "/." not in d[len(root):]]
print(json.dumps({"ppid": os.getppid(), "keys": keys, "left": left}))
sampler.close()
"""


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare and root")
@pytest.mark.parametrize("workers", [0, 2])
def test_a_training_process_whose_parent_is_pid_1(
    workers: int, seaweed: Store, counting_proxy: LatencyProxy, tmp_path: Path
) -> None:
    seaweed.put(make_pairs(60, size=2000))
    root = tmp_path / "staging"
    root.mkdir()
    argv = [
        sys.executable,
        "-c",
        TRAIN,
        seaweed.uri(),
        seaweed.endpoint,
        counting_proxy.endpoint,
        str(root),
        str(workers),
    ]
    # "; true": the shell (PID 1 of the namespace) stays, the training process is its child
    shell = f"{shlex.join(argv)}; true"
    before = dict(counting_proxy.counts)
    r = subprocess.run(
        ["unshare", "-pf", "--mount-proc", "sh", "-c", shell],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ppid"] == 1  # as in a container
    assert sorted(out["keys"]) == [f"{seaweed.prefix}{i:04d}" for i in range(60)]  # every sample once
    gets = counting_proxy.counts.get("GET", 0) - before.get("GET", 0)
    assert gets == 2 * 60, f"{gets} GETs for 60 samples of two objects: a reader fetched directly"
    assert out["left"] == []  # nothing staged after the epoch
