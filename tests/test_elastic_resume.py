"""A mid-epoch state of a per-rank order (tar shards; ``shuffle="block"``) resumes on another
number of ranks: each new rank takes its part of what the epoch had left, so every sample of the
epoch comes once over the old and the new runs. The real s5cmd against SeaweedFS; ranks as
samplers with explicit ``num_replicas``/``rank`` in one process (lockstep, as under DDP), and
once through torchrun with gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from support.ranks import run_ranks
from support.shards import make_shards, put_indexed
from support.stores import Store, free_port

from s5loader import S5Dataset

N_SHARDS, PER_SHARD = 6, 10


@pytest.fixture
def shards(seaweed: Store) -> S5Dataset:
    shards, _ = make_shards(N_SHARDS, PER_SHARD, size=400)
    source = put_indexed(seaweed, shards)
    return S5Dataset.from_shards(source, endpoint_url=seaweed.endpoint)


@pytest.mark.parametrize(("shuffle", "new_world"), [(True, 1), (True, 4), (False, 4), ("block", 1)])
def test_a_shard_epoch_saved_on_2_ranks_resumes_on_another_number(
    shards: S5Dataset, staging_root: str, shuffle: bool | str, new_world: int
) -> None:
    ds = shards
    before, state = run_ranks(ds, staging_root, 2, None, 8, shuffle=shuffle)
    assert state is not None and not state["complete"]
    after, _ = run_ranks(ds, staging_root, new_world, state, None, shuffle=shuffle)
    # 60 samples, 30 per rank: 8 each before, the 44 left after (11 each on 4 ranks: no padding)
    assert len(after) == 44
    assert Counter(before + after) == Counter(range(len(ds)))  # every sample of the epoch once


def test_a_rest_resumes_again_on_yet_another_number(shards: S5Dataset, staging_root: str) -> None:
    ds = shards
    first, state = run_ranks(ds, staging_root, 2, None, 8, shuffle=True)
    second, state2 = run_ranks(ds, staging_root, 4, state, 5, shuffle=True)
    assert state2 is not None and state2["elastic"] == [[2, 8]] and state2["version"] == 3
    third, _ = run_ranks(ds, staging_root, 1, state2, None, shuffle=True)
    assert len(second) == 20 and len(third) == 24
    assert Counter(first + second + third) == Counter(range(len(ds)))
    # the same ranks as the rest it was saved in: where that rank stopped
    again, _ = run_ranks(ds, staging_root, 4, state2, None, shuffle=True)
    assert len(again) == 24 and Counter(first + second + again) == Counter(range(len(ds)))


DDP = """
import json, sys
import torch.distributed as dist
from s5loader import S5Dataset, S5Sampler
dist.init_process_group("gloo")
uri, endpoint, out, state_file, stop = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
ds = S5Dataset.from_shards(uri, endpoint_url=endpoint)
s = S5Sampler(ds, seed=4, shuffle=True, samples_per_call=4)
if state_file != "-":
    s.load_state_dict(json.load(open(state_file)))
got = []
it = iter(s)
for i in it:
    got.append(int(i))
    if stop and len(got) == stop:
        break
state = s.state_dict()
it.close()
rank = dist.get_rank()
json.dump({"got": got, "state": state}, open(f"{out}/rank{rank}.json", "w"))
s.close()
dist.destroy_process_group()
"""


def torchrun(
    tmp_path: Path, nproc: int, store_uri: str, endpoint: str, state: str, stop: int, tag: str
) -> list[dict]:
    script = tmp_path / "elastic.py"
    script.write_text(DDP)
    out = tmp_path / tag
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
    ]
    cmd += [f"--master_port={free_port()}", str(script), store_uri, endpoint, str(out), state, str(stop)]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads((out / f"rank{i}.json").read_text()) for i in range(nproc)]


@pytest.mark.parametrize("after", [1, 4])
def test_torchrun_2_ranks_then_another_number_over_shards(seaweed: Store, tmp_path: Path, after: int) -> None:
    shards, _ = make_shards(N_SHARDS, PER_SHARD, size=400)
    source = put_indexed(seaweed, shards)
    first = torchrun(tmp_path, 2, source, seaweed.endpoint, "-", 8, "first")
    state_file = tmp_path / "state.json"
    state_file.write_text(json.dumps(first[0]["state"]))
    second = torchrun(tmp_path, after, source, seaweed.endpoint, str(state_file), 0, "second")
    # 60 samples: 16 before, the 44 left after (11 each on 4 ranks: no padding)
    got = first[0]["got"] + first[1]["got"] + [i for r in second for i in r["got"]]
    assert Counter(got) == Counter(range(N_SHARDS * PER_SHARD))
