"""Which object failed, and why: each object gets its own error line's cause, and one request
that never answers is found and retried alone while the rest of its call is delivered.

A private module (``s5loader._s5cmd``) is imported only where it is the seam under test; the rest
goes through the public API."""

from __future__ import annotations

import logging
import os
import re
import threading

import pytest
from support.faults import FaultProxy, Rule
from support.stores import Store, make_pairs
from support.waits import wait_for

from s5loader import AccessDeniedError, FetchError, ObjectNotFoundError, S5Dataset, S5Sampler, StallError


@pytest.fixture
def proxy(moto: Store):
    p = FaultProxy(moto.endpoint)
    yield p
    p.close()


def _mixed(moto: Store, proxy: FaultProxy) -> S5Dataset:
    """Twelve stem pairs, all in the first call (32 samples): a 403, a 500 on every attempt
    (not a 503 SlowDown, which s5cmd backs off from for seconds), an object deleted after the
    listing, and successes."""
    moto.put(make_pairs(12, size=200))
    proxy.rules += [Rule("0002.image", "403", method="*"), Rule("0005.label", "500", method="*")]
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=proxy.endpoint)
    moto.client.delete_object(Bucket="data", Key="train/0008.image")
    return ds


@pytest.mark.parametrize("block_size", [64, 1], ids=["wildcard-lines", "raw-lines"])
def test_mixed_failures_in_one_call_each_get_their_own_cause(
    moto: Store, proxy: FaultProxy, staging_root: str, caplog, block_size: int
) -> None:
    ds = _mixed(moto, proxy)
    opts = {
        "staging_dir": staging_root,
        "shuffle": False,
        "samples_per_call": 1000,
        "retries": 1,
        "block_size": block_size,
    }
    with pytest.raises(AccessDeniedError, match=r"s3://data/train/0002\.image: AccessDenied") as e:
        with S5Sampler(ds, **opts) as sampler:
            for idx in sampler:
                ds[idx]
    assert "InternalError" not in str(e.value) and "NoSuchKey" not in str(e.value)

    caplog.set_level(logging.WARNING, logger="s5loader")
    proxy.rules[0].hits = 0
    with S5Sampler(ds, on_error="skip", **opts) as sampler:
        got = [ds[idx]["__key__"] for idx in sampler]
        stats = sampler.stats
        assert stats is not None
    assert got == [f"train/{i:04d}" for i in range(12) if i not in (2, 5, 8)]
    denied, slow, gone = (
        "s3://data/train/0002.image",
        "s3://data/train/0005.label",
        "s3://data/train/0008.image",
    )
    assert sorted(stats.skipped) == [denied, slow, gone]
    errors = stats.skip_errors
    assert type(errors[denied]) is AccessDeniedError and "AccessDenied" in str(errors[denied])
    assert type(errors[slow]) is FetchError and "failed after 1 retries: InternalError" in str(errors[slow])
    assert type(errors[gone]) is ObjectNotFoundError and "404" in str(errors[gone])
    causes = {denied: "AccessDenied", slow: "InternalError", gone: "NoSuchKey"}
    for uri, cause in causes.items():
        lines = [
            r.getMessage()
            for r in caplog.records
            if r.getMessage().startswith("skipping sample") and uri in r.getMessage()
        ]
        assert len(lines) == 1, (uri, lines)
        assert cause in lines[0] and not any(c in lines[0] for c in causes.values() if c != cause), lines[0]
    retried = [r.getMessage() for r in caplog.records if r.getMessage().startswith("retrying")]
    assert retried and all(denied not in m for m in retried), retried
    assert all("InternalError" not in m.split(gone)[1].split(";")[0] for m in retried if gone in m), retried
    # the 403 was never retried: its own error was known at once, not another object's 500
    assert proxy.rules[0].hits == (1 if block_size > 1 else 2)  # a cp --raw line sends a HEAD first


def test_object_without_an_error_line_never_gets_another_objects_error(
    moto: Store, proxy: FaultProxy, staging_root: str, caplog
) -> None:
    # One wildcard line: the 403 has an error line of its own; the object deleted after the
    # listing has none (the wildcard no longer matches it). It must not be skipped as a 403.
    moto.put(make_pairs(6, size=100))
    proxy.rules.append(Rule("0001.image", "403", method="*"))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=proxy.endpoint)
    moto.client.delete_object(Bucket="data", Key="train/0004.label")
    caplog.set_level(logging.WARNING, logger="s5loader")
    with S5Sampler(ds, staging_dir=staging_root, shuffle=False, on_error="skip", retries=1) as sampler:
        got = [ds[idx]["__key__"] for idx in sampler]
        stats = sampler.stats
        assert stats is not None
    assert got == ["train/0000", "train/0002", "train/0003", "train/0005"]
    gone = "s3://data/train/0004.label"
    assert sorted(stats.skipped) == ["s3://data/train/0001.image", gone]
    [line] = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith(f"skipping sample 'train/0004': cannot stage {gone}")
    ]
    assert "NoSuchKey" in line and "AccessDenied" not in line, line
    assert type(stats.skip_errors[gone]) is ObjectNotFoundError, stats.skip_errors[gone]
    assert "AccessDenied" not in str(stats.skip_errors[gone])


@pytest.mark.parametrize("block_size", [64, 1], ids=["wildcard-lines", "raw-lines"])
def test_one_hung_request_among_many_is_retried_alone(
    moto: Store, proxy: FaultProxy, staging_root: str, caplog, block_size: int
) -> None:
    objects = {f"{i:04d}.bin": bytes([i]) * 300 for i in range(60)}
    objects["0001.bin"] = os.urandom(100_000)
    source = moto.put(objects)
    hung = Rule("0000.bin", "hold", method="*")  # never answers until released
    slow = Rule("0001.bin", "trickle")  # keeps its call reading bytes, so the call itself never stalls
    proxy.rules += [hung, slow]
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=proxy.endpoint, group_by="object")
    caplog.set_level(logging.WARNING, logger="s5loader")
    got: dict[str, bytes] = {}
    failed: list[BaseException] = []
    with S5Sampler(
        ds,
        staging_dir=staging_root,
        shuffle=False,
        samples_per_call=1000,
        stall_timeout=5,  # a copy slowed by a loaded machine is no hung one
        retries=5,
        block_size=block_size,
        budget="64MiB",
    ) as sampler:

        def consume() -> None:
            try:
                for idx in sampler:
                    s = ds[idx]
                    got[s["__key__"]] = s["data"]
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                failed.append(exc)

        consumer = threading.Thread(target=consume)
        consumer.start()
        try:
            # A second request for the hung object: it was staged again in a new call ...
            assert proxy.wait_held("0000.bin", 2, timeout=30), proxy.held
            # ... while its first call still runs (the trickled object is on its first GET) ...
            assert slow.hits == 1
            assert any(
                "no answer for 5s for s3://data/train/0000.bin" in r.getMessage() for r in caplog.records
            )
            # ... and delivers every other sample of it meanwhile.
            stats = sampler.stats
            assert stats is not None
            wait_for(lambda: stats.staged_units == 58, 30, "the other 58 samples staged")
            assert slow.hits == 1 and not got  # the consumer still waits for the first sample
        finally:
            proxy.release.set()
            consumer.join(60)
        assert not failed, failed
        assert stats.staged_units == 60 and stats.stalls >= 1 and 1 <= stats.retries <= 5
        # the given-up copy stayed on the budget while it could still land in its old call
        hung_size = len(source["train/0000.bin"])
        assert ds.total_bytes + hung_size <= stats.peak_reserved <= ds.total_bytes + stats.retries * hung_size
        assert not [r for r in caplog.records if "not in the listing" in r.getMessage()]
    assert got == source  # every sample once, with its own bytes (the late answer changed nothing)


def test_hung_request_never_released_is_a_stall_error_naming_it(
    moto: Store, proxy: FaultProxy, staging_root: str
) -> None:
    moto.put({f"{i:04d}.bin": b"x" * 100 for i in range(10)})
    proxy.rules.append(Rule("0003.bin", "hold", method="*"))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=proxy.endpoint, group_by="object")
    got = []
    with pytest.raises(
        StallError,
        match=rf"staging from {re.escape(proxy.endpoint)} made no progress for 1s, 1 times; "
        r"gave up on 1 object\(s\): s3://data/train/0003\.bin; "
        r"the store accepted the requests but sent no data",
    ):
        with S5Sampler(ds, staging_dir=staging_root, shuffle=False, stall_timeout=1, retries=1) as sampler:
            for idx in sampler:
                got.append(ds[idx]["__key__"])
    assert got == ["train/0000.bin", "train/0001.bin", "train/0002.bin"]
