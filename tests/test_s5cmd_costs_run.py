"""``bench/s5cmd_costs.py``, a short real run against SeaweedFS through the request-counting
proxy: a ``cp --raw`` line costs a HEAD and a GET, a wildcard line a LIST and one GET per
object. No timing assertions."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import s5cmd_costs as costs  # bench/ is on the path (pyproject.toml)


@pytest.mark.slow
def test_real_run_counts_the_head_of_each_raw_line(seaweed_server: str, tmp_path: Path) -> None:
    source = f"s3://data/costs-{uuid.uuid4().hex[:8]}/"
    out_json, out_md = str(tmp_path / "c.json"), str(tmp_path / "c.md")
    rc = costs.main(
        [
            "--endpoint-url",
            seaweed_server,
            "--upload",
            "--source",
            source,
            "--objects",
            "20",
            "--size",
            "2KB",
            "--repeat",
            "2",
            "--gogc",
            "100,off:256MiB",
            "--gomaxprocs",
            "default",
            "--numworkers",
            "8",
            "--base",
            "numworkers=8",
            "--shapes",
            "raw,block10,prefix,head,presign",
            "--work-dir",
            str(tmp_path),
            "--json",
            out_json,
            "--markdown",
            out_md,
        ]
    )
    assert rc == 0
    with open(out_json) as f:
        doc = json.load(f)
    req = doc["requests"]
    # s5cmd v2.3 Stats (HEAD) every object of a non-wildcard cp line before its GET
    assert req["raw"]["GET"] == 20 and req["raw"]["HEAD"] == 20 and req["raw"]["LIST"] == 0
    # a wildcard line lists, then GETs each object it found: no HEAD
    assert req["block10"]["GET"] == 20 and req["block10"]["HEAD"] == 0 and req["block10"]["LIST"] == 2
    assert req["prefix"]["GET"] == 20 and req["prefix"]["HEAD"] == 0 and req["prefix"]["LIST"] == 1
    # the probes: a head line is one HEAD, a presign line no request at all
    assert req["head"]["HEAD"] == 20 and req["head"]["GET"] == 0
    assert sum(v for k, v in req["presign"].items() if k != "lines") == 0
    labels = [r["setting"] for r in doc["summary"]]
    assert labels[0] == "GOGC=default GOMAXPROCS=default numworkers=8"
    assert "GOGC=off GOMEMLIMIT=256MiB GOMAXPROCS=default numworkers=8" in labels
    assert len(doc["runs"]) == 2 * 2 * 5
    for r in doc["summary"]:
        assert r["repeats"] == 2 and r["cpu_s"] > 0
        # s5cmd's own peak, not this (much larger) Python's, which a fork would carry over
        assert 0 < r["maxrss_mib_max"] < 200
    with open(out_md) as f:
        assert "### S3 requests per object" in f.read()
