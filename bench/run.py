#!/usr/bin/env python3
"""The reproducible benchmark behind ``make bench``.

1. starts the embedded SeaweedFS (``bin/s3-local start``) in a temporary directory;
2. writes a toy data set to it with ``s5loader bench --generate`` (image + label pairs, and
   tar shards of them for webdataset);
3. runs ``s5loader bench`` with every installed method, directly on loopback and then through
   its request-counting latency proxy (``--delay-ms 20``, like a trip to a cloud store), which
   also counts each method's S3 requests (their price per million samples at S3 list prices)
   and TCP connections; ``--count-direct`` counts the direct run's too, through the same proxy
   at 0 ms;
4. times the first batch at batch 32 and 4 workers (``--first-batch``), directly and through
   the proxy, for s5loader's raw-object methods and their peers (first-direct, first-proxy);
5. writes a second data set of one object per sample (``--generate --no-label``) and counts
   the requests of every shuffle of s5loader and of s3torchconnector on it (single);
6. writes bench/results/latest.json (every run, settings, machine), latest.md (the tables, and
   the README's table made from them) and latest.png (the chart), plus each run's own
   ``LABEL.*``; stops the server.

    .venv/bin/python bench/run.py [--samples 3000] [--sample-size 100KB] [--delay-ms 20] ...
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = sys.executable


def child_env() -> dict[str, str]:
    """This environment, with s5loader and s5loader_bench importable from this checkout
    whether they are installed or not."""
    extra = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, HERE, *extra])}


# the runs, by label: the two whole runs, the first batch at batch 32 (direct and proxied), and
# the request count on one object per sample
RUNS = ("direct", "proxy", "first-direct", "first-proxy", "single")
FIRST_BATCH_METHODS = ["s5loader", "s5loader-block", "boto3", "s3torchconnector"]
FIRST_BATCH = {"batch_size": 32, "num_workers": 4}
SINGLE_METHODS = ["s5loader", "s5loader-block", "s5loader-sorted", "s3torchconnector"]

# the README's names for the methods, in its order
README_METHODS = {
    "s5loader": "s5loader",
    "s5loader-block": 's5loader, `shuffle="block"`',
    "s5loader-sorted": "s5loader, `shuffle=False`",
    "boto3": "boto3",
    "s5cmd-run": "s5cmd-run",
    "s5cmd-bulk": "s5cmd-bulk",
    "s3torchconnector": "s3torchconnector",
    "webdataset": "webdataset (shards)",
    "s5loader-shards": "s5loader, shards",
    "s5loader-iterable": "S5IterableDataset, shards",
}


def _installed(methods: list[str], asked: list[str] | None) -> list[str]:
    """``methods`` less those ``--methods`` leaves out (all of them when it names none)."""
    return [m for m in methods if not asked or m in asked] or methods


def generate(endpoint: str, source: str, args: argparse.Namespace, extra: list[str]) -> None:
    """Write the toy data set under ``source`` with ``s5loader bench --generate``."""
    t = time.monotonic()
    gen = subprocess.run(
        [
            PY,
            "-m",
            "s5loader",
            "bench",
            "--generate",
            str(args.samples),
            source,
            "--endpoint-url",
            endpoint,
            "--sample-size",
            args.sample_size,
            "--shard-samples",
            str(args.shard_samples),
            *extra,
        ],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
        env=child_env(),
    )
    if gen.returncode != 0:
        raise RuntimeError(
            f"generating the data set {source} failed with exit code {gen.returncode} (see above)"
        )
    print(gen.stdout.strip(), f"({time.monotonic() - t:.0f}s)", flush=True)


def check_run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run ``argv``; on a non-zero exit raise with the command, the code and stderr's tail."""
    proc = subprocess.run(argv, text=True, capture_output=True, check=False, env=child_env(), **kw)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} exited with code {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def bench(
    label: str,
    endpoint: str,
    source: str,
    out: str,
    args: argparse.Namespace,
    extra: list[str],
    methods: list[str] | None = None,
    batch_size: int | None = None,
    num_workers: int | None = None,
    repeat: int | None = None,
) -> dict[str, Any]:
    """One ``s5loader bench`` run with ``extra`` arguments (and ``methods``, ``batch_size``,
    ``num_workers``, ``repeat`` instead of the command line's); its output is echoed, its JSON
    returned."""
    argv = [
        PY,
        "-m",
        "s5loader",
        "bench",
        source,
        "--endpoint-url",
        endpoint,
        *extra,
        "--batch-size",
        str(batch_size or args.batch_size),
        "--num-workers",
        str(args.num_workers if num_workers is None else num_workers),
        "--samples-per-call",
        str(args.samples_per_call),
        "--repeat",
        str(repeat or args.repeat),
        "--json",
        os.path.join(out, f"{label}.json"),
        "--markdown",
        os.path.join(out, f"{label}.md"),
    ]
    methods = methods or args.methods
    if methods:
        argv += ["--methods", *methods]
    if args.steps and "--first-batch" not in extra:
        argv += ["--steps", str(args.steps)]
    if args.shard_shuffle != "block":
        argv += ["--shard-shuffle", args.shard_shuffle]
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", os.path.join(out, f"{label}.png")]
    except ImportError:
        print("matplotlib is not installed: no charts (pip install matplotlib)", file=sys.stderr)
    print(f"\n== {label}: {shlex.join(argv)}", flush=True)
    t0 = time.monotonic()
    with open(os.path.join(out, f"{label}.log"), "w") as log:
        proc = subprocess.run(
            argv, stdout=subprocess.PIPE, stderr=log, text=True, check=False, env=child_env()
        )
    print(proc.stdout, end="", flush=True)
    if proc.returncode not in (0, 1):  # 1: a method failed, reported in the table
        tail = open(os.path.join(out, f"{label}.log")).read()[-3000:]
        raise RuntimeError(f"{shlex.join(argv)} exited with code {proc.returncode}:\n{tail}")
    print(
        f"== {label} took {time.monotonic() - t0:.0f}s (log: {os.path.relpath(out, ROOT)}/{label}.log)",
        flush=True,
    )
    with open(os.path.join(out, f"{label}.json")) as f:
        return json.load(f)


def combined_chart(path: str, runs: dict[str, dict[str, Any]], delay_ms: float = 20.0) -> None:
    """latest.png: samples/s and CPU per 1,000 samples per method, direct and proxied side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    legend = {"direct": "direct (loopback)", "proxy": f"through the {delay_ms:g} ms proxy"}
    methods: list[str] = []
    for doc in runs.values():
        for r in doc["results"]:
            if r["status"] == "ok" and r["method"] not in methods:
                methods.append(r["method"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(runs), 1)
    for k, (label, doc) in enumerate(runs.items()):
        by = {r["method"]: r for r in doc["results"] if r["status"] == "ok"}
        xs = [i + (k - (len(runs) - 1) / 2) * width for i in range(len(methods))]
        for ax, key in zip(axes, ("samples_per_s", "cpu_s_per_1k_samples"), strict=True):
            ax.bar(
                xs,
                [by[m][key] if m in by and by[m][key] is not None else 0 for m in methods],
                width,
                label=legend.get(label, label),
            )
    axes[0].set_ylabel("samples/s (higher is better)")
    axes[1].set_ylabel("CPU s per 1,000 samples (lower is better)")
    axes[1].set_title("CPU of the whole process tree (s5cmd, workers included)", fontsize=9)
    axes[0].set_title("throughput", fontsize=9)
    for ax in axes:
        ax.set_xticks(range(len(methods)), methods, rotation=30)
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    any_doc = next(iter(runs.values()))
    m, s = any_doc["machine"], any_doc["settings"]
    fig.suptitle(
        f"s5loader bench: batch {s['batch_size']}, {s['num_workers']} workers; {m['logical_cpus']} CPUs "
        f"({m['cpu_model']}), local SeaweedFS",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


SHARD_SHUFFLE_WORDS = {
    "none": "none (webdataset in shard order, s5loader `shuffle=False`)",
    "block": 'webdataset in shard order, s5loader `shuffle="block"`',
    "full": "webdataset `shardshuffle` + `shuffle(1000)`, s5loader `shuffle=True`",
}


def markdown(
    runs: dict[str, dict[str, Any]], info: dict[str, Any], extra: dict[str, dict[str, Any]] | None = None
) -> str:
    extra = extra or {}
    any_doc = next(iter({**runs, **extra}.values()))
    m, s = any_doc["machine"], any_doc["settings"]
    lines = [
        f"# s5loader bench, {any_doc['started']}",
        "",
        f"Data: {info['samples']} samples (a {info['sample_size']} `.image` of random bytes + a small "
        f"`.label` each) in a local SeaweedFS; batch size {s['batch_size']}, {s['num_workers']} DataLoader "
        f"workers, samples_per_call {s['samples_per_call']}, calls_in_flight "
        f"{s.get('calls_in_flight', s.get('buffers'))}, "
        + (f"{s['steps']} steps per method" if s.get("steps") else "one pass over the data set per method")
        + f"; shard methods' shuffle: {SHARD_SHUFFLE_WORDS[s.get('shard_shuffle', 'block')]}"
        + f"; the method list was run {s.get('repeat', 1)} times, interleaved, and each row is the "
        "repeat with the median samples/s (all repeats' samples/s are in the note and in latest.json).",
        f"Machine: {m['logical_cpus']} logical CPUs ({m['cpu_model']}), {m['memory_gb']} GB, {m['os']}, "
        f"Python {m['python']}; versions {json.dumps(m['versions'])}.",
        f"Total time of `make bench`: {info['elapsed_s']:.0f}s.",
        "CPU per 1,000 samples is split into s5cmd, the training process (main) and the DataLoader workers; "
        "S3 requests are counted by the proxy that adds the latency"
        + (
            ", and by the same proxy at 0 ms for the direct run."
            if info.get("count_direct")
            else " (the direct run goes straight to the server: no counts)."
        ),
    ]
    first = f"batch {FIRST_BATCH['batch_size']}, {FIRST_BATCH['num_workers']} workers"
    titles = {
        "direct": "Direct (loopback)",
        "proxy": f"Through the latency proxy ({info['delay_ms']:g} ms per request)",
        "first-direct": f"The first batch ({first}), direct",
        "first-proxy": f"The first batch ({first}), through the {info['delay_ms']:g} ms proxy",
        "single": "One object per sample (`NNNNNN.image` alone), requests counted at the proxy at 0 ms",
    }
    for label in [*runs, *extra]:
        table = open(os.path.join(info["out"], f"{label}.md")).read().strip()
        lines += ["", f"## {titles.get(label, label)}", "", table]
    if runs:
        lines += ["", "![samples/s and CPU per method](latest.png)", ""]
    lines += [
        "## The README's table",
        "",
        '(`README.md`, "The benchmark": paste it there with the run\'s date.)',
        "",
        readme_table(runs, info["delay_ms"], extra),
        "",
    ]
    return "\n".join(lines)


def _cell(r: dict[str, Any] | None, fmt: Any) -> str:
    if r is None or r.get("status") != "ok":
        return "-"
    try:
        return str(fmt(r))
    except (KeyError, TypeError):
        return "-"


def readme_table(
    runs: dict[str, dict[str, Any]], delay_ms: float, extra: dict[str, dict[str, Any]] | None = None
) -> str:
    """The README's summary table: samples/s through the proxy and direct, CPU per 1,000
    samples and its split (s5cmd / training process / workers), the time to the first batch
    (at the run's batch, and at batch 32 with 4 workers), S3 requests per sample, their price
    per million samples (image + label, and one object per sample), and TCP connections."""
    by = {label: {r["method"]: r for r in doc["results"]} for label, doc in {**runs, **(extra or {})}.items()}
    methods = [m for m in README_METHODS if any(m in b for b in by.values())]
    rows = [["samples/s"] + [README_METHODS[m] for m in methods]]
    if "proxy" in by:
        rows.append(
            [f"through the {delay_ms:g} ms proxy"]
            + [_cell(by["proxy"].get(m), lambda r: f"{r['samples_per_s']:.0f}") for m in methods]
        )
    if "direct" in by:
        d = by["direct"]
        rows.append(
            ["direct (loopback)"] + [_cell(d.get(m), lambda r: f"{r['samples_per_s']:.0f}") for m in methods]
        )
        rows.append(
            ["CPU s / 1,000 samples, direct"]
            + [_cell(d.get(m), lambda r: f"{r['cpu_s_per_1k_samples']:.2f}") for m in methods]
        )
        rows.append(
            ["of which s5cmd / training process / workers"]
            + [
                _cell(
                    d.get(m),
                    lambda r: " / ".join(
                        f"{r['cpu_split_s_per_1k_samples'][k]:.2f}" for k in ("s5cmd", "main", "workers")
                    ),
                )
                for m in methods
            ]
        )
    for label in ("proxy", "direct"):
        if any(r.get("first_batch_s") is not None for r in by.get(label, {}).values()):
            rows.append(
                [f"first batch, s ({'direct' if label == 'direct' else 'proxy'} run)"]
                + [_cell(by[label].get(m), lambda r: f"{r['first_batch_s']:.2f}") for m in methods]
            )
    if "first-direct" in by or "first-proxy" in by:
        fd, fp = by.get("first-direct", {}), by.get("first-proxy", {})

        def first(m: str) -> str:
            cells = [_cell(b.get(m), lambda r: f"{r['first_batch_s']:.2f}") for b in (fd, fp)]
            return "-" if cells == ["-", "-"] else " / ".join(cells)

        rows.append(
            [
                f"first batch, s, batch {FIRST_BATCH['batch_size']} and {FIRST_BATCH['num_workers']} "
                f"workers: direct / {delay_ms:g} ms proxy"
            ]
            + [first(m) for m in methods]
        )
    if "direct" in by and any(r.get("blocks_per_256") is not None for r in by["direct"].values()):
        rows.append(
            ["shuffle: distinct blocks per 256 samples"]
            + [_cell(by["direct"].get(m), lambda r: f"{r['blocks_per_256']:.0f}") for m in methods]
        )
    for label in ("direct", "proxy"):
        counted = by.get(label, {})
        if any(r.get("requests") for r in counted.values()):
            rows.append(
                [
                    f"S3 requests per sample ({'direct' if label == 'direct' else 'proxy'} run): "
                    "all (GET / HEAD / LIST)"
                ]
                + [
                    _cell(
                        counted.get(m),
                        lambda r: (
                            f"{r['requests_per_sample']:.2f} ("
                            + " / ".join(
                                f"{r['requests_per_sample_by_kind'].get(k, 0):.2f}"
                                for k in ("GET", "HEAD", "LIST")
                            )
                            + ")"
                        ),
                    )
                    for m in methods
                ]
            )
    dollars = [
        (label, what)
        for label, what in (("proxy", "image + label, proxy run"), ("single", "one object per sample"))
        if any(r.get("dollars_per_million_samples") is not None for r in by.get(label, {}).values())
    ]
    for label, what in dollars:
        rows.append(
            [f"$ per million samples at S3 list prices ({what})"]
            + [_cell(by[label].get(m), lambda r: f"{r['dollars_per_million_samples']:.2f}") for m in methods]
        )
    if any(r.get("connections_per_request") is not None for r in by.get("proxy", {}).values()):
        rows.append(
            ["new TCP connections per request / most open at once (proxy run)"]
            + [
                _cell(
                    by["proxy"].get(m),
                    lambda r: f"{r['connections_per_request']:.3f} / {r['peak_open_connections']}",
                )
                for m in methods
            ]
        )
    lines = ["| " + " | ".join(rows[0]) + " |", "|---|" + "---:|" * len(methods)]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    """The arguments of ``run.py``."""
    p = argparse.ArgumentParser(prog="bench/run.py", description="Run the reproducible s5loader benchmark.")
    p.add_argument("--samples", type=int, default=2000, help="samples in the toy data set (default 2000)")
    p.add_argument("--sample-size", default="100KB", help="bytes of each .image (default 100KB)")
    p.add_argument("--shard-samples", type=int, default=100, help="samples per tar shard (default 100)")
    p.add_argument(
        "--shard-shuffle",
        choices=["none", "block", "full"],
        default="block",
        help="the shuffle of the shard methods (see s5loader bench --shard-shuffle; default block)",
    )
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--samples-per-call", type=int, default=1000)
    p.add_argument("--steps", type=int, default=None, help="steps per method (default: one pass)")
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="run the method list this many times, interleaved; the median is reported (default 3)",
    )
    p.add_argument("--methods", nargs="+", help="default: all installed")
    p.add_argument(
        "--delay-ms", type=float, default=20.0, help="latency the proxy adds per request (default 20)"
    )
    p.add_argument(
        "--count-direct",
        action="store_true",
        help="count the direct run's requests too, through the proxy at 0 ms (it shares the CPU)",
    )
    p.add_argument(
        "--only", nargs="+", choices=RUNS, help=f"run only these of the runs ({', '.join(RUNS)}; default all)"
    )
    p.add_argument(
        "--first-batch-repeat",
        type=int,
        default=5,
        help="repeats of the first-batch runs (default 5; each is one batch per method)",
    )
    p.add_argument(
        "--out", default=os.path.join(HERE, "results"), help="results folder (default bench/results)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    t0 = time.monotonic()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    # The local server accepts any credentials; the clients only need some.
    for k, v in (
        ("AWS_ACCESS_KEY_ID", "bench"),
        ("AWS_SECRET_ACCESS_KEY", "bench"),
        ("AWS_REGION", "us-east-1"),
    ):
        os.environ.setdefault(k, v)
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "S3_ENDPOINT_URL", "AWS_PROFILE"):
        os.environ.pop(var, None)
    source = "s3://bench/train/"
    runs: dict[str, dict[str, Any]] = {}  # the whole runs: direct, proxy
    extra: dict[str, dict[str, Any]] = {}  # first-direct, first-proxy, single
    with tempfile.TemporaryDirectory(prefix="s5loader-bench-") as tmp:
        s3dir = os.path.join(tmp, "s3")
        check_run([PY, os.path.join(ROOT, "bin", "s3-local"), "start", "--dir", s3dir, "--bucket", "bench"])
        with open(os.path.join(s3dir, "endpoint")) as f:
            endpoint = f.read().strip()
        try:
            print(f"SeaweedFS serves S3 at {endpoint}", flush=True)
            generate(endpoint, source, args, [])
            only = set(args.only or RUNS)
            delay = ["--delay-ms", f"{args.delay_ms:g}"]
            if "direct" in only:
                runs["direct"] = bench(
                    "direct", endpoint, source, out, args, ["--count-requests"] if args.count_direct else []
                )
            if "proxy" in only:
                runs["proxy"] = bench("proxy", endpoint, source, out, args, delay)
            for label, how in (("first-direct", []), ("first-proxy", delay)):
                if label in only:
                    extra[label] = bench(
                        label,
                        endpoint,
                        source,
                        out,
                        args,
                        ["--first-batch", *how],
                        methods=_installed(FIRST_BATCH_METHODS, args.methods),
                        repeat=args.first_batch_repeat,
                        **FIRST_BATCH,
                    )
            if "single" in only:
                single = "s3://bench/single/"
                generate(
                    endpoint, single, args, ["--no-label", "--shards-prefix", "s3://bench/single-shards/"]
                )
                extra["single"] = bench(
                    "single",
                    endpoint,
                    single,
                    out,
                    args,
                    ["--count-requests"],
                    methods=_installed(SINGLE_METHODS, args.methods),
                    repeat=1,
                )
        finally:
            subprocess.run([PY, os.path.join(ROOT, "bin", "s3-local"), "stop", "--dir", s3dir], check=False)
    elapsed = time.monotonic() - t0
    info = {
        "samples": args.samples,
        "sample_size": args.sample_size,
        "delay_ms": args.delay_ms,
        "count_direct": args.count_direct,
        "elapsed_s": elapsed,
        "out": out,
    }
    with open(os.path.join(out, "latest.json"), "w") as f:
        json.dump(
            {"bench": {k: v for k, v in info.items() if k != "out"}, "runs": {**runs, **extra}}, f, indent=2
        )
    with open(os.path.join(out, "latest.md"), "w") as f:
        f.write(markdown(runs, info, extra))
    try:
        if runs:
            combined_chart(os.path.join(out, "latest.png"), runs, args.delay_ms)
    except ImportError:
        print("matplotlib is not installed: no latest.png (pip install matplotlib)", file=sys.stderr)
    print(
        f"\nresults: {os.path.relpath(out, ROOT)}/latest.{{json,md,png}}; the benchmark took {elapsed:.0f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
