#!/usr/bin/env python3
"""Converting raw objects into shards: ``s5loader pack`` against the usual alternatives, on the
local SeaweedFS, from the same source prefix to shards in the same bucket.

1. starts the embedded SeaweedFS in a temporary directory and writes ``--samples`` samples
   (an ``NNNNNN.jpg`` of ``--size`` random bytes and an ``NNNNNN.cls`` label each);
2. converts them into shards of ``--shard-size`` with each method, in turn, each with its own
   empty local folder, whose size (the bytes of its files) a thread polls every 5 ms:

   * ``s5loader``: ``s5loader.pack(src, dest, shard_size=..., budget=...)`` (public API only);
   * ``webdataset+boto3``: list with boto3, GET each object in key order, write
     ``webdataset.ShardWriter`` shards, upload each shard with ``upload_file`` when it closes
     (the ``post`` hook) and delete it: the usual script;
   * ``webdataset+boto3 x32``: the same with the GETs in a pool of 32 threads (in order);
   * ``litdata``: ``litdata.optimize(fn, keys, output_dir="s3://...", chunk_bytes=...)``,
     ``fn`` reading a sample with boto3, ``num_workers`` = the CPU count (its chunk format,
     not tar: the figure is the conversion's cost);

   and the CPU seconds of the method (this process and its children: s5cmd, litdata's
   workers) and of the store (SeaweedFS) while it runs;

3. checks each result (the shards' sample count), prints a table, writes
   ``bench/results/pack.json``; stops the server.

Each method runs ``--repeat`` times (default 2), the methods in a rotated order each round
(the first run after the source is written is slower, whoever runs it); the table gives each
method's best time, its least CPU and its peak disk over all runs; the JSON every run's time.

    .venv/bin/python bench/pack.py [--samples 2000] [--size 20KB] [--shard-size 4MB] [--budget 16MB] \
        [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import s5loader  # noqa: E402
from s5loader import S5Dataset, parse_size  # noqa: E402
from s5loader._staging.area import tree_bytes  # noqa: E402
from s5loader.testing import SeaweedFS  # noqa: E402
from s5loader_bench.transforms import recode  # noqa: E402

BUCKET = "data"
ENDPOINT = ""  # set in main(); read by litdata's workers through the environment


def _litdata_over_http() -> None:
    """litdata uploads through obstore, which refuses a plain-http endpoint unless told; its
    workers are spawned and import this module, so this runs in each of them too."""
    try:
        from litdata.streaming import downloader
    except ImportError:
        return
    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(options, dict):
        options["allow_http"] = "true"


_litdata_over_http()


class PeakDisk:
    """The most bytes of files below ``path`` while the block runs (polled)."""

    def __init__(self, path: str, interval: float = 0.005) -> None:
        self.path, self.interval, self.peak = path, interval, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_bytes(self.path))
            time.sleep(self.interval)

    def __enter__(self) -> PeakDisk:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def client() -> Any:
    import boto3

    return boto3.client(
        "s3", endpoint_url=ENDPOINT or os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1"
    )


def write_source(n: int, size: int, prefix: str) -> None:
    c = client()

    def put(i: int) -> None:
        c.put_object(Bucket=BUCKET, Key=f"{prefix}{i:06d}.jpg", Body=random.Random(i).randbytes(size))
        c.put_object(Bucket=BUCKET, Key=f"{prefix}{i:06d}.cls", Body=str(i % 10).encode())

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(n)))


def list_samples(prefix: str) -> list[tuple[str, list[str]]]:
    """``[(key, [object keys])]`` grouped by stem, in key order (boto3, one LIST per 1000)."""
    groups: dict[str, list[str]] = {}
    for page in client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for o in page.get("Contents", []):
            stem = o["Key"][len(prefix) :].split(".", 1)[0]
            groups.setdefault(stem, []).append(o["Key"])
    return sorted(groups.items())


# -- the methods: each converts s3://data/SRC/ into shards under s3://data/DEST/ ----------------


Check = Callable[[], int]  # the samples in the result, counted after the clock stops


def run_s5loader(
    src: str, dest: str, work: str, shard_size: int, budget: int, transform: bool = False
) -> Check:
    s5loader.pack(
        f"s3://{BUCKET}/{src}",
        f"s3://{BUCKET}/{dest}",
        shard_size=shard_size,
        budget=budget,
        staging_dir=work,
        endpoint_url=ENDPOINT,
        transform=recode if transform else None,
    )
    return lambda: len(S5Dataset.from_shards(f"s3://{BUCKET}/{dest}", endpoint_url=ENDPOINT))


def run_webdataset(src: str, dest: str, work: str, shard_size: int, threads: int) -> Check:
    import webdataset as wds

    c = client()

    def upload(path: str) -> None:
        c.upload_file(path, BUCKET, dest + os.path.basename(path))
        os.unlink(path)

    def fetch(item: tuple[str, list[str]]) -> dict[str, Any]:
        key, keys = item
        out: dict[str, Any] = {"__key__": key}
        for k in keys:
            out[k.rsplit(".", 1)[1]] = c.get_object(Bucket=BUCKET, Key=k)["Body"].read()
        return out

    samples = list_samples(src)
    pattern = os.path.join(work, "shard-%06d.tar")
    with wds.ShardWriter(pattern, maxsize=shard_size, maxcount=10**9, post=upload, verbose=0) as sink:
        if threads > 1:
            with ThreadPoolExecutor(threads) as pool:
                for s in pool.map(fetch, samples):
                    sink.write(s)
        else:
            for item in samples:
                sink.write(fetch(item))
    return lambda: count_tar_samples(dest)


def count_tar_samples(dest: str) -> int:
    c = client()
    n = 0
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=dest):
        for o in page.get("Contents", []):
            body = c.get_object(Bucket=BUCKET, Key=o["Key"])["Body"]
            with tarfile.open(fileobj=body, mode="r|") as tar:
                n += sum(1 for m in tar if m.name.endswith(".cls"))
    return n


_LIT_CLIENT: Any = None


def litdata_sample(item: tuple[str, list[str]]) -> dict[str, Any]:
    global _LIT_CLIENT
    if _LIT_CLIENT is None:
        _LIT_CLIENT = client()
    key, keys = item
    out: dict[str, Any] = {"key": key}
    for k in keys:
        out[k.rsplit(".", 1)[1]] = _LIT_CLIENT.get_object(Bucket=BUCKET, Key=k)["Body"].read()
    return out


def litdata_recoded(item: tuple[str, list[str]]) -> dict[str, Any]:
    """:func:`litdata_sample`, then the transform every method's transform run does."""
    out = litdata_sample(item)
    return {"key": out["key"], **recode(out)}


def run_litdata(src: str, dest: str, work: str, shard_size: int, transform: bool = False) -> Check:
    from litdata import optimize

    os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = os.path.join(work, "chunks")
    os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] = os.path.join(work, "data")
    samples = list_samples(src)
    optimize(
        fn=litdata_recoded if transform else litdata_sample,
        inputs=samples,
        output_dir=f"s3://{BUCKET}/{dest}",
        chunk_bytes=shard_size,
        num_workers=os.cpu_count() or 1,
        storage_options={"endpoint_url": ENDPOINT},
        mode="overwrite",
    )

    def count() -> int:
        index = json.loads(client().get_object(Bucket=BUCKET, Key=dest + "index.json")["Body"].read())
        return sum(int(ch["chunk_size"]) for ch in index["chunks"])

    return count


def cpu_seconds() -> tuple[float, float]:
    """CPU of this process and its reaped children (s5cmd, litdata's workers), and of the
    store (the SeaweedFS processes below this one)."""
    import psutil

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    server = 0.0
    for proc in psutil.Process().children(recursive=True):
        try:
            if "weed" in proc.name():
                t = proc.cpu_times()
                server += t.user + t.system
        except psutil.Error:
            pass
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime, server


def measure(
    name: str, fn: Callable[[str, str, str], Check], src: str, n: int, root: str
) -> tuple[float, int, float, float]:
    work = tempfile.mkdtemp(prefix=f"{name.split('+')[0]}-", dir=root)
    dest = f"out-{name.replace('+', '-').replace(' ', '')}-{os.path.basename(work)}/"
    with PeakDisk(work) as peak:
        cpu0, server0 = cpu_seconds()
        t0 = time.perf_counter()
        check = fn(src, dest, work)
        seconds = time.perf_counter() - t0
        cpu1, server1 = cpu_seconds()
    got = check()
    if got != n:
        raise SystemExit(f"{name}: {got} samples in the result, {n} expected")
    cpu, server = cpu1 - cpu0, server1 - server0
    print(
        f"  {name:<22} {seconds:7.2f} s  peak local disk {peak.peak / 1e6:7.2f} MB  CPU {cpu:5.2f} s "
        f"(+ store {server:5.2f} s)",
        flush=True,
    )
    return seconds, peak.peak, cpu, server


def _parser() -> argparse.ArgumentParser:
    """The arguments of ``pack.py``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--size", default="20KB", help="bytes of each sample's .jpg (default 20KB)")
    p.add_argument("--shard-size", default="4MB")
    p.add_argument("--budget", default="16MB", help="s5loader pack's local disk budget (default 16MB)")
    p.add_argument(
        "--methods",
        default="s5loader,webdataset+boto3,webdataset+boto3 x32,litdata,s5loader+transform,litdata+transform",
    )
    p.add_argument("--repeat", type=int, default=2, help="runs of each method (default 2)")
    p.add_argument("--output", default=os.path.join(HERE, "results", "pack.json"))
    return p


def main(argv: list[str] | None = None) -> int:
    global ENDPOINT
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the server stops with the `with` below
    size, shard, budget = parse_size(args.size), parse_size(args.shard_size), parse_size(args.budget)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench-secret")
    os.environ.setdefault("AWS_REGION", "us-east-1")
    methods: dict[str, Callable[[str, str, str], Check]] = {
        "s5loader": lambda s, d, w: run_s5loader(s, d, w, shard, budget),
        "webdataset+boto3": lambda s, d, w: run_webdataset(s, d, w, shard, 1),
        "webdataset+boto3 x32": lambda s, d, w: run_webdataset(s, d, w, shard, 32),
        "litdata": lambda s, d, w: run_litdata(s, d, w, shard),
        # the same per-sample work (s5loader_bench.transforms.recode) while converting
        "s5loader+transform": lambda s, d, w: run_s5loader(s, d, w, shard, budget, transform=True),
        "litdata+transform": lambda s, d, w: run_litdata(s, d, w, shard, transform=True),
    }
    chosen = [m.strip() for m in args.methods.split(",") if m.strip()]
    with tempfile.TemporaryDirectory(prefix="s5bench-pack-") as root:
        with SeaweedFS(os.path.join(root, "weed"), (BUCKET,)) as server:
            ENDPOINT = server.endpoint
            os.environ["AWS_ENDPOINT_URL"] = ENDPOINT  # litdata's workers build their own clients
            src = "raw/"
            t0 = time.perf_counter()
            write_source(args.samples, size, src)
            print(
                f"{args.samples} samples x {args.size} (+ a label) written in {time.perf_counter() - t0:.1f} "
                f"s; shards of {args.shard_size}, s5loader budget {args.budget}",
                flush=True,
            )
            runs: dict[str, list[tuple[float, int, float, float]]] = {m: [] for m in chosen}
            for k in range(args.repeat):
                print(f"round {k + 1}", flush=True)
                for m in chosen[k % len(chosen) :] + chosen[: k % len(chosen)]:
                    runs[m].append(measure(m, methods[m], src, args.samples, root))
    results = [
        {
            "method": m,
            "seconds": round(min(x[0] for x in r), 3),
            "peak_disk_bytes": max(x[1] for x in r),
            "cpu_seconds": round(min(x[2] for x in r), 2),
            "store_cpu_seconds": round(min(x[3] for x in r), 2),
            "runs_seconds": [round(x[0], 3) for x in r],
        }
        for m, r in runs.items()
    ]
    base = next((r for r in results if r["method"] == "s5loader"), None)
    print(
        f"{'method':<22} {'best s':>8} {'x s5loader':>10} {'peak disk MB':>12} {'CPU s':>6} "
        f"{'store CPU s':>11}"
    )
    for r in results:
        r["time_vs_s5loader"] = round(r["seconds"] / base["seconds"], 2) if base else None
        print(
            f"{r['method']:<22} {r['seconds']:8.2f} {r['time_vs_s5loader'] or 0:10.2f} "
            f"{r['peak_disk_bytes'] / 1e6:12.2f} {r['cpu_seconds']:6.2f} {r['store_cpu_seconds']:11.2f}"
        )
    doc = {
        "samples": args.samples,
        "size": size,
        "shard_size": shard,
        "budget": budget,
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
        "server": "SeaweedFS on loopback",
        "results": results,
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
