"""Resume: a state saved after an epoch ends, the state format, and the order promise
(identical to ``torch.utils.data.DistributedSampler``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.stores import Store, make_pairs
from torch.utils.data import DistributedSampler

from s5loader import S5Dataset, S5Sampler, StateError

# Three samplers on one dataset, each with its own StatefulDataLoader: one rank alone, and
# ranks 0 and 1 of two. "first" runs epochs 0, 1 and 2, saving every loader's state after
# epoch 1 as the usual training loop does; "resume" is a new process that loads those states,
# calls set_epoch(2) and runs epoch 2.
EPOCH_END_SCRIPT = """
import json, sys
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from s5loader import S5Dataset, S5Sampler

uri, endpoint, mode, state_file, workers, persistent = sys.argv[1:7]
workers, persistent = int(workers), persistent == "1"
ds = S5Dataset.from_prefix(uri, endpoint_url=endpoint)
setups = [(1, 0), (2, 0), (2, 1)]
samplers = [S5Sampler(ds, seed=5, num_replicas=w, rank=r, samples_per_call=4, budget=4000) for w, r in setups]
loaders = [
    StatefulDataLoader(ds, sampler=s, batch_size=3, num_workers=workers, persistent_workers=persistent,
                       collate_fn=lambda b: b)
    for s in samplers
]
first = 0
if mode == "resume":
    for loader, state in zip(loaders, torch.load(state_file)):
        loader.load_state_dict(state)
    first = 2
out = {}
for epoch in range(first, 3):
    for s in samplers:
        s.set_epoch(epoch)
    for i, loader in enumerate(loaders):
        out[f"{epoch}/{i}"] = [x["__key__"] for b in loader for x in b]
    if mode == "first" and epoch == 1:
        torch.save([loader.state_dict() for loader in loaders], state_file)
print(json.dumps(out))
for s in samplers:
    s.close()
"""


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_resume_from_a_state_saved_at_the_end_of_an_epoch(
    moto: Store, tmp_path, num_workers: int, persistent: bool
) -> None:
    source = moto.put(make_pairs(21, size=64))
    script = tmp_path / "resume.py"
    script.write_text(EPOCH_END_SCRIPT)
    state = str(tmp_path / "state.pt")

    def run(mode: str) -> dict[str, list[str]]:
        r = subprocess.run(
            [
                sys.executable,
                str(script),
                moto.uri(),
                moto.endpoint,
                mode,
                state,
                str(num_workers),
                "1" if persistent else "0",
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    uninterrupted = run("first")
    resumed = run("resume")
    keys = {k.rsplit(".", 1)[0] for k in source}
    for i, per_rank in enumerate((21, 11, 11)):
        epoch2 = uninterrupted[f"2/{i}"]
        assert len(epoch2) == per_rank
        assert resumed[f"2/{i}"] == epoch2  # exactly the epoch an uninterrupted run yields
        assert epoch2 != uninterrupted[f"1/{i}"]  # epoch 2's order, not epoch 1's again
    assert set(uninterrupted["2/0"]) == keys
    assert set(resumed["2/1"]) | set(resumed["2/2"]) == keys  # the two ranks cover the data set


@pytest.fixture
def ds(moto: Store) -> S5Dataset:
    moto.put(make_pairs(13, size=16))
    return S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)


def test_end_of_epoch_state_with_set_epoch_before_or_after_loading(ds: S5Dataset, staging_root: str) -> None:
    def sampler(**kw) -> S5Sampler:
        return S5Sampler(ds, seed=2, staging_dir=staging_root, **kw)

    with sampler() as s:
        s.set_epoch(3)
        list(s)
        state = s.state_dict()
        s.set_epoch(4)
        want = list(s)
    assert state["complete"] is True and state["epoch"] == 3
    for set_first in (True, False):
        with sampler() as s:
            if set_first:  # as StatefulDataLoader does: the state is applied at the next iter()
                s.set_epoch(4)
                s.load_state_dict(state)
            else:
                s.load_state_dict(state)
                s.set_epoch(4)
            assert list(s) == want
    with sampler() as s:  # no set_epoch at all: the epoch after the saved one
        s.load_state_dict(state)
        assert s.epoch == 4 and list(s) == want
    with sampler(num_replicas=2, rank=1) as s:  # another number of ranks: a whole new epoch
        s.set_epoch(4)
        s.load_state_dict(state)
        ref = DistributedSampler(range(13), num_replicas=2, rank=1, seed=2)
        ref.set_epoch(4)
        assert list(s) == list(ref)


def test_state_just_after_the_last_sample_counts_as_complete(ds: S5Dataset, staging_root: str) -> None:
    """With workers, StatefulDataLoader snapshots the sampler right after it hands out an
    index, before the sampler learns the epoch is over."""
    with S5Sampler(ds, seed=2, staging_dir=staging_root, num_replicas=2, rank=0) as s:
        it = iter(s)
        states = []
        for _ in range(len(s)):
            next(it)
            states.append(s.state_dict())
        assert [st["complete"] for st in states] == [False] * (len(s) - 1) + [True]
        middle = states[2]
        it.close()
    with S5Sampler(ds, seed=2, staging_dir=staging_root, num_replicas=2, rank=0) as s:
        s.set_epoch(7)  # a mid-epoch state continues its own epoch
        s.load_state_dict(middle)
        assert s.epoch == 0
        rest = list(s)
    with S5Sampler(ds, seed=2, staging_dir=staging_root, num_replicas=2, rank=0) as s:
        assert list(s)[3:] == rest


def test_version_1_states_are_still_read(ds: S5Dataset, staging_root: str) -> None:
    v1 = {
        "version": 1,
        "epoch": 2,
        "seed": 2,
        "shuffle": True,
        "drop_last": False,
        "num_replicas": 1,
        "dataset_len": 13,
        "start": 0,
    }
    with S5Sampler(ds, seed=2, staging_dir=staging_root) as s:
        s.set_epoch(3)
        want3 = list(s)
        s.set_epoch(2)
        want2 = list(s)
    with S5Sampler(ds, seed=2, staging_dir=staging_root) as s:
        s.load_state_dict({**v1, "yielded": 13})  # a whole epoch consumed: epoch 2 is complete
        s.set_epoch(3)
        assert list(s) == want3
    with S5Sampler(ds, seed=2, staging_dir=staging_root) as s:
        s.load_state_dict({**v1, "yielded": 5})
        assert list(s) == want2[5:]
    with S5Sampler(ds, seed=2, staging_dir=staging_root) as s:
        with pytest.raises(StateError, match="lacks complete"):
            s.load_state_dict({**v1, "yielded": 5, "version": 2})
        with pytest.raises(StateError, match="complete.*must be a bool"):
            s.load_state_dict({**v1, "yielded": 5, "version": 2, "complete": "yes"})
        with pytest.raises(StateError, match="unknown state version 4"):  # 3: a rest on other ranks
            s.load_state_dict({**v1, "yielded": 5, "version": 4, "complete": False})


# -- the order promise: the same as DistributedSampler ---------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_yields_distributed_samplers_order(ds: S5Dataset, staging_root: str, drop_last: bool) -> None:
    for shuffle in (True, False):
        for rank in range(3):
            with S5Sampler(
                ds,
                shuffle=shuffle,
                seed=4,
                num_replicas=3,
                rank=rank,
                drop_last=drop_last,
                staging_dir=staging_root,
            ) as s:
                ref = DistributedSampler(
                    range(len(ds)), num_replicas=3, rank=rank, shuffle=shuffle, seed=4, drop_last=drop_last
                )
                s.set_epoch(6)
                ref.set_epoch(6)
                assert list(s) == list(ref) and len(s) == len(ref)
