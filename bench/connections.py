#!/usr/bin/env python3
"""New TCP connections per S3 request at each setting of ``s5cmd_workers`` and
``calls_in_flight``, through the bench's 20 ms proxy (and its samples/s directly, on loopback):
the figures of docs/s5cmd-connections.md, each table row from saved runs.

Starts SeaweedFS (``s5loader.testing.SeaweedFS``) in a temporary folder, writes ``--samples``
image + label pairs of ``--sample-size`` with ``s5loader bench --generate``, then runs
``s5loader bench --methods s5loader s5loader-block --s5cmd-workers W --calls-in-flight C`` for
each ``W:C`` of ``--settings`` and each of ``--links`` (``proxy``: ``--delay-ms 20``; ``direct``),
the settings alternated ``--rounds`` times; each invocation's JSON is kept as
``OUT/SIZE-LINK-wW-cC-rK.json`` and ``OUT/connections-SIZE.md`` tabulates them (ranges over the
rounds).

    .venv/bin/python bench/connections.py [--sample-size 100KB] [--settings 256:2 32:4] \
        [--links proxy direct] [--out DIR]
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

from s5loader import StagingOptions
from s5loader.testing import SeaweedFS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BUCKET, PREFIX = "bench", "conns/"
METHODS = ("s5loader", "s5loader-block")
NAMES = {"s5loader": "`shuffle=True`", "s5loader-block": '`shuffle="block"`'}
LINKS = {"proxy": "20 ms proxy", "direct": "loopback"}


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


Runs = dict[tuple[str, str, int, int], list[tuple[str, dict[str, Any]]]]


def table(runs: Runs, size: str) -> str:
    """The markdown table of every (method, link, workers, calls) over its rounds, each row naming
    its files; connections are counted at the proxy, so a direct row has none."""
    lines = [
        f"Objects: a {size} `.image` and a 1-byte `.label` per sample.",
        "",
        "| method | link | `s5cmd_workers` | `calls_in_flight` | requests per sample "
        "| new connections per request | most open at once | samples/s | CPU s per 1,000 samples | runs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for (method, link, workers, calls), found in sorted(
        runs.items(), key=lambda kv: (kv[0][0], kv[0][1] != "proxy", -kv[0][2], kv[0][3])
    ):
        figs = [f for _, f in found]
        counted = link == "proxy"
        lines.append(
            f"| {NAMES[method]} | {LINKS[link]} | {workers} | {calls} "
            f"| {_span([f['requests_per_sample'] for f in figs], 1) if counted else '-'} "
            f"| {_span([f['connections_per_request'] for f in figs], 2) if counted else '-'} "
            f"| {_span([f['peak_open_connections'] for f in figs], 0) if counted else '-'} "
            f"| {_span([f['samples_per_s'] for f in figs], 0)} "
            f"| {_span([f['cpu_s_per_1k_samples'] for f in figs], 2)} "
            f"| {', '.join(name for name, _ in found)} |"
        )
    return "\n".join(lines) + "\n"


def _setting(text: str) -> tuple[int, int]:
    workers, _, calls = text.partition(":")
    try:
        return int(workers), int(calls or StagingOptions.calls_in_flight)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a setting is WORKERS:CALLS, such as 32:4, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--sample-size", default="100KB")
    p.add_argument(
        "--settings",
        type=_setting,
        nargs="+",
        default=[(256, 2), (32, 4)],
        help="s5cmd_workers:calls_in_flight pairs (default 256:2 32:4)",
    )
    p.add_argument("--links", nargs="+", choices=sorted(LINKS), default=["proxy", "direct"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=os.path.join(HERE, "results", "connections"))
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    runs: Runs = {}
    t0 = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="s5loader-conns-") as tmp,
        SeaweedFS(os.path.join(tmp, "weed"), (BUCKET,)) as weed,
    ):
        _bench(weed.endpoint, "--generate", str(args.samples), "--sample-size", args.sample_size)
        for k in range(1, args.rounds + 1):
            for link in args.links:
                for w, c in args.settings:
                    name = f"{args.sample_size}-{link}-w{w}-c{c}-r{k}.json"
                    path = os.path.join(args.out, name)
                    delay = ["--delay-ms", "20"] if link == "proxy" else []
                    _bench(
                        weed.endpoint,
                        *delay,
                        "--methods",
                        *METHODS,
                        "--s5cmd-workers",
                        str(w),
                        "--calls-in-flight",
                        str(c),
                        "--json",
                        path,
                    )
                    with open(path, encoding="utf-8") as f:
                        for fig in json.load(f)["results"]:
                            runs.setdefault((fig["method"], link, w, c), []).append((name, fig))
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
