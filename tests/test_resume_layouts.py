"""A mid-epoch state resumes with another number of ranks, DataLoader workers or batch size:
each new rank (an ``S5IterableDataset``, or an ``S5Sampler``) loads a whole ``StatefulDataLoader``
state of an old rank and iterates a new loader; every sample of the epoch comes once over the old
and new runs. The real s5cmd against SeaweedFS; ranks with explicit ``num_replicas``/``rank`` in
one process, their loaders stepped in lockstep (as under DDP)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support.shards import make_shards, put_indexed
from support.stores import Store, free_port
from support.torchrun import torchrun
from torchdata.stateful_dataloader import StatefulDataLoader

from s5loader import S5Dataset, S5IterableDataset, StateError

N_SHARDS, PER_SHARD = 8, 16  # 128 samples
EVERY = [f"s{k:05d}" for k in range(N_SHARDS * PER_SHARD)]


@pytest.fixture
def shards(seaweed: Store) -> S5Dataset:
    tars, _ = make_shards(N_SHARDS, PER_SHARD, size=300)
    return S5Dataset.from_shards(put_indexed(seaweed, tars), endpoint_url=seaweed.endpoint)


def keys(batch: list[dict[str, Any]]) -> list[str]:
    return [s["__key__"] for s in batch]


def run(
    ds: S5Dataset, root: str, world: int, workers: int, batch: int, states: list[Any] | None, stop: int | None
) -> tuple[list[str], list[Any]]:
    """``world`` ranks in lockstep, each a loader of ``workers`` workers and ``batch`` samples a
    batch, resumed from ``states`` (new rank ``r`` takes old rank ``r % len(states)``'s); each
    reads ``stop`` batches (all, with None). The keys read, and each rank's loader state."""
    made = [
        S5IterableDataset(
            ds,
            num_replicas=world,
            rank=r,
            seed=3,
            budget=6 * 41000,
            staging_dir=root,
            num_workers=workers,
            batch_size=batch,
        )
        for r in range(world)
    ]
    got: list[str] = []
    try:
        for r, it in enumerate(made):
            if states is not None:
                it.load_state_dict(states[r % len(states)])
        loaders = [
            StatefulDataLoader(it, batch_size=batch, num_workers=workers, collate_fn=lambda b: b)
            for it in made
        ]
        iters = [iter(x) for x in loaders]
        live = list(range(world))
        steps = 0
        while live and (stop is None or steps < stop):
            for r in list(live):
                try:
                    got += keys(next(iters[r]))
                except StopIteration:
                    live.remove(r)
            steps += 1
        saved = [x.state_dict() for x in loaders]
        del iters
    finally:
        for it in made:
            it.close()
    return got, saved


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ((2, 2, 8), (1, 2, 8)),  # 2 -> 1 ranks
        ((2, 2, 8), (4, 2, 8)),  # 2 -> 4 ranks
        ((1, 4, 8), (1, 2, 8)),  # 4 -> 2 workers
        ((1, 2, 32), (1, 2, 16)),  # batch 32 -> 16
    ],
)
def test_a_shard_epoch_resumes_on_another_layout(
    shards: S5Dataset, staging_root: str, before: tuple[int, int, int], after: tuple[int, int, int]
) -> None:
    head, states = run(shards, staging_root, *before, None, 1)
    assert 0 < len(head) < len(shards)
    rest, _ = run(shards, staging_root, *after, states, None)
    assert Counter(head + rest) == Counter(EVERY), (len(head), len(rest))  # every sample of the epoch once


def test_a_state_taken_in_a_rest_resumes_on_its_layout_only(shards: S5Dataset, staging_root: str) -> None:
    head, states = run(shards, staging_root, 2, 2, 8, None, 1)
    middle, again = run(shards, staging_root, 1, 2, 8, states, 2)
    # the same layout: StatefulDataLoader's own load_state_dict continues the rest
    it = S5IterableDataset(
        shards, seed=3, budget=6 * 41000, staging_dir=staging_root, num_workers=2, batch_size=8
    )
    try:
        loader = StatefulDataLoader(it, batch_size=8, num_workers=2, collate_fn=lambda b: b)
        loader.load_state_dict(again[0])
        tail = [k for b in loader for k in keys(b)]
    finally:
        it.close()
    assert Counter(head + middle + tail) == Counter(EVERY)
    with pytest.raises(StateError, match="rest of an epoch resumed on another layout"):
        run(shards, staging_root, 2, 2, 8, again, None)


@pytest.mark.parametrize(("before", "after"), [((4, 32), (2, 16)), ((2, 16), (0, 32))])
def test_a_sampler_resumes_from_a_loader_of_other_workers_and_batch_size(
    shards: S5Dataset, staging_root: str, before: tuple[int, int], after: tuple[int, int]
) -> None:
    from s5loader import S5Sampler

    opts = {"seed": 3, "budget": 6 * 41000, "staging_dir": staging_root}
    with S5Sampler(shards, **opts) as sampler:
        loader = StatefulDataLoader(
            shards, sampler=sampler, batch_size=before[1], num_workers=before[0], collate_fn=lambda b: b
        )
        it = iter(loader)
        head = keys(next(it)) + keys(next(it))
        state = loader.state_dict()
        del it
    with S5Sampler(shards, **opts) as sampler:
        sampler.load_state_dict(state)  # the whole loader's state: StatefulDataLoader would refuse it
        new = StatefulDataLoader(
            shards, sampler=sampler, batch_size=after[1], num_workers=after[0], collate_fn=lambda b: b
        )
        rest = [k for b in new for k in keys(b)]
    assert len(head) == 2 * before[1]
    assert Counter(head + rest) == Counter(EVERY)


def test_raw_objects_resume_on_another_layout(seaweed: Store, staging_root: str) -> None:
    seaweed.put({f"s{k:05d}.bin": bytes([k % 256]) * 100 for k in range(96)})
    ds = S5Dataset.from_prefix(seaweed.uri(), endpoint_url=seaweed.endpoint)
    head, states = run(ds, staging_root, 2, 2, 8, None, 2)
    rest, _ = run(ds, staging_root, 4, 1, 4, states, None)  # 64 left: 16 each, no padding
    got = Counter(k.rsplit("/", 1)[-1].split(".")[0] for k in head + rest)
    assert got == Counter(f"s{k:05d}" for k in range(96))


DDP = """
import json, sys, torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader
from s5loader import S5Dataset, S5IterableDataset

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
source, endpoint, root, out, state = sys.argv[1:6]
ds = S5Dataset.from_shards(source, endpoint_url=endpoint)
it = S5IterableDataset(ds, seed=3, budget=6 * 41000, staging_dir=root, num_workers=2, batch_size=8)
if state != "-":
    # a loader state of another layout: new rank r takes old rank r % 2's
    it.load_state_dict(torch.load(state.format(rank % 2), weights_only=False))
loader = StatefulDataLoader(it, batch_size=8, num_workers=2, collate_fn=lambda b: b)
got = []
for b in loader:
    got += [s["__key__"] for s in b]
    if state == "-" and len(got) == 16:  # two batches, then the state
        torch.save(loader.state_dict(), f"{out}/state{rank}.pt")
        break
it.close()
json.dump(got, open(f"{out}/got{rank}.json", "w"))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("after", [1, 4])
def test_torchrun_2_ranks_then_another_number(seaweed: Store, tmp_path: Path, after: int) -> None:
    import json

    tars, _ = make_shards(N_SHARDS, PER_SHARD, size=300)
    source = put_indexed(seaweed, tars)
    script = tmp_path / "ddp.py"
    script.write_text(DDP)
    runs = []
    for world, state in ((2, "-"), (after, str(tmp_path / "state{}.pt"))):
        p = torchrun(
            str(script),
            1,
            0,
            free_port(),
            [source, seaweed.endpoint, str(tmp_path / f"root{world}"), str(tmp_path), state],
            nproc=world,
        )
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        runs.append([k for r in range(world) for k in json.loads((tmp_path / f"got{r}.json").read_text())])
    assert len(runs[0]) == 32 and Counter(runs[0] + runs[1]) == Counter(EVERY)


def test_the_epoch_after_a_resumed_rest_is_whole(shards: S5Dataset, staging_root: str) -> None:
    head, states = run(shards, staging_root, 1, 2, 8, None, 1)
    it = S5IterableDataset(
        shards, seed=3, budget=6 * 41000, staging_dir=staging_root, num_workers=1, batch_size=4
    )
    try:
        it.load_state_dict(states[0])  # 2 workers -> 1, batch 8 -> 4
        epochs = []
        for epoch in (0, 1):
            it.set_epoch(epoch)
            loader = StatefulDataLoader(it, batch_size=4, num_workers=1, collate_fn=lambda b: b)
            epochs.append([k for b in loader for k in keys(b)])
    finally:
        it.close()
    assert Counter(head + epochs[0]) == Counter(EVERY)  # the rest of epoch 0
    assert Counter(epochs[1]) == Counter(EVERY)  # then epoch 1, whole
