"""Messages a first run meets: no starvation warning on a short run, a budget below one batch
fails at once with the numbers, missing credentials and a missing bucket say what to check.

A private module (``s5loader._engine``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from support.stores import Store, make_pairs
from torch.utils.data import DataLoader

from s5loader import S5Dataset, S5Sampler
from s5loader._engine import Stats
from s5loader.exceptions import AccessDeniedError, BudgetError, ConfigError, NoSuchBucketError

ROOT = Path(__file__).resolve().parent.parent


def test_short_run_is_not_starvation(
    moto: Store, staging_root: str, caplog: pytest.LogCaptureFixture
) -> None:
    moto.put(make_pairs(2))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    with S5Sampler(ds, staging_dir=staging_root) as sampler, caplog.at_level(logging.INFO, logger="s5loader"):
        for _ in range(4):  # four one-second epochs that wait 60% of the time: a demo, not a problem
            sampler._run.report(Stats(samples=10, wait_s=0.7, first_wait_s=0.1), 1.0, True, sampler.epoch)
        assert [r.levelname for r in caplog.records if r.name == "s5loader.sampler"] == ["INFO"] * 4
        for _ in range(60):  # the same, for a minute: now it matters
            sampler._run.report(Stats(samples=10, wait_s=0.7, first_wait_s=0.1), 1.0, True, sampler.epoch)
    last = [r for r in caplog.records if r.name == "s5loader.sampler"][-1]
    assert last.levelname == "WARNING" and "waited 60% of the epoch" in last.getMessage()


@pytest.mark.slow
def test_demo_does_not_warn_and_leaves_no_temp_files(short_tmp: Path) -> None:
    tmpdir = short_tmp
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
    env.update(TMPDIR=str(tmpdir), PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, str(ROOT / "bin" / "demo"), "--samples", "256"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "Done." in out and "epoch 3" in out
    assert "data starvation" not in out and "WARNING" not in out
    assert list(tmpdir.iterdir()) == []


def test_budget_below_one_batch_fails_at_once(moto: Store, staging_root: str) -> None:
    moto.put(make_pairs(12, size=1000))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    one = max(s.size for s in ds.samples)
    with pytest.raises(
        BudgetError, match=r"does not hold one batch: batch_size=4 .* raise it to at least"
    ) as exc:
        S5Sampler(ds, budget=one, staging_dir=staging_root, batch_size=4)
    assert moto.uri() in str(exc.value)
    with pytest.raises(ConfigError, match="batch_size"):
        S5Sampler(ds, staging_dir=staging_root, batch_size=0)
    # a budget of exactly one batch of the largest samples is enough, and loads everything
    with S5Sampler(ds, budget=4 * one, staging_dir=staging_root, batch_size=4) as sampler:
        assert sum(len(b["__key__"]) for b in DataLoader(ds, sampler=sampler, batch_size=4)) == 12


def _stage_manifest(uri: str, root: str, endpoint: str) -> None:
    """Stage one object a manifest names with its size (so nothing asks the store before the
    sampler's s5cmd does), through a DataLoader."""
    manifest = os.path.join(root, "m.jsonl")
    with open(manifest, "w") as f:
        f.write(json.dumps({"uri": uri, "size": 10, "etag": "0" * 32}) + "\n")
    ds = S5Dataset.from_manifest(manifest, endpoint_url=endpoint)
    with S5Sampler(ds, budget="1MB", staging_dir=os.path.join(root, "staging")) as sampler:
        list(DataLoader(ds, sampler=sampler, batch_size=1))


def _no_s5cmd_left() -> None:
    assert [p.name() for p in psutil.Process().children(recursive=True) if p.name() == "s5cmd"] == []


def test_missing_credentials_say_what_to_set_when_listing_and_staging(
    moto: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    moto.put(make_pairs(2))
    for var in [v for v in os.environ if v.startswith("AWS_")]:
        monkeypatch.delenv(var)
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.aws either
    with pytest.raises(AccessDeniedError) as listing:
        S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    with pytest.raises(AccessDeniedError) as staging:
        _stage_manifest(moto.uri("0000.image"), str(tmp_path), moto.endpoint)
    for exc, uri in ((listing.value, moto.uri()), (staging.value, moto.uri("0000.image"))):
        message = str(exc)
        assert uri in message and "no credentials were found" in message
        assert "AWS_ACCESS_KEY_ID" in message and "AWS_PROFILE" in message and "anonymous=True" in message
        assert "no valid providers in chain" not in message and "Deprecated" not in message
    _no_s5cmd_left()


def test_a_missing_bucket_names_the_bucket_and_the_endpoint_when_listing_and_staging(
    store: Store, tmp_path: Path
) -> None:
    with pytest.raises(NoSuchBucketError) as listing:
        S5Dataset.from_prefix("s3://no-such-bucket/train/", endpoint_url=store.endpoint)
    with pytest.raises(NoSuchBucketError) as staging:
        _stage_manifest("s3://no-such-bucket/train/0.bin", str(tmp_path), store.endpoint)
    for exc, uri in (
        (listing.value, "s3://no-such-bucket/train/"),
        (staging.value, "s3://no-such-bucket/train/0.bin"),
    ):
        message = str(exc)
        assert uri in message
        assert f"the store at {store.endpoint} has no bucket 'no-such-bucket'" in message
        assert "check the bucket's name" in message and "endpoint_url=" in message
        assert "request id" not in message and "host id" not in message
    _no_s5cmd_left()
