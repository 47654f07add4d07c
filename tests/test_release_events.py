"""The staging contract: one layout both sides use, and releases that reach the engine as
events (the pass's FIFO), with the folder check left only as a slow safety net.

The end-to-end tests run the real s5cmd against a real local S3 server.

Private modules (``s5loader._engine``, ``s5loader._staging``) are imported only where they are the
seam under test; the rest goes through the public API."""

from __future__ import annotations

import os
import shutil

import pytest
from support.stores import Store, make_pairs
from torch.utils.data import DataLoader

from s5loader import S5Dataset, S5Sampler
from s5loader._engine.budget import Budget
from s5loader._staging.layout import StagingLayout
from s5loader._staging.release_events import ReleaseEvents
from s5loader.dataset import StagedIndex


def collate(batch):
    return batch


def keys_of(source: dict[str, bytes]) -> list[str]:
    return sorted({k.rsplit(".", 1)[0] for k in source})


def test_dataset_releases_through_the_layout(moto: Store, staging_root: str) -> None:
    source = moto.put(make_pairs(4, size=10))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    folder = os.path.join(staging_root, "pass")
    layout = StagingLayout(folder)
    sample = ds.samples[2]
    os.makedirs(layout.sample_dir(2))
    for p, f in zip(layout.paths(2, sample), sample.fields, strict=True):
        with open(p, "wb") as fh:
            fh.write(source[sample.key + "." + f.name])
    events = ReleaseEvents(layout).open()
    try:
        got = ds[StagedIndex(2, folder)]
        assert got["image"] == source[sample.key + ".image"]
        assert not os.path.exists(layout.sample_dir(2))
        assert events.read() == [2]
    finally:
        events.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_releases_free_the_budget_without_polling(
    moto: Store, staging_root: str, monkeypatch: pytest.MonkeyPatch, num_workers: int
) -> None:
    # With the folder check turned off, only the readers' announcements can free budget: a
    # budget of three samples gets through 40 only if every release reaches the engine.
    monkeypatch.setattr(Budget, "poll", lambda self: None)
    source = moto.put(make_pairs(40, size=500))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    three = 3 * max(s.size for s in ds.samples)
    with S5Sampler(
        ds, budget=three, samples_per_call=4, staging_dir=staging_root, stall_timeout=10
    ) as sampler:
        loader = DataLoader(ds, sampler=sampler, batch_size=1, num_workers=num_workers, collate_fn=collate)
        got = [s for b in loader for s in b]
        assert sampler.stats is not None and sampler.stats.peak_reserved <= three
    assert sorted(s["__key__"] for s in got) == keys_of(source)


def test_consumer_that_only_deletes_folders_still_frees_the_budget(moto: Store, staging_root: str) -> None:
    # The safety net: a consumer that deletes sample folders itself and announces nothing.
    moto.put(make_pairs(12, size=500))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    two = 2 * max(s.size for s in ds.samples)
    seen = []
    with S5Sampler(ds, budget=two, samples_per_call=2, staging_dir=staging_root, stall_timeout=30) as sampler:
        for idx in sampler:
            assert isinstance(idx, StagedIndex)
            folder = StagingLayout(idx.folder).sample_dir(idx)
            assert os.path.isdir(folder)
            shutil.rmtree(folder)
            seen.append(int(idx))
    assert sorted(seen) == list(range(12))
