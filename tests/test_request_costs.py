"""What each line shape costs in S3 requests, counted at the benchmark's request-counting proxy
in front of SeaweedFS, against what the sampler's ``metrics()`` says it asked for: a sample of
two objects never costs a LIST, a block of 13 objects or more goes with one wildcard line (a
LIST and a GET per object, no HEAD), anything smaller with a ``cp --raw`` line per object (a
HEAD and a GET each, s5cmd 2.3.0's HEAD included)."""

from __future__ import annotations

import pytest
from support.stores import Store, make_pairs

from s5loader import S5Dataset, S5Sampler
from s5loader_bench.proxy import LatencyProxy


@pytest.fixture
def proxy(counting_proxy: LatencyProxy) -> LatencyProxy:
    return counting_proxy


def singles(n: int, size: int = 100) -> dict[str, bytes]:
    """One object per sample, 20 under each key prefix (``00-*``, ``01-*``, ...)."""
    return {f"{i // 20:02d}-{i % 20:02d}.image": bytes([i % 251]) * size for i in range(n)}


def counted_epoch(
    store: Store, proxy: LatencyProxy, staging_root: str, **sampler: object
) -> tuple[dict[str, float], dict[str, float], int]:
    """One epoch read through the proxy: the requests it counted per sample by kind, those the
    sampler's metrics() counted per sample, and the samples read."""
    ds = S5Dataset.from_prefix(store.uri(), endpoint_url=store.endpoint)  # listed directly: not counted
    ds.endpoint_url = proxy.endpoint  # the sampler's s5cmd calls go through the proxy
    before = dict(proxy.counts)
    with S5Sampler(ds, staging_dir=staging_root, **sampler) as s:  # type: ignore[arg-type]
        got = [ds[i] for i in s]
        m = s.metrics()
    n = len(got)
    assert n == len(ds) and len({g["__key__"] for g in got}) == n
    at_proxy = {k: (v - before.get(k, 0)) / n for k, v in proxy.counts.items()}
    asked = {
        "GET": m.get_requests / n,
        "HEAD": m.head_requests / n,
        "LIST": m.list_requests / n,
        "other": 0.0,
    }
    return at_proxy, asked, n


@pytest.mark.slow
def test_two_objects_per_sample_shuffled_cost_no_list(
    seaweed: Store, proxy: LatencyProxy, staging_root: str
) -> None:
    seaweed.put(make_pairs(60))
    at_proxy, asked, _ = counted_epoch(seaweed, proxy, staging_root, shuffle=True, block_size=10)
    # a cp --raw line per object: a HEAD and a GET each, and no LIST per sample
    assert at_proxy == asked == {"GET": 2.0, "HEAD": 2.0, "LIST": 0.0, "other": 0.0}


@pytest.mark.slow
def test_blocks_of_enough_objects_go_as_one_wildcard_line(
    seaweed: Store, proxy: LatencyProxy, staging_root: str
) -> None:
    seaweed.put(make_pairs(60))
    # blocks of 10 samples (20 objects), each whole in a call: a LIST per block, a GET per object
    at_proxy, asked, _ = counted_epoch(seaweed, proxy, staging_root, shuffle="block", block_size=10)
    assert at_proxy == asked == {"GET": 2.0, "HEAD": 0.0, "LIST": 0.1, "other": 0.0}


@pytest.mark.slow
@pytest.mark.parametrize(
    "block_size, per_sample",
    [
        (5, {"GET": 1.0, "HEAD": 1.0, "LIST": 0.0}),  # blocks of 10: their HEADs cost less than a LIST
        (20, {"GET": 1.0, "HEAD": 0.0, "LIST": 0.05}),  # 20 objects: one LIST costs less than 20 HEADs
        # tens too small to pay, within twice block_size: the prefix of 20 is one block
        (10, {"GET": 1.0, "HEAD": 0.0, "LIST": 0.05}),
    ],
)
def test_one_object_per_sample_takes_the_cheaper_line(
    seaweed: Store, proxy: LatencyProxy, staging_root: str, block_size: int, per_sample: dict[str, float]
) -> None:
    seaweed.put(singles(20))  # one call: its blocks are whole in it
    at_proxy, asked, _ = counted_epoch(seaweed, proxy, staging_root, shuffle="block", block_size=block_size)
    assert at_proxy == asked == {**per_sample, "other": 0.0}


@pytest.mark.slow
def test_the_daemons_block_order_costs_the_requests_of_the_samplers(
    seaweed: Store, proxy: LatencyProxy, staging_root: str, tmp_path
) -> None:
    from s5loader import consume
    from s5loader._daemon import PrefetchDaemon, PrefetchOptions

    seaweed.put(make_pairs(60))
    # calls of 8 samples, windows of more: each front end widens its calls to whole windows, so
    # that each block of 10 samples (20 objects) goes as one wildcard line
    sampler, _, n = counted_epoch(
        seaweed, proxy, staging_root, shuffle="block", block_size=10, samples_per_call=8
    )
    before = dict(proxy.counts)
    ds = S5Dataset.from_prefix(seaweed.uri(), endpoint_url=seaweed.endpoint)
    opts = PrefetchOptions.of(
        ds.source,
        str(tmp_path / "cache"),
        10**6,
        endpoint_url=proxy.endpoint,
        shuffle="block",
        block_size=10,
        samples_per_call=8,
    )
    with PrefetchDaemon(opts) as daemon:
        daemon.open()
        daemon.run()
    got = [s.name for s in consume(str(tmp_path / "cache"), timeout=30)]
    assert len(got) == n == 60
    counted = {k: v - before.get(k, 0) for k, v in proxy.counts.items()}
    counted["LIST"] -= 1  # the daemon lists its source through the proxy, once
    assert (
        {k: v / n for k, v in counted.items()}
        == sampler
        == {"GET": 2.0, "HEAD": 0.0, "LIST": 0.1, "other": 0.0}
    )
