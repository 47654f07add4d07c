"""The engine over a fake s5cmd (a script that copies from a local folder), with Hypothesis
checking that the staged bytes never exceed the budget and that every sample comes once. The
fake runs as a subprocess, so this is not in the unit tier."""

from __future__ import annotations

import os
import stat
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.stores import Peak, staged_bytes

from s5loader import S5Dataset, S5Sampler


# -- the engine over a fake s5cmd -----------------------------------------------------------------
@pytest.fixture
def fake_s3(tmp_path, monkeypatch: pytest.MonkeyPatch):
    root = tmp_path / "s3"
    (root / "bkt").mkdir(parents=True)
    wrapper = tmp_path / "s5cmd"
    here = os.path.dirname(os.path.abspath(__file__))
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {here}/support/fake_s5cmd.py "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("S5LOADER_S5CMD", str(wrapper))
    monkeypatch.setenv("FAKE_S3_ROOT", str(root))
    return root / "bkt"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=40),
    spc=st.integers(1, 12),
    calls_in_flight=st.integers(1, 3),
    slack=st.integers(0, 4000),
    shuffle=st.sampled_from([True, False, "block"]),
)
def test_budget_never_exceeded_and_each_sample_once(
    fake_s3, tmp_path, sizes, spc, calls_in_flight, slack, shuffle
) -> None:
    import shutil

    shutil.rmtree(fake_s3)
    fake_s3.mkdir()
    for i, size in enumerate(sizes):
        (fake_s3 / f"{i:03d}.bin").write_bytes(bytes([i % 256]) * size)
        (fake_s3 / f"{i:03d}.txt").write_bytes(str(i).encode())
    ds = S5Dataset.from_prefix("s3://bkt/", endpoint_url="http://fake")
    budget = max(s.size for s in ds.samples) + slack
    root = str(tmp_path / "stage")
    os.makedirs(root, exist_ok=True)
    with (
        Peak(lambda: staged_bytes(root), interval=0.0005) as peak,
        S5Sampler(
            ds,
            shuffle=shuffle,
            samples_per_call=spc,
            calls_in_flight=calls_in_flight,
            budget=budget,
            staging_dir=root,
            block_size=4,
        ) as sampler,
    ):
        got = []
        for idx in sampler:
            s = ds[idx]
            assert s["bin"] == bytes([int(s["txt"]) % 256]) * sizes[int(s["txt"])]
            got.append(idx)
        assert sampler.stats is not None and sampler.stats.peak_reserved <= budget
    assert sorted(got) == list(range(len(sizes)))
    assert peak.peak <= budget
