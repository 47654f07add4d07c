"""shuffle="block": windows of whole blocks sized by the budget, their determinism,
completeness and resume, the quality figure, and the engine's calls of whole windows.

A private module (``s5loader._engine``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

import pytest
from support.stores import Store, make_pairs, staged_samples
from torch.utils.data import DataLoader

import s5loader._engine.stager as stager_module
from s5loader import S5Dataset, S5Sampler
from s5loader.exceptions import StateError


@pytest.mark.parametrize("calls_in_flight", [2, 4])
def test_small_budget_block_shuffle_stages_whole_windows(
    moto: Store, staging_root: str, monkeypatch, calls_in_flight: int
) -> None:
    source = moto.put(make_pairs(120, size=300))  # 321-byte samples in blocks of ten
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    sample = 321
    calls: list[tuple[list[int], list[str]]] = []
    real_plan = stager_module.plan_call

    def recording_plan(samples, order, positions, *args, **kwargs):
        plan = real_plan(samples, order, positions, *args, **kwargs)
        calls.append((list(positions), plan.lines))
        return plan

    monkeypatch.setattr(stager_module, "plan_call", recording_plan)
    # room for three windows of 30 samples: windows of three blocks, calls cut by the budget;
    # the window does not follow calls_in_flight
    with S5Sampler(
        ds,
        shuffle="block",
        seed=1,
        block_size=10,
        budget=3 * 30 * sample,
        calls_in_flight=calls_in_flight,
        staging_dir=staging_root,
    ) as sampler:
        assert sampler.window == 30
        order, starts = sampler._epoch_plan(0)
        loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=2, collate_fn=lambda b: b)
        got = [s for b in loader for s in b]
        assert sorted(s["__key__"] for s in got) == sorted({k.rsplit(".", 1)[0] for k in source})
        assert all(s["image"] == source[s["__key__"] + ".image"] for s in got)
        assert staged_samples(sampler.staging_dir) == []
        quality = sampler.shuffle_quality(span=10)
        state = sampler.state_dict()
    # the state keeps the window: another budget resumes the same order
    with S5Sampler(ds, shuffle="block", seed=1, block_size=10, staging_dir=staging_root) as other:
        assert other.window != 30
        other.load_state_dict({**state, "complete": False, "start": 0, "yielded": 0})
        assert other.window == 30 and other._epoch_plan(0) == (order, starts)
        with pytest.raises(StateError, match="window"):
            other.load_state_dict({**state, "window": 0})
    assert [s["__key__"] for s in got] == [ds.samples[i].key for i in order]
    # every call holds whole windows, so every block goes as one wildcard line
    assert [p for positions, _ in calls for p in positions] == list(range(120))
    for positions, lines in calls:
        assert positions[0] in starts and (positions[-1] + 1 in starts or positions[-1] == 119)
        assert len(lines) == len(positions) // 10 and all("*" in line for line in lines)
    assert 2 < quality.units_per_span <= 3  # runs of 10 inside windows of 3 blocks
