#!/usr/bin/env python3
"""s5loader beside litdata and MosaicML streaming, on the same data, in one run.

1. starts SeaweedFS and writes ``--samples`` objects of ``--size`` bytes (``raw/NNNNNN.bin``);
2. converts them, timed: ``s5loader.pack`` into tar shards (``s5shards/``), litdata's
   ``optimize`` (``litdata/``) and MosaicML's ``MDSWriter`` with 16 threads fetching (``mds/``),
   each into chunks of ``--shard-bytes`` (8 MB);
3. for each link (direct on loopback, and through the bench's proxy at ``--delay-ms``) runs each
   loader for ``--epochs`` shuffled epochs in a process of its own (``bench/peer_loop.py``, which
   checks every sample's bytes and that each comes once an epoch), with a fresh cache, so epoch 1
   is cold and epoch 2 reads what each one's cache kept (s5loader's ``epoch_cache`` of the whole
   data set, litdata's chunk cache, MosaicML's local copy);
4. writes the figures (``--out``, JSON) and prints a table.

litdata and MosaicML run with ``--peers-python``: the interpreter of a virtual environment of
their own (``make bench`` builds ``.venv-peers``), since installing them beside s5loader would
move its botocore and numpy. Where it is missing, their rows say so.

    PYTHONPATH=.:bench .venv/bin/python bench/peers.py [--samples 3000] [--size 100KB]
        [--peers-python .venv-peers/bin/python] [--out bench/results/peers.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3

from s5loader.testing import SeaweedFS
from s5loader_bench.proxy import ProxyProcess

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from peer_loop import sample_bytes  # noqa: E402

BUCKET = "data"
OURS = ("s5loader-raw", "s5loader-raw-block", "s5loader-shards", "s5loader-iterable")
THEIRS = ("litdata-raw", "litdata-shards", "mosaic-shards")


def parse_size(value: str) -> int:
    """``100KB``, ``64MB``, ``1GiB`` or a plain number of bytes."""
    units = {"KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "B": 1}
    v = value.strip().upper()
    for unit, factor in units.items():
        if v.endswith(unit):
            return int(float(v[: -len(unit)]) * factor)
    return int(v)


def env_for(endpoint: str) -> dict[str, str]:
    extra = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE, *extra]),
        "AWS_ACCESS_KEY_ID": "local",
        "AWS_SECRET_ACCESS_KEY": "local",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }


def write_raw(endpoint: str, n: int, size: int) -> None:
    c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    with ThreadPoolExecutor(16) as pool:
        list(
            pool.map(
                lambda i: c.put_object(Bucket=BUCKET, Key=f"raw/{i:06d}.bin", Body=sample_bytes(i, size)),
                range(n),
            )
        )


def loop_argv(python: str, kind: str, a: argparse.Namespace, endpoint: str, cache: str) -> list[str]:
    return [
        python,
        os.path.join(HERE, "peer_loop.py"),
        kind,
        "--endpoint",
        endpoint,
        "--bucket",
        BUCKET,
        "--samples",
        str(a.samples),
        "--size",
        str(a.size),
        "--cache",
        cache,
        "--epochs",
        str(a.epochs),
        "--batch",
        str(a.batch),
        "--workers",
        str(a.workers),
        "--shard-bytes",
        str(a.shard_bytes),
    ]


def timed(argv: list[str], env: dict[str, str], timeout: float) -> tuple[float, str]:
    """Run ``argv``; its seconds and its stdout. Raises RuntimeError with its stderr's end."""
    t = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} exited {proc.returncode}: {proc.stderr.strip()[-1500:]}")
    return seconds, proc.stdout


def convert(a: argparse.Namespace, endpoint: str, root: str, peers: str | None) -> dict[str, Any]:
    """Each converter as a process of its own, timed alike (its start and imports included)."""
    out: dict[str, Any] = {}
    for name, kind, python in (
        ("s5loader pack", "convert-s5loader", sys.executable),
        ("litdata optimize", "convert-litdata", peers),
        ("MosaicML MDSWriter", "convert-mds", peers),
    ):
        if python is None:
            out[name] = "not run: no --peers-python"
            continue
        try:
            argv = loop_argv(python, kind, a, endpoint, tempfile.mkdtemp(dir=root))
            out[name] = round(timed(argv, env_for(endpoint), 1800)[0], 2)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            out[name] = f"failed: {exc}"
    return out


def load(a: argparse.Namespace, endpoint: str, root: str, peers: str | None) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for kind in a.kinds:
        python = sys.executable if kind in OURS else peers
        if python is None:
            rows[kind] = "not run: no --peers-python"
            continue
        cache = tempfile.mkdtemp(prefix=f"{kind}-", dir=root)
        try:
            _, stdout = timed(loop_argv(python, kind, a, endpoint, cache), env_for(endpoint), 1800)
            rows[kind] = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            rows[kind] = f"failed: {exc}"
        finally:
            shutil.rmtree(cache, ignore_errors=True)
            restore_raw(endpoint)
        print(kind, rows[kind], flush=True)
    return rows


def restore_raw(endpoint: str) -> None:
    """Delete what a loader left under ``raw/`` (litdata's ``StreamingRawDataset`` uploads the
    index it builds beside the files), so the next one lists the samples alone."""
    c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="raw/"):
        for o in page.get("Contents", []):
            if not o["Key"].endswith(".bin"):
                c.delete_object(Bucket=BUCKET, Key=o["Key"])


NAMES = {
    "s5loader-raw": "s5loader, raw objects, `shuffle=True`",
    "s5loader-raw-block": 's5loader, raw objects, `shuffle="block"`',
    "s5loader-shards": "s5loader, tar shards, `S5Sampler`",
    "s5loader-iterable": "s5loader, tar shards, `S5IterableDataset`",
    "litdata-raw": "litdata `StreamingRawDataset`, raw objects",
    "litdata-shards": "litdata `StreamingDataset`, its chunks",
    "mosaic-shards": "MosaicML `StreamingDataset`, MDS shards",
}


def table(result: dict[str, Any]) -> str:
    """The figures as markdown: per loader, samples/s of epochs 1 and 2 (``direct | proxy``),
    CPU seconds per 1,000 samples of each epoch on the direct link (the loader's process +
    its children: DataLoader workers, s5cmd), the first batch; then the conversions."""
    links = list(result["links"])
    if not links:  # converted only
        return "Conversion of the objects into shards, s: " + json.dumps(result.get("conversion_s", {}))

    def cell(kind: str, pick: Any) -> str:
        out = []
        for link in links:
            got = result["links"][link].get(kind)
            ran = isinstance(got, list) and bool(got)
            out.append(pick(got) if ran else str(got).split(":")[0] if isinstance(got, str) else "-")
        return " \\| ".join(out)

    def cpu(e: dict[str, Any]) -> str:
        k = 1000 / e["samples"]
        main, kids = e["cpu_main_s"] * k, e["cpu_children_s"] * k
        return f"{main + kids:.2f} ({main:.2f} + {kids:.2f})"

    bar = " \\| ".join(links)
    lines = [
        f"| loader | epoch 1, samples/s ({bar}) | epoch 2 ({bar}) | CPU s per 1,000, epoch 1 "
        f"(process + children), {links[0]} | the same, epoch 2 | first batch, s ({bar}) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind in [k for k in NAMES if any(k in result["links"][link] for link in links)]:
        first = result["links"][links[0]].get(kind)
        cpus = ([cpu(e) for e in first[:2]] if isinstance(first, list) else []) + ["-", "-"]
        cpus = cpus[:2]
        cells = [
            NAMES[kind],
            cell(kind, lambda g: f"{g[0]['samples_per_s']:.0f}"),
            cell(kind, lambda g: f"{g[1]['samples_per_s']:.0f}" if len(g) > 1 else "-"),
            *cpus,
            cell(kind, lambda g: f"{g[0]['first_batch_s']:.2f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    conv = result.get("conversion_s", {})
    lines.append("")
    lines.append(
        "Conversion of the objects into shards, s: "
        + ", ".join(f"{k} {v}" if isinstance(v, (int, float)) else f"{k}: {v}" for k, v in conv.items())
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--samples", type=int, default=3000)
    p.add_argument("--size", type=parse_size, default=100_000)
    p.add_argument("--shard-bytes", type=parse_size, default=8_000_000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument(
        "--links", nargs="*", default=["direct", "proxy"], choices=["direct", "proxy"], help="none: convert"
    )
    p.add_argument(
        "--peers-python", help="the interpreter of the peers' environment (.venv-peers/bin/python)"
    )
    p.add_argument("--kinds", nargs="+", default=[*OURS, *THEIRS], choices=[*OURS, *THEIRS])
    p.add_argument("--out", help="write the figures here (JSON)")
    a = p.parse_args(argv)
    peers = a.peers_python if a.peers_python and os.path.exists(a.peers_python) else None
    for var, value in env_for("").items():
        if var.startswith("AWS_") and var != "AWS_ENDPOINT_URL":
            os.environ.setdefault(var, value)
    # tmpfs where it holds the store and every cache (Docker's default /dev/shm is 64 MB)
    shm = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 6 * a.samples * a.size
    root = tempfile.mkdtemp(prefix="s5l-peers-", dir="/dev/shm" if shm else None)
    result: dict[str, Any] = {
        "args": {k: v for k, v in vars(a).items()},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d"),
        "links": {},
    }
    try:
        with SeaweedFS(os.path.join(root, "weed"), (BUCKET,)) as weed:
            write_raw(weed.endpoint, a.samples, a.size)
            result["conversion_s"] = convert(a, weed.endpoint, root, peers)
            print("conversion", result["conversion_s"], flush=True)
            for link in a.links:
                if link == "direct":
                    result["links"][link] = load(a, weed.endpoint, root, peers)
                else:
                    with ProxyProcess(weed.endpoint, a.delay_ms) as proxy:
                        result["links"][link] = load(a, proxy.endpoint, root, peers)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
