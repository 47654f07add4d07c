"""What passes between the sampler and the DataLoader's workers besides the indices: the
DataLoader's batch size (looked up in the frame of its BatchSampler, or given explicitly with
``S5Sampler.batches``), and the pass folder each ``StagedIndex`` names (a wrapper that turns it
into a plain int is counted and reported)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
from support.faults import FaultProxy, Rule
from support.stores import Store, make_pairs, staged_samples
from support.threads import in_thread
from torch.utils.data import DataLoader, Sampler

from s5loader import BudgetError, S5Dataset, S5Sampler
from s5loader._staging.plainindex import plain_reads


class Ints(Sampler[int]):
    """A wrapper that hands on plain ints: what a sampler built around S5Sampler may do."""

    def __init__(self, inner: S5Sampler) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[int]:
        return (int(i) for i in self.inner)


@pytest.fixture
def proxy(moto: Store):
    p = FaultProxy(moto.endpoint)
    yield p
    p.close()


def test_batches_hands_out_the_first_fill_before_it_is_staged(
    moto: Store, proxy: FaultProxy, staging_root: str
) -> None:
    source = moto.put(make_pairs(24))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    ds.endpoint_url = proxy.endpoint  # the listing is done; every request of the pass is held
    proxy.rules.append(Rule("", "hold", method="*"))
    with S5Sampler(ds, shuffle=True, staging_dir=staging_root) as sampler:
        batches = sampler.batches(4)
        loader = DataLoader(ds, batch_sampler=batches, num_workers=2, collate_fn=lambda b: b)
        # the first fill (4 batches) is handed out while nothing is staged: the batch size came
        # from batches(), not from a frame
        t, got = in_thread(lambda: iter(loader))
        t.join(60)
        assert not t.is_alive() and not isinstance(got[0], BaseException)
        assert proxy.wait_held("", 1, 60)
        assert staged_samples(sampler.staging_dir) == []
        proxy.release.set()
        out = list(got[0])  # type: ignore[call-overload]
    assert [len(b) for b in out] == [4] * 6
    assert sorted(s["__key__"] + ".image" for b in out for s in b) == sorted(
        k for k in source if "image" in k
    )
    assert batches.state_dict() == sampler.state_dict()


@pytest.mark.parametrize("explicit", [True, False], ids=["batches", "frame"])
def test_a_budget_smaller_than_a_batch_is_an_error_both_ways(
    moto: Store, staging_root: str, explicit: bool
) -> None:
    moto.put(make_pairs(24, size=1000))  # about 1 KB a sample
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    with S5Sampler(ds, shuffle=False, staging_dir=staging_root, budget=4000) as sampler:
        loader = (
            DataLoader(ds, batch_sampler=sampler.batches(8), collate_fn=lambda b: b)
            if explicit
            else DataLoader(ds, sampler=sampler, batch_size=8, collate_fn=lambda b: b)
        )
        with pytest.raises(BudgetError, match="batch_size=8"):
            next(iter(loader))
        # a batch the budget holds goes through either way
        loader = (
            DataLoader(ds, batch_sampler=sampler.batches(2, drop_last=True), collate_fn=lambda b: b)
            if explicit
            else DataLoader(ds, sampler=sampler, batch_size=2, drop_last=True, collate_fn=lambda b: b)
        )
        assert sum(len(b) for b in loader) == 24


def test_a_wrapper_that_calls_int_is_counted_and_reported(
    moto: Store, staging_root: str, caplog: pytest.LogCaptureFixture
) -> None:
    moto.put(make_pairs(12))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    with S5Sampler(ds, shuffle=False, staging_dir=staging_root) as sampler:
        with caplog.at_level(logging.WARNING, logger="s5loader"):
            ds[0]  # a plain int with no pass running: fetched, nothing said
            assert not [r for r in caplog.records if "plain int" in r.getMessage()]
            loader = DataLoader(ds, sampler=Ints(sampler), batch_size=4, collate_fn=lambda b: b)
            assert sum(len(b) for b in loader) == 12
        said = [r.getMessage() for r in caplog.records if "plain int" in r.getMessage()]
        # one warning from the dataset, one in the pass's report
        assert len(said) == 2 and "StagedIndex" in said[0] and "12 sample(s)" in said[1]
        assert sampler.stats is not None and sampler.stats.plain_indices == 12
        # the staged files were left behind: what the warning says
        assert len(staged_samples(sampler.staging_dir)) == 12


def test_a_wrapper_in_front_of_workers_is_counted_in_the_pass(moto: Store, staging_root: str) -> None:
    moto.put(make_pairs(20))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    with S5Sampler(ds, shuffle=True, staging_dir=staging_root) as sampler:
        loader = DataLoader(ds, sampler=Ints(sampler), batch_size=4, num_workers=2, collate_fn=lambda b: b)
        assert sum(len(b) for b in loader) == 20
        # the workers counted every read in the pass folder; the sampler's stats report them
        folder = os.path.join(sampler.staging_dir, "p1")
        assert plain_reads(folder) == 20
        assert sampler.stats is not None and 0 < sampler.stats.plain_indices <= 20
        # the same loader without the wrapper: nothing counted in its pass
        loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=2, collate_fn=lambda b: b)
        assert sum(len(b) for b in loader) == 20
        assert plain_reads(os.path.join(sampler.staging_dir, "p2")) == 0
        assert sampler.stats is not None and sampler.stats.plain_indices == 0
