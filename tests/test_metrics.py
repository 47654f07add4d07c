"""Live metrics: ``S5Sampler.metrics()`` and the daemon's ``--json-log`` give figures that match
a run whose numbers are known.

Private modules (``s5loader._daemon``, ``s5loader._engine``) are imported only where they are the
seam under test; the rest goes through the public API."""

from __future__ import annotations

import threading

from support.faults import FaultProxy, Rule
from support.stores import Store
from support.waits import wait_for

from s5loader import S5Dataset, S5Sampler
from s5loader._engine.counters import Metrics

SIZE = 1000  # bytes per sample: one object each


# -- the real path ----------------------------------------------------------------------------
def test_sampler_metrics_match_a_known_run(moto: Store, staging_root: str) -> None:
    """20 samples of 1000 bytes, a budget of 4: two corrupted once (retried once each under
    verify), two deleted after the listing (skipped), one request held at the proxy."""
    moto.put({f"{i:04d}.bin": bytes([i]) * SIZE for i in range(20)})
    proxy = FaultProxy(moto.endpoint)
    proxy.rules += [
        Rule("0006.bin", "corrupt", times=1),
        Rule("0007.bin", "corrupt", times=1),
        Rule("0019.bin", "hold", times=1),
    ]
    try:
        ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=proxy.endpoint)
        for i in (12, 13):
            moto.client.delete_object(Bucket="data", Key=f"train/{i:04d}.bin")
        budget = 4 * SIZE
        with S5Sampler(
            ds,
            staging_dir=staging_root,
            shuffle=False,
            budget=budget,
            on_error="skip",
            verify=True,
            retries=2,
            block_size=1,
        ) as sampler:
            m0 = sampler.metrics()
            assert (m0.position, m0.samples, m0.budget, m0.staged_bytes, m0.calls_in_flight) == (
                0,
                20,
                budget,
                0,
                0,
            )

            held: list[Metrics] = []

            def watch_held() -> None:  # from another thread, as a logger would
                if proxy.wait_held("0019.bin", 1, 30):
                    held.append(sampler.metrics())
                proxy.release.set()

            watcher = threading.Thread(target=watch_held)
            watcher.start()
            keys = []
            for n, idx in enumerate(sampler):
                m = sampler.metrics()
                assert m.staged_bytes <= m.budget == budget
                assert 0 <= m.ready_ahead <= 3  # the sample handed out holds the fourth slot
                if n == 0:
                    # the engine fills the budget ahead of the loader, then waits for a release
                    wait_for(
                        lambda: sampler.metrics().ready_ahead == 3 and sampler.metrics().calls_in_flight == 0,
                        what="the budget filled ahead of the loader",
                        interval=0.005,
                    )
                    m = sampler.metrics()
                    assert (m.position, m.staged_bytes, m.objects_in_flight, m.fetched_units) == (
                        1,
                        budget,
                        0,
                        4,
                    )
                    assert m.fetched_bytes == 4 * SIZE
                keys.append(ds[idx]["__key__"])
            watcher.join()
            end = sampler.metrics()
    finally:
        proxy.close()
    assert keys == [f"train/{i:04d}" for i in range(20) if i not in (12, 13)]
    assert len(held) == 1 and held[0].calls_in_flight >= 1 and held[0].objects_in_flight >= 1
    assert (end.position, end.samples, end.fetched_units, end.fetched_bytes) == (20, 20, 18, 18 * SIZE)
    assert (end.retries, end.skips, end.epoch) == (2, 2, 0)
    assert (end.ready_ahead, end.calls_in_flight, end.objects_in_flight) == (0, 0, 0)
    assert end.waited_s > 0 and end.samples_s > 0 and end.mb_s > 0


def test_daemon_json_log_carries_the_metrics(moto: Store, tmp_path) -> None:
    import json

    from s5loader._daemon import main

    moto.put({f"{i:04d}.bin": b"x" * SIZE for i in range(6)})
    log = tmp_path / "progress.jsonl"
    rc = main(
        [
            moto.uri(),
            "--cache",
            str(tmp_path / "cache"),
            "--budget",
            str(12 * SIZE),
            "--endpoint-url",
            moto.endpoint,
            "--json-log",
            str(log),
            "--no-progress",
            "--epochs",
            "2",
        ]
    )
    assert rc == 0
    events = [json.loads(line) for line in log.read_text().splitlines()]
    progress = [e for e in events if e["event"] == "progress"]
    assert progress and all(set(Metrics().as_dict()) <= set(e) for e in progress)
    done = events[-1]
    assert done["event"] == "done"
    assert (done["position"], done["samples"], done["fetched_units"], done["fetched_bytes"]) == (
        12,
        12,
        12,
        12 * SIZE,
    )
    assert (done["epoch"], done["budget"], done["skips"], done["retries"], done["calls_in_flight"]) == (
        1,
        12 * SIZE,
        0,
        0,
        0,
    )
    assert done["staged_bytes"] == 12 * SIZE  # nothing was consumed: the cache is full
