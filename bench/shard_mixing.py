#!/usr/bin/env python3
"""How well class-sorted tar shards mix at equal memory: s5loader against WebDataset's shuffle buffer.

Starts SeaweedFS (``s5loader.testing.SeaweedFS``) in a temporary folder, writes ``--shards`` tar
shards of one class each (``--per-shard`` samples: a ``cls`` field and ``--sample-size`` bytes of
``bin``) and their index (``s5loader index-shards``), then reads one epoch per ``--seeds`` seed
through ``DataLoader(num_workers=--workers, batch_size=--batch)``:

* webdataset: ``WebDataset(["pipe:s5cmd cat s3://..."], shardshuffle=N, seed=SEED).shuffle(--buffer)``:
  each worker reads its shards through a buffer of ``--buffer`` samples of its own, and a batch
  comes from one worker;
* ``S5Sampler(shuffle=True)`` and ``S5IterableDataset(shuffle=True, batch_size=--batch)``, with a
  budget of the bytes WebDataset's buffers hold (workers x buffer x the shards' bytes per sample:
  "equal memory"), with a budget of 4 shards, and with the default budget (2 GiB);
* ``s5loader prefetch --shards --shuffle`` (the daemon, a child process) with the same budgets,
  read with ``s5loader.consume`` in delivery order.

For each it prints the mean number of distinct classes among 64 consecutive samples the loader
yields, and among its first 64 (means over the seeds), and the first against webdataset's. The
s5loader side uses the public API only and reads the loaders' own outputs (each sample's ``cls``).

    .venv/bin/python bench/shard_mixing.py [--shards 40] [--per-shard 250] [--seeds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
from torch.utils.data import DataLoader

from s5loader import Access, S5Dataset, S5IterableDataset, S5Sampler, StagingOptions, consume, find_s5cmd
from s5loader.testing import SeaweedFS

BUCKET, PREFIX = "data", "mixing/"
SPAN = 64


def class_of(sample: dict[str, Any]) -> int:
    return int(sample["cls"])


def shard_bytes(s: int, per_shard: int, size: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for j in range(per_shard):
            for field, data in (("cls", b"%d" % s), ("bin", os.urandom(size))):
                info = tarfile.TarInfo(f"c{s:04d}-{j:05d}.{field}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_shards(endpoint: str, shards: int, per_shard: int, size: int) -> int:
    """Upload the shards and build their index; returns the largest shard's size."""
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="local",
        aws_secret_access_key="local",
        region_name="us-east-1",
    )
    sizes = []

    def put(s: int) -> None:
        data = shard_bytes(s, per_shard, size)
        s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}shard-{s:06d}.tar", Body=data)
        sizes.append(len(data))

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(put, range(shards)))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "s5loader",
            "index-shards",
            f"s3://{BUCKET}/{PREFIX}",
            "--endpoint-url",
            endpoint,
            "--force",
        ],
        check=True,
        capture_output=True,
    )
    return max(sizes)


def mixing(classes: list[int]) -> tuple[float, int]:
    """Mean distinct classes per SPAN consecutive samples, and among the first SPAN."""
    runs = [classes[a : a + SPAN] for a in range(0, len(classes) - SPAN + 1, SPAN)] or [classes]
    return sum(len(set(r)) for r in runs) / len(runs), len(set(classes[:SPAN]))


def read(batches: Iterable[list[Any]]) -> list[int]:
    return [class_of(x) for b in batches for x in b]


def webdataset(args: argparse.Namespace, endpoint: str, seed: int) -> list[int]:
    import webdataset as wds

    head = shlex.join([find_s5cmd(), *Access(endpoint_url=endpoint).s5cmd_flags(), "cat"])
    urls = [f"pipe:{head} s3://{BUCKET}/{PREFIX}shard-{s:06d}.tar" for s in range(args.shards)]
    ds = wds.WebDataset(urls, shardshuffle=len(urls), seed=seed, empty_check=False).shuffle(args.buffer)
    return read(DataLoader(ds, batch_size=args.batch, num_workers=args.workers, collate_fn=list))


def sampler(args: argparse.Namespace, ds: S5Dataset, budget: int, seed: int, root: str) -> list[int]:
    with S5Sampler(ds, shuffle=True, seed=seed, budget=budget, staging_dir=root) as s:
        return read(
            DataLoader(ds, sampler=s, batch_size=args.batch, num_workers=args.workers, collate_fn=list)
        )


def iterable(args: argparse.Namespace, ds: S5Dataset, budget: int, seed: int, root: str) -> list[int]:
    with S5IterableDataset(
        ds,
        shuffle=True,
        seed=seed,
        budget=budget,
        staging_dir=root,
        batch_size=args.batch,
        num_workers=args.workers,
    ) as it:
        return read(DataLoader(it, batch_size=args.batch, num_workers=args.workers, collate_fn=list))


def daemon(args: argparse.Namespace, endpoint: str, budget: int, seed: int, root: str) -> list[int]:
    """One epoch of ``s5loader prefetch --shards --shuffle`` (a child process) read with
    :func:`s5loader.consume`, in delivery order."""
    cache = tempfile.mkdtemp(prefix="cache-", dir=root)
    cmd = [sys.executable, "-m", "s5loader", "prefetch", f"s3://{BUCKET}/{PREFIX}", "--cache", cache]
    cmd += ["--budget", str(budget), "--shards", "--shuffle", "--seed", str(seed), "--epochs", "1"]
    cmd += ["--endpoint-url", endpoint, "--no-progress"]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stderr=log)
    try:
        classes = []
        for sample in consume(cache, timeout=600):
            with open(sample.files["cls"], encoding="ascii") as f:
                classes.append(int(f.read()))
        if proc.wait(timeout=60) != 0:
            log.seek(0)
            raise RuntimeError(f"s5loader prefetch exited {proc.returncode}: {log.read()[-2000:]!r}")
        return classes
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(cache, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    """The arguments of ``shard_mixing.py``."""
    p = argparse.ArgumentParser(prog="bench/shard_mixing.py", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--shards", type=int, default=40)
    p.add_argument("--per-shard", type=int, default=250)
    p.add_argument("--sample-size", type=int, default=3000, help="bytes of each sample's bin field")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--buffer", type=int, default=1000, help="WebDataset's shuffle buffer, samples per worker")
    p.add_argument("--seeds", type=int, default=3, help="epochs read by each loader, one seed each")
    p.add_argument("--json", help="write the figures here too")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for var, value in (
        ("AWS_ACCESS_KEY_ID", "local"),
        ("AWS_SECRET_ACCESS_KEY", "local"),
        ("AWS_REGION", "us-east-1"),
    ):
        os.environ.setdefault(var, value)
    t0 = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="s5loader-mixing-") as tmp,
        SeaweedFS(os.path.join(tmp, "weed"), (BUCKET,)) as weed,
    ):
        largest = write_shards(weed.endpoint, args.shards, args.per_shard, args.sample_size)
        ds = S5Dataset.from_shards(f"s3://{BUCKET}/{PREFIX}", endpoint_url=weed.endpoint)
        per_sample = ds.total_bytes / len(ds)  # a shard's bytes per sample (its tar headers and end included)
        equal = int(args.workers * args.buffer * per_sample)
        default = StagingOptions().budget
        runs: list[tuple[str, int, Callable[[int], list[int]]]] = [
            (
                f"webdataset, shardshuffle + shuffle({args.buffer}) per worker",
                equal,
                lambda seed: webdataset(args, weed.endpoint, seed),
            ),
            (
                "S5Sampler(shuffle=True), equal memory",
                equal,
                lambda seed: sampler(args, ds, equal, seed, tmp),
            ),
            (
                "S5IterableDataset(shuffle=True), equal memory",
                equal,
                lambda seed: iterable(args, ds, equal, seed, tmp),
            ),
            (
                "s5loader prefetch --shards --shuffle, equal memory",
                equal,
                lambda seed: daemon(args, weed.endpoint, equal, seed, tmp),
            ),
            (
                "S5Sampler(shuffle=True), a budget of 4 shards",
                4 * largest,
                lambda seed: sampler(args, ds, 4 * largest, seed, tmp),
            ),
            (
                "S5IterableDataset(shuffle=True), a budget of 4 shards",
                4 * largest,
                lambda seed: iterable(args, ds, 4 * largest, seed, tmp),
            ),
            (
                "s5loader prefetch --shards --shuffle, a budget of 4 shards",
                4 * largest,
                lambda seed: daemon(args, weed.endpoint, 4 * largest, seed, tmp),
            ),
            (
                "S5Sampler(shuffle=True), default budget",
                default,
                lambda seed: sampler(args, ds, default, seed, tmp),
            ),
            (
                "S5IterableDataset(shuffle=True), default budget",
                default,
                lambda seed: iterable(args, ds, default, seed, tmp),
            ),
        ]
        rows = []
        everything = sorted(s for s in range(args.shards) for _ in range(args.per_shard))
        for name, budget, run in runs:
            row: dict[str, Any] = {"loader": name, "memory_bytes": budget, "per_64": [], "first_64": []}
            try:
                for seed in range(args.seeds):
                    classes = run(seed)
                    if sorted(classes) != everything:
                        raise RuntimeError(f"seed {seed}: the epoch did not deliver every sample once")
                    per, first = mixing(classes)
                    row["per_64"].append(round(per, 2))
                    row["first_64"].append(first)
            except Exception as exc:  # reported in the table, as s5loader bench reports a failed method
                row["error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            print(
                f"{name}: {row['per_64']} / {row['first_64']} {row.get('error', '')}",
                file=sys.stderr,
                flush=True,
            )
    ref = rows[0]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    print(
        f"\n{args.shards} class-sorted shards x {args.per_shard} samples of {per_sample / 1000:.1f} kB (one "
        f"class per shard), {args.workers} DataLoader workers, batch {args.batch}, {args.seeds} epoch(s) "
        f"each; equal memory: {args.workers} x {args.buffer} samples = {equal / 2**20:.2f} MiB\n"
    )
    print(
        f"| loader | memory (budget) | distinct classes per {SPAN} | in the first {SPAN} "
        f"| per {SPAN} vs webdataset |"
    )
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['loader']} | {r['memory_bytes'] / 2**20:.2f} MiB | failed: {r['error'][:200]} | | |")
            continue
        ratio = mean(r["per_64"]) / mean(ref["per_64"])
        print(
            f"| {r['loader']} | {r['memory_bytes'] / 2**20:.2f} MiB | {mean(r['per_64']):.1f} | "
            f"{mean(r['first_64']):.1f} | {ratio:.2f}x |"
        )
    print(f"\n({time.monotonic() - t0:.0f}s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "args": vars(args),
                    "shard_bytes": largest,
                    "bytes_per_sample": per_sample,
                    "equal_memory_bytes": equal,
                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                    "rows": rows,
                },
                fh,
                indent=1,
            )
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
