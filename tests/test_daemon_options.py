"""The prefetch daemon takes the sampler's staging options, with the same names and checks.

A private module (``s5loader._daemon``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.stores import Store, make_pairs

from s5loader._daemon import PrefetchDaemon, build_parser, options_from_args


def test_staging_options_reach_the_engine(moto: Store, tmp_path: Path) -> None:
    moto.put(make_pairs(6, size=100))
    args = build_parser().parse_args(
        [
            moto.uri(),
            "--cache",
            str(tmp_path / "cache"),
            "--budget",
            "1MiB",
            "--endpoint-url",
            moto.endpoint,
            "--verify",
            "--retries",
            "0",
            "--stall-timeout",
            "7.5",
            "--samples-per-call",
            "2",
        ]
    )
    opts = options_from_args(args)
    assert (opts.staging.verify, opts.staging.retries, opts.staging.stall_timeout) == (True, 0, 7.5)
    with PrefetchDaemon(opts) as p:
        p.open()
        assert p._stream is not None
        engine = p._stream.run.options
        assert (engine.verify, engine.retries, engine.stall_timeout) == (True, 0, 7.5)
        summary = p.run()
    assert summary.delivered == 6  # verified against the listing: every file matches


@pytest.mark.parametrize("bad", [["--retries", "-1"], ["--stall-timeout", "0"]])
def test_bad_staging_option_is_a_usage_error(tmp_path: Path, bad: list[str]) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "s5loader",
            "prefetch",
            "s3://b/p/",
            "--cache",
            str(tmp_path / "c"),
            "--budget",
            "1MiB",
            *bad,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
    )
    assert r.returncode == 2, r.stderr
    assert bad[0] in r.stderr


def test_block_shuffle_delivers_the_samplers_order(moto: Store, tmp_path: Path, staging_root: str) -> None:
    from s5loader import S5Dataset, S5Sampler
    from s5loader._daemon.protocol import sample_folder_name

    moto.put({f"{d}/{i:02d}.bin": bytes([i]) * 10 for d in ("a", "b", "c") for i in range(4)})
    args = build_parser().parse_args(
        [
            moto.uri(),
            "--cache",
            str(tmp_path / "cache"),
            "--budget",
            "1MiB",
            "--endpoint-url",
            moto.endpoint,
            "--shuffle",
            "block",
            "--block-size",
            "2",
            "--seed",
            "3",
            "--samples-per-call",
            "4",
        ]
    )
    with PrefetchDaemon(options_from_args(args)) as p:
        p.open()
        assert p.run().delivered == 12
    delivered = sorted(n for n in os.listdir(tmp_path / "cache") if not n.startswith(".") and n != "END")
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    sampler = S5Sampler(
        ds, shuffle="block", block_size=2, seed=3, samples_per_call=4, staging_dir=staging_root
    )
    expected = [sample_folder_name(seq, ds.samples[i].key) for seq, i in enumerate(sampler._epoch_order(0))]
    assert delivered == expected
    assert expected != sorted(expected, key=lambda n: n.split("-", 1)[1])  # shuffled, not key order
