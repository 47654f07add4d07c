#!/usr/bin/env python3
"""What a node runs while its ranks stage: s5cmd processes, their memory and their connections.

Starts the embedded SeaweedFS in a temporary directory, writes ``--objects`` objects of ``--size``
bytes, and runs ``--ranks`` processes (forked, each with ``RANK``/``WORLD_SIZE``) that each read
their part of one epoch through an ``S5Sampler`` with the default options (``calls_in_flight=4``,
``s5cmd_workers=32``) or ``--s5cmd-workers`` and ``--calls-in-flight``, staging in ``/dev/shm``.
Meanwhile it samples every 50 ms the s5cmd processes below it and reports the most seen at once:
processes, their RSS together, and their TCP connections (all ranks, and the most of one rank). A
measurement of this machine, not a comparison: nothing else runs.

    .venv/bin/python bench/node_load.py [--ranks 8] [--objects 8000] [--size 20000] \
        [--s5cmd-workers 256 --calls-in-flight 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
import psutil
from torch.utils.data import DataLoader

from s5loader import S5Dataset, S5Sampler, StagingOptions
from s5loader.testing import SeaweedFS


def rank(r: int, ranks: int, ds: S5Dataset, root: str, workers: int, calls: int, start: Any) -> None:
    os.environ.update(RANK=str(r), WORLD_SIZE=str(ranks))
    with S5Sampler(ds, staging_dir=root, s5cmd_workers=workers, calls_in_flight=calls) as sampler:
        start.wait()
        for _ in DataLoader(ds, sampler=sampler, batch_size=64, collate_fn=lambda b: b):
            pass


def watch(done: threading.Event, peak: dict[str, int]) -> None:
    me = psutil.Process()
    while not done.is_set():
        rss, per_rank = 0, {}
        s5cmd = [p for p in me.children(recursive=True) if p.name() == "s5cmd"]
        for p in s5cmd:
            try:
                rss += p.memory_info().rss
                per_rank[p.ppid()] = per_rank.get(p.ppid(), 0) + len(p.net_connections(kind="tcp"))
            except psutil.Error:
                pass
        seen = {
            "s5cmd": len(s5cmd),
            "rss": rss,
            "tcp": sum(per_rank.values()),
            "tcp_one_rank": max(per_rank.values(), default=0),
        }
        for k, v in seen.items():
            peak[k] = max(peak.get(k, 0), v)
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--objects", type=int, default=8000)
    ap.add_argument("--size", type=int, default=20000)
    ap.add_argument("--s5cmd-workers", type=int, default=StagingOptions.s5cmd_workers)
    ap.add_argument("--calls-in-flight", type=int, default=StagingOptions.calls_in_flight)
    args = ap.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "local")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "local-secret")
    with tempfile.TemporaryDirectory(prefix="s5loader-node-load-") as d, SeaweedFS(d, ("data",)) as weed:
        client = boto3.client("s3", endpoint_url=weed.endpoint, region_name="us-east-1")
        body = os.urandom(args.size)
        with ThreadPoolExecutor(32) as ex:
            list(
                ex.map(
                    lambda i: client.put_object(Bucket="data", Key=f"m/{i:06d}.bin", Body=body),
                    range(args.objects),
                )
            )
        ds = S5Dataset.from_prefix("s3://data/m/", endpoint_url=weed.endpoint)
        root = tempfile.mkdtemp(
            prefix="s5loader-node-load-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )
        ctx = multiprocessing.get_context("fork")
        start = ctx.Barrier(args.ranks + 1)
        procs = [
            ctx.Process(
                target=rank, args=(r, args.ranks, ds, root, args.s5cmd_workers, args.calls_in_flight, start)
            )
            for r in range(args.ranks)
        ]
        for p in procs:
            p.start()
        peak: dict[str, int] = {}
        done = threading.Event()
        watcher = threading.Thread(target=watch, args=(done, peak))
        watcher.start()
        t0 = time.monotonic()
        start.wait()
        for p in procs:
            p.join()
        done.set()
        watcher.join()
        os.rmdir(root)
        print(
            json.dumps(
                {
                    "ranks": args.ranks,
                    "objects": args.objects,
                    "size": args.size,
                    "s5cmd_workers": args.s5cmd_workers,
                    "calls_in_flight": args.calls_in_flight,
                    "s5cmd_most": peak.get("s5cmd", 0),
                    "rss_most_mib": round(peak.get("rss", 0) / 2**20, 1),
                    "tcp_most": peak.get("tcp", 0),
                    "tcp_most_one_rank": peak.get("tcp_one_rank", 0),
                    "seconds": round(time.monotonic() - t0, 1),
                    "cpus": os.cpu_count(),
                }
            )
        )


if __name__ == "__main__":
    main()
