"""S5IterableDataset over tar shards against local S3 servers: workers and ranks split shards,
resume mid-epoch, the shuffle buffer and the budget, freeing read samples, and the staging
folder after an error or a kill.

A private module (``s5loader._sampling``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections import Counter

import psutil
import pytest
from support.shards import class_sorted_shards, leftovers, make_shards, put_indexed, shard_gets, tar_of
from support.stores import Store, only_folder
from support.waits import wait_for
from torch.utils.data import DataLoader

from s5loader import BudgetError, ConfigError


@pytest.mark.parametrize("shuffle", [False, "block"])
def test_iterable_workers_split_shards_not_samples_so_each_shard_is_fetched_once(
    shuffle: bool | str, moto: Store, staging_root: str
) -> None:
    from support.faults import FaultProxy

    from s5loader import S5IterableDataset

    shards, expected = make_shards(4, 5)
    source = put_indexed(moto, shards)
    proxy = FaultProxy(moto.endpoint)
    try:
        # "block": a worker's share holds a window of all four shards; each worker still
        # windows only its own run of them
        budget = 80_000 if shuffle is False else 400_000
        with S5IterableDataset.from_shards(
            source, endpoint_url=proxy.endpoint, shuffle=shuffle, budget=budget, staging_dir=staging_root
        ) as it:
            got = [
                x["__key__"]
                for b in DataLoader(it, batch_size=4, num_workers=2, collate_fn=lambda b: b)
                for x in b
            ]
        gets = Counter(
            path.split("?")[0].rsplit("/", 1)[-1]
            for method, path, _ in proxy.requests
            if method == "GET" and ".tar" in path
        )
    finally:
        proxy.close()
    assert sorted(got) == sorted(expected)
    # worker 0 takes the first half of the epoch (shards 0 and 1), worker 1 the second half
    assert gets == Counter(list(shards)), gets


@pytest.mark.parametrize("shuffle", [True, "block"])
def test_the_first_shard_is_read_from_its_front_while_it_downloads(
    shuffle: bool | str, moto: Store, staging_root: str
) -> None:
    from s5loader import S5IterableDataset

    shards, expected = make_shards(3, 100)
    source = put_indexed(moto, shards)
    with S5IterableDataset.from_shards(
        source,
        endpoint_url=moto.endpoint,
        shuffle=shuffle,
        seed=1,
        budget=2_000_000,
        staging_dir=staging_root,
    ) as it:
        got = [
            x["__key__"]
            for b in DataLoader(it, batch_size=4, num_workers=0, collate_fn=lambda b: b)
            for x in b
        ]
        assert leftovers(staging_root) == []
    assert sorted(got) == sorted(expected)  # each sample once
    number = [int(k[1:]) for k in got]
    shard = number[0] // 100
    mine = [i % 100 for i in number if i // 100 == shard]
    # the shard streamed first comes in its own order by windows of 32, then 64 samples, each shuffled
    assert sorted(mine[:32]) == list(range(32)) and sorted(mine[32:96]) == list(range(32, 96))
    assert mine[:32] != list(range(32))


@pytest.mark.parametrize("shuffle", [False, True])
def test_iterable_dataset_over_shards_resumes_mid_epoch_exactly(
    shuffle: bool, moto: Store, staging_root: str
) -> None:
    # with the shuffle buffer; "block" resumes through the same path (test_iterable); True is a
    # shard order over shards that do not all fit (six shards' worth for two workers)
    from torchdata.stateful_dataloader import StatefulDataLoader

    from s5loader import S5IterableDataset

    shards, expected = make_shards(3, 5)
    shards["shard-003.tar"] = tar_of([("odd.bin", b"o")])  # uneven shard sizes
    source = put_indexed(moto, shards)

    def run(state: dict | None, stop: int | None) -> tuple[list[str], dict]:
        budget = 6 * max(map(len, shards.values())) if shuffle else 200_000  # a worker: two open, one staging
        with S5IterableDataset.from_shards(
            source,
            endpoint_url=moto.endpoint,
            shuffle=shuffle,
            seed=4,
            shuffle_buffer=3,
            budget=budget,
            staging_dir=staging_root,
        ) as it:
            it.set_epoch(1)
            ld = StatefulDataLoader(it, batch_size=2, num_workers=2, collate_fn=lambda b: b)
            if state is not None:
                ld.load_state_dict(state)
            got: list[str] = []
            for i, batch in enumerate(ld):
                got += [x["__key__"] for x in batch]
                if stop is not None and i + 1 == stop:
                    return got, ld.state_dict()
            return got, ld.state_dict()

    whole, _ = run(None, None)
    head, state = run(None, 3)
    rest, _ = run(state, None)
    assert sorted(whole) == sorted([*expected, "odd"])
    assert head + rest == whole  # the same samples, in the same order, none twice


def test_iterable_dataset_over_shards_every_sample_once_per_rank_split(
    moto: Store, staging_root: str
) -> None:
    from s5loader import S5IterableDataset

    shards, expected = make_shards(6, 5)
    source = put_indexed(moto, shards)
    keys: list[str] = []
    for rank in range(2):
        with S5IterableDataset.from_shards(
            source,
            endpoint_url=moto.endpoint,
            shuffle="block",
            seed=2,
            budget=80_000,
            num_replicas=2,
            rank=rank,
            staging_dir=staging_root,
        ) as it:
            loader = DataLoader(it, batch_size=4, num_workers=2, collate_fn=lambda b: b)
            got = [x for b in loader for x in b]
            assert all(x["bin"] == expected[x["__key__"]]["bin"] for x in got)
            keys += [x["__key__"] for x in got]
            assert leftovers(staging_root) == []
    assert len(keys) == 30 and set(keys) == set(expected)  # 30 samples over 2 ranks: each once


def test_iterable_shuffle_buffer_too_big_for_the_budget_names_the_buffer_and_a_budget(
    moto: Store, staging_root: str
) -> None:
    # a buffer of 60 samples keeps samples of more shards staged than a budget of three holds
    from s5loader import S5IterableDataset

    shards, _ = make_shards(12, 10)
    source = put_indexed(moto, shards)
    big = max(map(len, shards.values()))
    opts = {
        "endpoint_url": moto.endpoint,
        "shuffle": True,
        "shuffle_buffer": 60,
        "budget": 3 * big,
        "staging_dir": staging_root,
    }
    # refused in this process when made, before any worker starts
    with pytest.raises(
        BudgetError, match=r"shuffle_buffer=60 over the tar shards .* budget of .* Give shuffle_buffer="
    ):
        S5IterableDataset.from_shards(source, **opts)
    assert os.listdir(staging_root) == []


def test_iterable_shuffle_over_shards_that_do_not_fit_mixes_and_fetches_each_shard_once(
    seaweed: Store, staging_root: str
) -> None:
    from support.faults import FaultProxy

    from s5loader import S5IterableDataset

    source, shards, big = class_sorted_shards(seaweed)
    proxy = FaultProxy(seaweed.endpoint)
    try:
        # two workers share the budget: each keeps 2 shards open beside one being staged
        with S5IterableDataset.from_shards(
            source,
            endpoint_url=proxy.endpoint,
            shuffle=True,
            seed=3,
            budget=8 * big,
            staging_dir=staging_root,
        ) as it:
            loader = DataLoader(it, batch_size=8, num_workers=2, collate_fn=lambda b: b)
            batches = [[int(x["cls"]) for x in b] for b in loader]
            assert leftovers(staging_root) == []
        gets = shard_gets(proxy.requests)
    finally:
        proxy.close()
    assert sorted(c for b in batches for c in b) == sorted(s for s in range(8) for _ in range(25))
    assert len(set(batches[0])) >= 2 and len(set(batches[1])) >= 2, batches[
        :2
    ]  # each worker's first batch mixes
    assert gets == Counter(list(shards)), gets


def test_an_iterable_frees_each_sample_it_reads_so_more_shards_mix_within_the_budget(
    seaweed: Store, staging_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from support.stores import Peak

    from s5loader import S5IterableDataset
    from s5loader._sampling import units

    source, shards, big = class_sorted_shards(seaweed, n_shards=12, per_shard=20, size=100_000)
    budget = 4 * big  # read in this process: 3 shards open beside one being staged, when nothing is freed

    def run() -> tuple[list[int], int]:
        with S5IterableDataset.from_shards(
            source,
            endpoint_url=seaweed.endpoint,
            shuffle=True,
            seed=2,
            budget=budget,
            staging_dir=staging_root,
        ) as it:

            def allocated() -> int:  # the blocks staged shards take on disk (punched ones do not)
                total = 0
                for root, _, files in os.walk(staging_root):
                    for f in files:  # shards and s5cmd's partial downloads; not the control files
                        if "/.calls" not in root and not f.startswith("."):
                            with contextlib.suppress(OSError):
                                total += os.lstat(os.path.join(root, f)).st_blocks * 512
                return total

            with Peak(allocated, interval=0.001) as peak:
                got = [int(x["cls"]) for x in it]
            assert leftovers(staging_root) == []
        return got, peak.peak

    def most_open(stream: list[int]) -> int:
        last = {c: pos for pos, c in enumerate(stream)}
        open_now: set[int] = set()
        most = 0
        for pos, c in enumerate(stream):
            open_now.add(c)
            most = max(most, len(open_now))
            if last[c] == pos:
                open_now.discard(c)
        return most

    with monkeypatch.context() as m:
        m.setattr(units, "punches_holes", lambda folder, most: False)  # a file system that cannot
        whole, peak_whole = run()
    freeing, peak = run()
    everything = sorted(s for s in range(12) for _ in range(20))
    assert sorted(freeing) == sorted(whole) == everything
    assert most_open(whole) == 3 < most_open(freeing), (most_open(whole), most_open(freeing))
    slack = 4 * 4096  # the budget counts bytes; a file takes whole blocks (four shards staged)
    assert big < peak <= budget + slack and big < peak_whole <= budget + slack, (peak, peak_whole, budget)


def test_the_iterable_checks_its_budget_and_worker_count_in_the_main_process(
    seaweed: Store, staging_root: str
) -> None:
    from s5loader import S5IterableDataset

    source, _, big = class_sorted_shards(seaweed, n_shards=4, per_shard=5)
    # a budget that cannot hold the largest shard: an error now, before any worker starts
    with pytest.raises(BudgetError) as e:
        S5IterableDataset.from_shards(
            source, endpoint_url=seaweed.endpoint, budget=big // 2, staging_dir=staging_root, num_workers=2
        )
    assert source in str(e.value) and "budget" in str(e.value), str(e.value)
    assert os.listdir(staging_root) == []  # nothing was made
    # the rank's whole budget serves all its workers: one and a half shards do for 2 workers
    with S5IterableDataset.from_shards(
        source,
        endpoint_url=seaweed.endpoint,
        budget=3 * big // 2,
        staging_dir=staging_root,
        num_workers=2,
        shuffle=False,
    ) as it:
        with pytest.raises(ConfigError, match="num_workers=2, but its DataLoader runs 1 worker"):
            next(iter(DataLoader(it, batch_size=2, num_workers=1)))
        got = [x for b in DataLoader(it, batch_size=2, num_workers=2, collate_fn=lambda b: b) for x in b]
        assert len(got) == 20
    with pytest.raises(ConfigError, match="num_workers must be None"):
        S5IterableDataset.from_shards(source, endpoint_url=seaweed.endpoint, num_workers=-1)


ITERABLE_SCRIPT = """
import os, signal, sys, time
from torch.utils.data import DataLoader
from s5loader import S5IterableDataset

def transform(sample):
    if {bad_key!r} and sample["__key__"] == {bad_key!r}:
        raise ValueError("a bad sample")
    return sample

it = S5IterableDataset.from_shards({source!r}, endpoint_url={endpoint!r}, budget={budget}, shuffle=True,
                                   staging_dir={root!r}, transform=transform, samples_per_call=2)
print("made", flush=True)
for i, b in enumerate(DataLoader(it, batch_size=2, num_workers=2, collate_fn=lambda b: b)):
    if i == 3:
        {action}
    time.sleep(0.05)
"""


@pytest.mark.parametrize("how", ["worker-error", "keyboardinterrupt", "sigkill"])
def test_the_iterable_leaves_no_staging_folder_after_an_error_and_the_next_start_removes_a_killed_ones(
    how: str, seaweed: Store, staging_root: str, tmp_path
) -> None:

    from s5loader import S5IterableDataset

    source, _, big = class_sorted_shards(seaweed, n_shards=4, per_shard=10)
    script = tmp_path / "train.py"
    script.write_text(
        ITERABLE_SCRIPT.format(
            source=source,
            endpoint=seaweed.endpoint,
            root=staging_root,
            budget=4 * big,
            bad_key="c2-004" if how == "worker-error" else "",
            action={"keyboardinterrupt": "raise KeyboardInterrupt", "sigkill": "time.sleep(60)"}.get(
                how, "pass"
            ),
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "made"
    staging = only_folder(staging_root)  # the iterable's staging directory
    if how == "sigkill":
        wait_for(lambda: leftovers(staging), 30, "staged shards, read by nobody", interval=0.1)
        proc.kill()
    _, err = proc.communicate(timeout=120)
    if how == "worker-error":
        assert proc.returncode == 1 and "ValueError: a bad sample" in err, err[-2000:]
    elif how == "keyboardinterrupt":
        assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in err, err[-2000:]
    if how != "sigkill":
        assert not os.path.exists(staging), leftovers(staging)
        return
    wait_for(  # the killed run's workers notice their parent is gone
        lambda: (
            not any(
                str(script) in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])
            )
        ),
        15,
        "the workers of the killed run to exit",
        interval=0.2,
    )
    assert os.path.isdir(staging)  # SIGKILL leaves it behind; the next start removes it
    with S5IterableDataset.from_shards(source, endpoint_url=seaweed.endpoint, staging_dir=staging_root):
        assert not os.path.exists(staging)
    assert os.listdir(staging_root) == []
