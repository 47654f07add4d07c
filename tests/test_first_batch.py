"""A batch waits only for its own samples: the sampler hands out an index whose sample is not
staged yet, and the reader waits for it; an early sample that cannot be fetched, or stalls,
ends as it does for the sampler (its error), never in a worker waiting for ever."""

from __future__ import annotations

import collections
import io
import os
import stat

import pytest
from support.faults import FaultProxy, Rule
from support.stores import Store, make_pairs, staged_samples
from support.threads import in_thread
from torch.utils.data import DataLoader

from s5loader import ObjectNotFoundError, S5Dataset, S5Sampler, StallError
from s5loader._staging import words


@pytest.fixture
def proxy(moto: Store):
    p = FaultProxy(moto.endpoint)
    yield p
    p.close()


def test_a_dataloader_gets_its_first_fill_before_it_is_staged(
    moto: Store, proxy: FaultProxy, staging_root: str
) -> None:
    source = moto.put(make_pairs(24))
    keys = sorted({k.rsplit(".", 1)[0] for k in source})
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    ds.endpoint_url = proxy.endpoint  # the listing is done; every request of the pass is held
    proxy.rules.append(Rule("", "hold", method="*"))
    with S5Sampler(ds, shuffle=True, staging_dir=staging_root) as sampler:
        loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=2, collate_fn=lambda b: b)
        # iter() takes prefetch_factor x num_workers = 4 batches of indices: before, it waited
        # for all 16 samples to be staged, and nothing answers
        t, got = in_thread(lambda: iter(loader))
        t.join(60)
        assert not t.is_alive() and not isinstance(got[0], BaseException)
        assert proxy.wait_held("", 1, 60)  # the engine asked for them; nothing is staged yet
        assert staged_samples(sampler.staging_dir) == []
        proxy.release.set()
        batches = list(got[0])  # type: ignore[call-overload]
    got_keys = [s["__key__"] for b in batches for s in b]
    assert sorted(got_keys) == keys
    assert all(s["image"] == source[s["__key__"] + ".image"] for b in batches for s in b)


def test_a_worker_asks_for_the_early_samples_of_a_batch_in_one_request(
    moto: Store, proxy: FaultProxy, staging_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    moto.put(make_pairs(24))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    ds.endpoint_url = proxy.endpoint
    proxy.rules.append(Rule("", "hold", method="*"))
    asked: list[object] = []
    read = words.read

    def recording(f: object) -> object:
        got = read(f)
        if not isinstance(f, io.BytesIO):  # the sampler's side, in this process: a worker's request
            asked.append(got)
        return got

    monkeypatch.setattr(words, "read", recording)
    with S5Sampler(ds, shuffle=True, staging_dir=staging_root) as sampler:
        loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=2, collate_fn=lambda b: b)
        t, got = in_thread(lambda: iter(loader))
        t.join(60)
        assert not t.is_alive() and not isinstance(got[0], BaseException)
        assert proxy.wait_held("", 1, 60)  # the first fill of 4 batches went out unstaged
        proxy.release.set()
        n = sum(len(b) for b in got[0])  # type: ignore[attr-defined]
    assert n == 24
    # one request per batch with early samples, not one per sample
    sizes = [len(a) for a in asked]  # type: ignore[arg-type]
    assert len(sizes) <= 6 and sum(sizes) >= 16 and max(sizes) == 4


def test_a_sampler_iterated_directly_yields_staged_samples(moto: Store, staging_root: str) -> None:
    moto.put(make_pairs(12))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    read = []
    with S5Sampler(ds, shuffle=True, staging_dir=staging_root) as sampler:
        for idx in sampler:  # a consumer of its own may read the files without S5Dataset
            assert not idx.early and os.path.isdir(f"{idx.folder}/{int(idx)}")
            read.append(ds[idx]["__key__"])
    assert sorted(read) == sorted(s.key for s in ds.samples)  # every sample once


def test_a_dataloader_with_workers_reads_every_sample_once(seaweed: Store, staging_root: str) -> None:
    source = seaweed.put(make_pairs(150, size=2000))
    keys = sorted({k.rsplit(".", 1)[0] for k in source})
    ds = S5Dataset.from_prefix(seaweed.uri(), endpoint_url=seaweed.endpoint)
    with S5Sampler(ds, shuffle=True, staging_dir=staging_root, samples_per_call=40) as sampler:
        loader = DataLoader(
            ds, sampler=sampler, batch_size=8, num_workers=3, persistent_workers=True, collate_fn=lambda b: b
        )
        for epoch in range(2):
            sampler.set_epoch(epoch)
            got = [s for b in loader for s in b]
            count = collections.Counter(s["__key__"] for s in got)
            assert sorted(count) == keys and set(count.values()) == {1}
            assert all(s["image"] == source[s["__key__"] + ".image"] for s in got)
            assert staged_samples(sampler.staging_dir) == []
            # samples went out before they were staged: the pass served its words on its socket
            words = [os.path.join(sampler.staging_dir, p, ".w") for p in os.listdir(sampler.staging_dir)]
            assert any(os.path.exists(w) and stat.S_ISSOCK(os.stat(w).st_mode) for w in words)


def test_an_early_sample_that_cannot_be_fetched_raises_in_the_loop(moto: Store, staging_root: str) -> None:
    moto.put(make_pairs(40))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    with S5Sampler(ds, shuffle=False, staging_dir=staging_root, retries=0) as sampler:
        moto.client.delete_object(Bucket=moto.bucket, Key=moto.prefix + "0002.image")  # after the listing
        loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=2, collate_fn=lambda b: b)
        t, got = in_thread(lambda: [s["__key__"] for b in loader for s in b])
        t.join(120)
        assert not t.is_alive(), "a worker waits for a sample that will not come"
    assert isinstance(got[0], ObjectNotFoundError) and "0002.image" in str(got[0])


def test_an_early_sample_skipped_under_skip_is_left_out(moto: Store, staging_root: str) -> None:
    moto.put(make_pairs(40))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    with S5Sampler(ds, shuffle=False, staging_dir=staging_root, retries=0, on_error="skip") as sampler:
        moto.client.delete_object(Bucket=moto.bucket, Key=moto.prefix + "0002.image")
        loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=2, collate_fn=lambda b: b)
        t, got = in_thread(lambda: [s["__key__"] for b in loader for s in b])
        t.join(120)
        assert not t.is_alive(), "a worker waits for a skipped sample"
        assert sampler.stats is not None and sampler.stats.skipped == [moto.uri("0002.image")]
    assert got[0] == [moto.prefix + f"{i:04d}" for i in range(40) if i != 2]


def test_an_early_sample_that_stalls_is_a_stall_error(
    moto: Store, proxy: FaultProxy, staging_root: str
) -> None:
    moto.put(make_pairs(20))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    ds.endpoint_url = proxy.endpoint
    proxy.rules.append(Rule("0001.image", "hold", method="*"))  # never answered
    with S5Sampler(ds, shuffle=False, staging_dir=staging_root, stall_timeout=1, retries=1) as sampler:
        loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=2, collate_fn=lambda b: b)
        t, got = in_thread(lambda: [s["__key__"] for b in loader for s in b])
        t.join(120)
        assert not t.is_alive(), "a worker waits for a stalled sample"
    proxy.release.set()
    assert isinstance(got[0], StallError) and "0001.image" in str(got[0])
