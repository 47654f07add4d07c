"""S5IterableDataset: every sample once per epoch, equal counts per rank, the order, exact
resume through StatefulDataLoader, the byte budget; real s5cmd against local S3 servers.

Private modules (``s5loader._index``, ``s5loader._sampling``) are imported only where they are
the seam under test; the rest goes through the public API."""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest
from support.stores import Peak, Store, make_pairs, only_folder, staged_bytes
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from s5loader import S5Dataset, S5IterableDataset
from s5loader._sampling.order import Order


def collate(batch):
    return batch


def keys_of(source: dict[str, bytes]) -> list[str]:
    return sorted({k.rsplit(".", 1)[0] for k in source})


def keys(loader) -> list[str]:  # type: ignore[no-untyped-def]
    return [s["__key__"] for b in loader for s in b]


@pytest.fixture
def pairs(moto: Store) -> tuple[Store, dict[str, bytes]]:
    return moto, moto.put(make_pairs(23, size=300))


def make(store: Store, root: str, **kw):  # type: ignore[no-untyped-def]
    return S5IterableDataset.from_prefix(store.uri(), endpoint_url=store.endpoint, staging_dir=root, **kw)


# -- the real path -------------------------------------------------------------------------
def test_every_sample_once_per_epoch_with_0_and_2_workers(pairs, staging_root: str) -> None:  # type: ignore[no-untyped-def]
    store, source = pairs
    with make(store, staging_root, budget="64KiB") as it:
        for workers in (0, 2):
            got = [
                s for b in DataLoader(it, batch_size=4, num_workers=workers, collate_fn=collate) for s in b
            ]
            assert sorted(s["__key__"] for s in got) == keys_of(source)
            assert all(s["image"] == source[s["__key__"] + ".image"] for s in got)
        assert len(it) == len(source) // 2
        assert staged_bytes(staging_root) == 0  # every sample read was deleted


def test_a_worker_its_loader_stops_ends_quietly(pairs, staging_root: str) -> None:  # type: ignore[no-untyped-def]
    # torch's SIGTERM handler in a worker (set in C) exits 0 when the loader stops it; the
    # staging cleanup handler must not replace it, or every stop reads as a worker crash
    store, _ = pairs
    with make(store, staging_root, samples_per_call=2) as it:
        stream = iter(DataLoader(it, batch_size=1, num_workers=1, collate_fn=collate))
        next(stream)  # the worker's engine runs
        worker = stream._workers[0]  # type: ignore[attr-defined]
        os.kill(worker.pid, signal.SIGTERM)
        worker.join(timeout=60)
        assert worker.exitcode == 0
        del stream


def test_two_ranks_yield_equal_counts_and_cover_everything(pairs, staging_root: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    store, source = pairs  # 23 samples: uneven over 2 ranks
    for drop_last in (False, True):
        per_rank = []
        for rank in (0, 1):
            # rank 0 by arguments; rank 1 as torchrun says it (the workers inherit the environment)
            split = {"num_replicas": 2, "rank": 0} if rank == 0 else {}
            monkeypatch.setenv("WORLD_SIZE", "2")
            monkeypatch.setenv("RANK", str(rank))
            with make(store, staging_root, drop_last=drop_last, **split) as it:
                batches = list(DataLoader(it, batch_size=4, num_workers=2, collate_fn=collate))
                per_rank.append(([s["__key__"] for b in batches for s in b], len(batches)))
        (a, na), (b, nb) = per_rank
        assert len(a) == len(b) == (11 if drop_last else 12) and na == nb
        if drop_last:
            assert not set(a) & set(b) and len(set(a) | set(b)) == 22
        else:
            assert sorted(set(a) | set(b)) == keys_of(source)


def test_order_follows_seed_and_epoch(pairs, staging_root: str) -> None:  # type: ignore[no-untyped-def]
    store, source = pairs

    def run(epoch: int, **kw) -> list[str]:  # type: ignore[no-untyped-def]
        with make(store, staging_root, **kw) as it:
            it.set_epoch(epoch)
            return keys(DataLoader(it, batch_size=2, num_workers=2, collate_fn=collate))

    first = run(0, seed=4, shuffle_buffer=5)
    assert run(0, seed=4, shuffle_buffer=5) == first
    assert sorted(first) == keys_of(source)
    other = run(1, seed=4, shuffle_buffer=5)
    assert other != first and sorted(other) == sorted(first)
    assert run(0, seed=4) != first  # the buffer draws


@pytest.mark.parametrize(("shuffle", "persistent"), [(True, False), ("block", True)])
def test_mid_epoch_resume_through_stateful_dataloader_is_exact(
    pairs, staging_root: str, shuffle, persistent
) -> None:  # type: ignore[no-untyped-def]
    store, source = pairs

    def loader(it: S5IterableDataset) -> StatefulDataLoader:
        return StatefulDataLoader(
            it, batch_size=2, num_workers=2, persistent_workers=persistent, collate_fn=collate
        )

    opts = {"shuffle": shuffle, "seed": 9, "shuffle_buffer": 4, "block_size": 4, "samples_per_call": 5}
    with make(store, staging_root, **opts) as it:
        it.set_epoch(3)
        ld = loader(it)
        stream = iter(ld)
        head = [s["__key__"] for _ in range(4) for s in next(stream)]
        state = ld.state_dict()
        rest = [s["__key__"] for b in stream for s in b]
        end_state = ld.state_dict()
    assert sorted(head + rest) == keys_of(source)
    with make(store, staging_root, **opts) as again:
        ld = loader(again)
        ld.load_state_dict(state)
        assert keys(ld) == rest  # the same samples, in the same order
    # after the whole epoch: the next one, here as set_epoch names it
    with make(store, staging_root, **opts) as fresh:
        fresh.set_epoch(4)
        epoch4 = keys(loader(fresh))
    with make(store, staging_root, **opts) as again:
        again.set_epoch(4)
        ld = loader(again)
        ld.load_state_dict(end_state)
        assert keys(ld) == epoch4 != head + rest


def test_a_block_state_resumes_only_over_the_blocks_it_was_cut_into(moto: Store, staging_root: str) -> None:
    from s5loader import StateError

    moto.put({f"raw/{i:04d}.bin": bytes([i % 251]) * 10 for i in range(120)})

    def made(block_size: int) -> S5IterableDataset:
        return S5IterableDataset.from_prefix(
            moto.uri("raw/"), endpoint_url=moto.endpoint, staging_dir=staging_root, shuffle="block",
            seed=3, block_size=block_size,
        )  # fmt: skip

    with made(64) as it:
        full = [s["__key__"] for s in it]
    with made(64) as it:
        ld = StatefulDataLoader(it, batch_size=5, collate_fn=collate)
        stream = iter(ld)
        head = [s["__key__"] for _ in range(3) for s in next(stream)]
        state = ld.state_dict()
    worker = state["dataset_state"] if "dataset_state" in state else state
    assert (worker["block_size"], worker["block_rule"]) == (64, 2)
    with made(8) as other:  # tens, not the hundred 0000-0099: another order
        with pytest.raises(StateError, match=r"64 samples \(rule 2\), this run into blocks of at most 8"):
            ld = StatefulDataLoader(other, batch_size=5, collate_fn=collate)
            ld.load_state_dict(state)
            next(iter(ld))  # (applied at iter() where the loader defers it)
    with made(64) as again:
        ld = StatefulDataLoader(again, batch_size=5, collate_fn=collate)
        ld.load_state_dict(state)
        assert head + keys(ld) == full


def test_end_of_epoch_state_resumes_at_the_next_epoch(pairs, staging_root: str) -> None:  # type: ignore[no-untyped-def]
    store, _ = pairs
    with make(store, staging_root, seed=2) as it:
        ld = StatefulDataLoader(it, batch_size=5, collate_fn=collate)
        epoch0 = keys(ld)
        state = ld.state_dict()
        it.set_epoch(1)
        epoch1 = keys(ld)
    assert epoch1 != epoch0
    with make(store, staging_root, seed=2) as again:  # no set_epoch: the state says what is next
        ld = StatefulDataLoader(again, batch_size=5, collate_fn=collate)
        ld.load_state_dict(state)
        assert keys(ld) == epoch1


def test_a_rank_stages_once_in_one_folder_within_its_whole_budget(seaweed: Store, staging_root: str) -> None:
    source = seaweed.put(make_pairs(80, size=2000))
    ds = S5Dataset.from_prefix(seaweed.uri(), endpoint_url=seaweed.endpoint)
    budget = ds.total_bytes // 8
    folders: set[str] = set()

    with S5IterableDataset(ds, budget=budget, samples_per_call=10, staging_dir=staging_root) as it:
        area = only_folder(staging_root)

        def look() -> int:
            folders.update(n for n in os.listdir(area) if not n.startswith("."))
            return staged_bytes(staging_root)

        assert it.metrics().fetched_bytes == 0 and it.metrics().budget == budget  # before any pass
        with Peak(look) as watcher:
            got = keys(DataLoader(it, batch_size=4, num_workers=2, collate_fn=collate))
        m = it.metrics()  # the hosting worker's figures, read in this process
    assert sorted(got) == keys_of(source)
    assert watcher.looks > 10 and 0 < watcher.peak <= budget, (watcher.peak, budget)
    assert len(folders) == 1  # one staging run for the rank, not one per worker
    assert (m.fetched_bytes, m.samples, m.budget) == (ds.total_bytes, len(ds), budget), m
    # the whole budget is the rank's: one that holds a few of the largest samples serves 4 workers
    largest = max(s.size for s in ds.samples)
    with S5IterableDataset(ds, budget=largest * 3, staging_dir=staging_root, batch_size=2) as small:
        got = keys(DataLoader(small, batch_size=2, num_workers=4, collate_fn=collate))
    assert sorted(got) == keys_of(source)


def test_with_the_batch_size_the_loader_yields_the_rank_order_exactly(
    pairs: tuple[Store, dict[str, bytes]], staging_root: str
) -> None:
    store, source = pairs
    with make(store, staging_root, seed=3, batch_size=2) as it:
        got = keys(DataLoader(it, batch_size=2, num_workers=3, collate_fn=collate))
        expected = [
            it.dataset.samples[i].key for i in Order(True, 3, 1, 0, False).indices(len(it.dataset), 0)
        ]
    assert got == expected  # the sampler's order: workers take turns a batch at a time
    with make(store, staging_root, seed=3) as it:  # a sample at a time: the same samples, batched by worker
        got = keys(DataLoader(it, batch_size=2, num_workers=3, collate_fn=collate))
    assert sorted(got) == sorted(expected) and got != expected


def test_the_feed_hands_each_worker_its_own_positions_and_a_host_gone_is_an_error() -> None:
    import secrets
    import threading

    from s5loader import StallError
    from s5loader._sampling import feed

    def serve(hellos):  # type: ignore[no-untyped-def]
        assert sorted(hellos) == [0, 1] and hellos[1].start == 2
        for pos in range(10):
            yield pos, (feed.INDEX, pos)

    name = f"s5loader-test-{secrets.token_hex(4)}"
    host = feed.FeedHost(name, feed.Hello(0, 2, 0, 0, ()), serve, lambda pos: pos % 2).start()
    got: dict[int, list[object]] = {}
    t = threading.Thread(
        target=lambda: got.__setitem__(1, list(feed.connect(name, feed.Hello(1, 2, 0, 2, ()))))
    )
    t.start()
    got[0] = list(feed.local(host))
    t.join(30)
    host.close()
    assert got[0] == [(feed.INDEX, p) for p in range(0, 10, 2)] + [(feed.END, None)]
    assert got[1] == [(feed.INDEX, p) for p in range(1, 10, 2)] + [(feed.END, None)]

    release = threading.Event()

    def stalls(hellos):  # type: ignore[no-untyped-def]
        yield 1, (feed.INDEX, 1)
        release.wait(30)

    name = f"s5loader-test-{secrets.token_hex(4)}"
    host = feed.FeedHost(name, feed.Hello(0, 2, 0, 0, ()), stalls, lambda pos: pos % 2).start()
    messages = feed.connect(name, feed.Hello(1, 2, 0, 0, ()))
    assert next(messages) == (feed.INDEX, 1)
    host.close()  # the host goes away mid-pass (its process ended)
    release.set()
    with pytest.raises(StallError, match="went away before the end of the pass"):
        next(messages)
    with pytest.raises(StallError, match="found no staging host"):
        next(feed.connect(f"s5loader-test-{secrets.token_hex(4)}", feed.Hello(1, 2, 0, 0, ()), timeout=0.2))


def slow_in_worker_1(sample):  # type: ignore[no-untyped-def]
    import time

    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is not None and info.id == 1:
        time.sleep(0.02)
    return sample


def test_workers_still_reading_when_the_hosting_worker_ends_read_staged_files(
    moto: Store, staging_root: str
) -> None:
    from support.faults import FaultProxy

    source = moto.put(make_pairs(40, size=500))
    proxy = FaultProxy(moto.endpoint)
    try:
        ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=proxy.endpoint, transform=slow_in_worker_1)
        # worker 0 (the host) reads a third of the rank's order and ends long before worker 1,
        # which the DataLoader then shuts down: its staged files must stay for worker 1
        with S5IterableDataset(ds, staging_dir=staging_root, batch_size=10, shuffle=False) as it:
            got = keys(DataLoader(it, batch_size=10, num_workers=2, collate_fn=collate))
        gets = Counter(
            path.split("?")[0]
            for method, path, _ in proxy.requests
            if method == "GET" and "list-type" not in path
        )
    finally:
        proxy.close()
    assert got == keys_of(source)  # the rank's order: key order, a batch per worker in turn
    assert len(gets) == len(source) and set(gets.values()) == {1}, gets  # staged once, never fetched directly


def test_nothing_is_left_after_a_run_under_server_faults(seaweed: Store, tmp_path) -> None:
    from support.faults import FaultProxy, Rule

    source = seaweed.put(make_pairs(40, size=3000))
    proxy = FaultProxy(seaweed.endpoint)
    proxy.rules += [  # a few of each: s5cmd retries them
        Rule("0003.image", "503", times=2, method="*"),
        Rule("0011.label", "500", times=1, method="*"),
        Rule("0017.image", "drop", times=1),
        Rule("0025.image", "truncate", times=1),
    ]
    root = tmp_path / "staging"
    root.mkdir()
    try:
        with S5IterableDataset.from_prefix(
            seaweed.uri(), endpoint_url=proxy.endpoint, staging_dir=str(root), samples_per_call=6, seed=0
        ) as it:
            got = [s for b in DataLoader(it, batch_size=4, num_workers=2, collate_fn=list) for s in b]
            assert sorted(s["__key__"].rsplit("/", 1)[-1] for s in got) == [f"{i:04d}" for i in range(40)]
            assert all(s["image"] == source[s["__key__"] + ".image"] for s in got)
            assert it.metrics().samples == 40
    finally:
        proxy.close()
    assert os.listdir(root) == []  # the metrics files and every control file went with close()


def frozen_count(sample: dict) -> dict:  # type: ignore[type-arg]
    import gc

    return {**sample, "frozen": gc.get_freeze_count()}


def test_the_workers_freeze_what_they_inherited_and_the_loaders_process_does_not(
    moto: Store, staging_root: str
) -> None:
    import gc

    moto.put(make_pairs(12, size=50))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint, transform=frozen_count)
    before = gc.get_freeze_count()
    with S5IterableDataset(ds, staging_dir=staging_root) as data:
        got = [s for b in DataLoader(data, batch_size=3, num_workers=2, collate_fn=collate) for s in b]
        assert len(got) == 12 and all(s["frozen"] > before for s in got)  # each worker froze its inheritance
        assert [s["frozen"] for s in data] == [before] * 12  # without workers: nothing frozen
    assert gc.get_freeze_count() == before
