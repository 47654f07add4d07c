#!/usr/bin/env python3
"""What the epoch cache saves over several epochs: S3 requests and bytes per epoch, samples/s,
and the most the staging root held, for ``S5Sampler(epoch_cache=...)`` with no cache, a cache
of half the data set and one that holds it all; over raw objects, or (``--shards N``) over N
tar shards of the same samples, which the cache keeps whole.

A local SeaweedFS (``weed mini``) holds ``--samples`` image + label pairs of ``--size`` bytes;
every request goes through the request-counting proxy of ``s5loader_bench/proxy.py`` (run as a
child process) with ``--delay-ms`` per request, as a distant store would add. Each
configuration reads ``--epochs`` epochs through a ``DataLoader`` with ``--workers`` workers that
only reads the samples (no training step); a thread samples the bytes below the staging root
every few milliseconds. ``--repeat R`` runs every configuration R times, one after another in
turn, and reports per epoch the run with the median samples/s, and the median of the runs'
epoch-2-to-epoch-1 ratios.

    PYTHONPATH=.:bench .venv/bin/python bench/epoch_cache.py [--samples 1500] [--size 32768] \\
        [--delay-ms 20] [--epochs 3] [--repeat 3] [--out bench/results/epoch_cache.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
from torch.utils.data import DataLoader

from s5loader import S5Dataset, S5Sampler
from s5loader.testing import SeaweedFS
from s5loader_bench.proxy import ProxyProcess


def collate(batch: list[Any]) -> int:
    return len(batch)


def tree_bytes(path: str) -> int:
    total = 0
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d != ".calls"]
        for f in files:
            if f in (".lock", ".manifest.json", ".members", ".released"):  # control files, not staged data
                continue
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


class Peak:
    def __init__(self, path: str) -> None:
        self.path, self.peak, self._stop = path, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, tree_bytes(self.path))

    def __enter__(self) -> Peak:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def put_objects(endpoint: str, prefix: str, n: int, size: int) -> None:
    s3 = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1"
    )

    def put(i: int) -> None:
        s3.put_object(Bucket="data", Key=f"{prefix}{i:06d}.image", Body=os.urandom(size))
        s3.put_object(Bucket="data", Key=f"{prefix}{i:06d}.label", Body=str(i % 10).encode())

    with ThreadPoolExecutor(16) as ex:
        list(ex.map(put, range(n)))


def put_shards(endpoint: str, prefix: str, n: int, size: int, shards: int) -> None:
    """``n`` image + label samples in ``shards`` tar shards, and their index (``s5loader index-shards``)."""
    s3 = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1"
    )
    per = -(-n // shards)

    def put(s: int) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(s * per, min(n, (s + 1) * per)):
                for ext, data in (("image", os.urandom(size)), ("label", str(i % 10).encode())):
                    info = tarfile.TarInfo(f"{i:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        s3.put_object(Bucket="data", Key=f"{prefix}shard-{s:04d}.tar", Body=buf.getvalue())

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(put, range(shards)))
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"}
    subprocess.run(
        [sys.executable, "-m", "s5loader", "index-shards", f"s3://data/{prefix}", "--endpoint-url", endpoint],
        check=True,
        env=env,
        capture_output=True,
    )


def s5loader_runs(args: argparse.Namespace, proxy: ProxyProcess, root: str) -> list[dict[str, Any]]:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "x")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "x")
    if args.shards:
        ds = S5Dataset.from_shards("s3://data/ec/", endpoint_url=proxy.endpoint)
    else:
        ds = S5Dataset.from_prefix("s3://data/ec/", endpoint_url=proxy.endpoint)
    total = ds.total_bytes
    budget = total // 8
    shuffle: bool | str = True
    if args.shards:
        # shards in a shuffled order of blocks, each read whole: the cache keeps shards whole, so
        # the shards of a batch must fit at once, whole, which a block order keeps to two
        shuffle, budget = "block", max(budget, total // 4)
    rows: dict[str, dict[str, Any]] = {}
    for rep in range(args.repeat):
        for name, cache in (("none", 0), ("half", total // 2), ("all", total)):
            staging = os.path.join(root, f"staging-{name}-{rep}")
            os.makedirs(staging)
            row = rows.setdefault(
                name,
                {
                    "cache": name,
                    "epoch_cache_bytes": cache,
                    "budget_bytes": budget,
                    "runs": [],
                    "peak_staging_bytes": 0,
                    "bound_bytes": budget + cache,
                },
            )
            epochs = []
            with (
                S5Sampler(
                    ds, budget=budget, epoch_cache=cache, staging_dir=staging, seed=1, shuffle=shuffle
                ) as sampler,
                Peak(staging) as peak,
            ):
                for e in range(args.epochs):
                    sampler.set_epoch(e)
                    before = proxy.counts()
                    loader = DataLoader(
                        ds,
                        sampler=sampler,
                        batch_size=args.batch,
                        num_workers=args.workers,
                        collate_fn=collate,
                    )
                    t0 = time.perf_counter()
                    n = sum(loader)
                    dt = time.perf_counter() - t0
                    after = proxy.counts()
                    m = sampler.metrics()
                    epochs.append(
                        {
                            "epoch": e,
                            "samples": n,
                            "seconds": round(dt, 3),
                            "samples_s": round(n / dt, 1),
                            "s3_get": after["GET"] - before["GET"],
                            "s3_head": after["HEAD"] - before["HEAD"],
                            "s3_bytes": m.fetched_bytes,
                            "cache_hits": m.epoch_cache_hits,
                            "cache_bytes": m.epoch_cache_bytes,
                        }
                    )
                    print(name, rep, epochs[-1], flush=True)
            row["runs"].append(epochs)
            row["peak_staging_bytes"] = max(row["peak_staging_bytes"], peak.peak)
    for row in rows.values():
        # per epoch: the run with the median samples/s (its other figures with it)
        row["epochs"] = [
            sorted((r[e] for r in row["runs"]), key=lambda x: x["samples_s"])[len(row["runs"]) // 2]
            for e in range(args.epochs)
        ]
        ratios = [r[1]["samples_s"] / r[0]["samples_s"] for r in row["runs"] if len(r) > 1]
        if ratios:
            row["epoch2_vs_epoch1_samples_s"] = sorted(ratios)[len(ratios) // 2]
            row["epoch2_vs_epoch1_s3_bytes"] = round(
                row["epochs"][1]["s3_bytes"] / max(1, row["epochs"][0]["s3_bytes"]), 3
            )
    return list(rows.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--samples", type=int, default=1500)
    p.add_argument("--size", type=int, default=32768)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeat", type=int, default=1, help="runs of each configuration (medians reported)")
    p.add_argument(
        "--shards", type=int, default=0, help="the samples in this many tar shards (0: raw objects)"
    )
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="s5l-ecache-", dir="/tmp")
    try:
        with SeaweedFS(os.path.join(root, "weed"), ("data",)) as weed:
            if args.shards:
                put_shards(weed.endpoint, "ec/", args.samples, args.size, args.shards)
            else:
                put_objects(weed.endpoint, "ec/", args.samples, args.size)
            with ProxyProcess(weed.endpoint, args.delay_ms) as proxy:
                result: dict[str, Any] = {
                    "samples": args.samples,
                    "size": args.size,
                    "shards": args.shards,
                    "delay_ms": args.delay_ms,
                    "workers": args.workers,
                    "batch": args.batch,
                    "repeat": args.repeat,
                    "s5loader": s5loader_runs(args, proxy, root),
                }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for row in result["s5loader"]:
        e = row["epochs"]
        print(
            f"{row['cache']:>5}: "
            + ", ".join(
                f"epoch {x['epoch']}: {x['samples_s']} samples/s, {x['s3_get']} GET, {x['s3_bytes']} B from "
                f"S3, {x['cache_hits']} hits"
                for x in e
            )
            + f"; peak staging {row['peak_staging_bytes']} B "
            f"(bound {row['bound_bytes']} B); epoch 2 / epoch 1 samples/s (median of runs): "
            f"{row.get('epoch2_vs_epoch1_samples_s', 0):.2f}"
        )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
