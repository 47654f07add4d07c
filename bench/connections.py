#!/usr/bin/env python3
"""New TCP connections per S3 request at each ``s5cmd_workers`` setting, through the bench's
20 ms proxy: the figures of docs/s5cmd-connections.md, each table row from a saved run.

Starts SeaweedFS (``s5loader.testing.SeaweedFS``) in a temporary folder, writes ``--samples``
image + label pairs of ``--sample-size`` with ``s5loader bench --generate``, then runs
``s5loader bench --delay-ms 20 --methods s5loader s5loader-block --s5cmd-workers W`` for each
W, the settings alternated ``--rounds`` times; each invocation's JSON is kept as
``OUT/SIZE-wW-rK.json`` and ``OUT/connections.md`` tabulates them (ranges over the rounds).

    .venv/bin/python bench/connections.py [--sample-size 100KB] [--workers 256 64 16] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from s5loader.testing import SeaweedFS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BUCKET, PREFIX = "bench", "conns/"
METHODS = ("s5loader", "s5loader-block")
NAMES = {"s5loader": "`shuffle=True`", "s5loader-block": '`shuffle="block"`'}


def _env() -> dict[str, str]:
    extra = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, HERE, *extra])}
    for var, value in (
        ("AWS_ACCESS_KEY_ID", "local"),
        ("AWS_SECRET_ACCESS_KEY", "local"),
        ("AWS_REGION", "us-east-1"),
    ):
        env.setdefault(var, value)
    return env


def _bench(endpoint: str, *args: str) -> None:
    argv = [
        sys.executable,
        "-m",
        "s5loader",
        "bench",
        f"s3://{BUCKET}/{PREFIX}",
        "--endpoint-url",
        endpoint,
        *args,
    ]
    r = subprocess.run(argv, env=_env(), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr[-3000:]}")


def _span(values: list[float], digits: int) -> str:
    lo, hi = min(values), max(values)
    return (
        f"{lo:.{digits}f}" if round(lo, digits) == round(hi, digits) else f"{lo:.{digits}f}-{hi:.{digits}f}"
    )


def table(runs: dict[tuple[str, int], list[tuple[str, dict[str, Any]]]], size: str) -> str:
    """The markdown table of every (method, workers) over its rounds, each row naming its files."""
    lines = [
        f"Objects: a {size} `.image` and a 1-byte `.label` per sample; through the 20 ms proxy.",
        "",
        "| method | `s5cmd_workers` | requests per sample | new connections per request | most open at once "
        "| samples/s | runs |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for (method, workers), found in sorted(runs.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        figs = [f for _, f in found]
        lines.append(
            f"| {NAMES[method]} | {workers} | {_span([f['requests_per_sample'] for f in figs], 1)} "
            f"| {_span([f['connections_per_request'] for f in figs], 2)} "
            f"| {_span([f['peak_open_connections'] for f in figs], 0)} "
            f"| {_span([f['samples_per_s'] for f in figs], 0)} | {', '.join(name for name, _ in found)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--sample-size", default="100KB")
    p.add_argument("--workers", type=int, nargs="+", default=[256, 64, 16])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=os.path.join(HERE, "results", "connections"))
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    runs: dict[tuple[str, int], list[tuple[str, dict[str, Any]]]] = {}
    t0 = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="s5loader-conns-") as tmp,
        SeaweedFS(os.path.join(tmp, "weed"), (BUCKET,)) as weed,
    ):
        _bench(weed.endpoint, "--generate", str(args.samples), "--sample-size", args.sample_size)
        for k in range(1, args.rounds + 1):
            for w in args.workers:
                name = f"{args.sample_size}-w{w}-r{k}.json"
                path = os.path.join(args.out, name)
                _bench(
                    weed.endpoint,
                    "--delay-ms",
                    "20",
                    "--methods",
                    *METHODS,
                    "--s5cmd-workers",
                    str(w),
                    "--json",
                    path,
                )
                with open(path, encoding="utf-8") as f:
                    for fig in json.load(f)["results"]:
                        runs.setdefault((fig["method"], w), []).append((name, fig))
                print(f"{name}: done ({time.monotonic() - t0:.0f}s)", flush=True)
    md = os.path.join(args.out, f"connections-{args.sample_size}.md")
    with open(md, "w", encoding="utf-8") as f:
        f.write(
            f"# New connections per request, {time.strftime('%Y-%m-%d')}\n\n{table(runs, args.sample_size)}"
        )
    print(open(md, encoding="utf-8").read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
