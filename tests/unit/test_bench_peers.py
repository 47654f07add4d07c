"""``bench/peers.py`` and ``bench/peer_loop.py`` without a server: the check every loader's
samples go through (bytes and once an epoch), the key numbers of each loader's names, and the
table the README and docs/bench.md quote."""

from __future__ import annotations

import peer_loop
import peers
import pytest


def test_the_check_refuses_a_repeat_and_other_bytes_and_reads_every_loaders_key() -> None:
    check = peer_loop.Checker(100)
    check.add("raw/000001.bin", peer_loop.sample_bytes(1, 100))  # s5loader's and litdata's keys
    check.add("s3://data/raw/000002.bin", peer_loop.sample_bytes(2, 100))  # StreamingRawDataset's
    check.add("000000", peer_loop.sample_bytes(0, 100))  # a tar shard's
    assert check.seen == {0, 1, 2} and check.bytes == 300
    with pytest.raises(RuntimeError, match="came twice"):
        check.add("raw/000001.bin", peer_loop.sample_bytes(1, 100))
    with pytest.raises(RuntimeError, match="other bytes"):
        peer_loop.Checker(100).add("raw/000001.bin", peer_loop.sample_bytes(2, 100))
    assert peer_loop.sample_bytes(1, 100) != peer_loop.sample_bytes(2, 100)


def test_the_table_shows_both_links_the_cpu_split_and_a_failed_run() -> None:
    def epoch(e: int, rate: float) -> dict[str, float]:
        return {
            "epoch": e,
            "samples": 3000,
            "samples_per_s": rate,
            "first_batch_s": 0.5,
            "cpu_main_s": 0.3,
            "cpu_children_s": 1.2,
        }

    result = {
        "links": {
            "direct": {"s5loader-shards": [epoch(1, 2000), epoch(2, 5000)], "litdata-shards": "failed: x"},
            "proxy": {"s5loader-shards": [epoch(1, 1500), epoch(2, 4900)], "litdata-shards": "not run: z"},
        },
        "conversion_s": {"s5loader pack": 7.5, "litdata optimize": "not run: no --peers-python"},
    }
    text = peers.table(result)
    row = next(line for line in text.splitlines() if "S5Sampler" in line)
    assert "| 2000 \\| 1500 | 5000 \\| 4900 | 0.50 (0.10 + 0.40) | 0.50 (0.10 + 0.40) |" in row
    row = next(line for line in text.splitlines() if "its chunks" in line)
    assert row.count("failed \\| not run") == 3 and row.endswith("| - | - | failed \\| not run |"), row
    assert "s5loader pack 7.5" in text and "litdata optimize: not run" in text
    assert "MosaicML" not in text  # not run on either link: no row
    assert peers.parse_size("8MB") == 8_000_000 and peers.parse_size("1GiB") == 1 << 30
