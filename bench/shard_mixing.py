#!/usr/bin/env python3
"""How well a shard order mixes class-sorted shards: s5loader against WebDataset.

Writes ``--shards`` local tar shards of ``--per-shard`` samples each, one class per shard (the
hard case: a shard holds one class), and measures, for the batches a ``DataLoader`` with
``--workers`` workers yields in epoch 0, the mean number of distinct shards among 64 and among
256 consecutive samples, overall and in the first batch:

* WebDataset: ``WebDataset(shards, shardshuffle=N, seed=0).shuffle(1000)``, read by the
  DataLoader's workers (each worker reads its own shards; a batch comes from one worker). Its
  buffer holds ``--buffer`` samples in memory.
* s5loader ``S5Sampler(shuffle=True)`` and ``S5IterableDataset(shuffle=True)``: the orders they
  stage, for a staging budget of ``--budget-shards`` shards (by default the bytes WebDataset
  holds: in each worker its buffer and the shard it reads; 44 shards for the defaults). The sampler's order is the rank's; the iterable's batches come from one
  worker each, as WebDataset's do.

No server is involved: mixing is a property of the order, which no public API exposes apart
from a data set on a store, so the s5loader side imports the private
``s5loader._sampling`` modules (the same functions the sampler and the iterable call).

    .venv/bin/python bench/shard_mixing.py [--shards 60] [--per-shard 100] [--workers 4]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
import tempfile
from collections.abc import Sequence

SPANS = (64, 256)


def write_shards(folder: str, n_shards: int, per_shard: int) -> list[str]:
    paths = []
    for s in range(n_shards):
        path = os.path.join(folder, f"shard-{s:06d}.tar")
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for j in range(per_shard):
                for field, data in (("cls", str(s).encode()), ("bin", bytes(64))):
                    info = tarfile.TarInfo(f"c{s:04d}-{j:05d}.{field}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def mixing(batches: Sequence[Sequence[int]]) -> dict[str, float]:
    """Distinct shards per span of consecutive samples (the stream the loader yields), and in
    the first batch."""
    stream = [s for b in batches for s in b]
    out: dict[str, float] = {}
    for span in SPANS:
        runs = [stream[a : a + span] for a in range(0, len(stream) - span + 1, span)] or [stream]
        out[f"per_{span}"] = sum(len(set(r)) for r in runs) / len(runs)
    out["first_batch"] = float(len(set(batches[0]))) if batches else 0.0
    return out


def webdataset_batches(paths: list[str], workers: int, batch: int, buffer: int, seed: int) -> list[list[int]]:
    import webdataset as wds
    from torch.utils.data import DataLoader

    ds = wds.WebDataset(paths, shardshuffle=len(paths), seed=seed, empty_check=False).shuffle(buffer)
    loader = DataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=lambda b: [int(x["cls"]) for x in b])
    return [list(b) for b in loader]


def s5loader_batches(n_shards: int, per_shard: int, workers: int, batch: int, budget_shards: int, seed: int,
                     iterable: bool, sample_bytes: int = 0) -> tuple[list[list[int]], int]:
    from s5loader._sampling.order import Order, open_shards
    from s5loader._shards.dataset import ShardSet
    from s5loader._shards.index import Shard
    from s5loader.config import Access

    n = n_shards * per_shard
    units = [list(range(s * per_shard, (s + 1) * per_shard)) for s in range(n_shards)]
    order = Order(True, seed, 1, 0, False)
    if not iterable:
        window = open_shards(budget_shards, 1, n_shards, n_shards)
        idx = order.shard_order(n, 0, 0, units, window)
        return [[i // per_shard for i in idx[a : a + batch]] for a in range(0, len(idx), batch)], window
    # the rank stages one order within the whole budget; its workers take turns along it
    window = open_shards(budget_shards, 1, n_shards, n_shards)
    # sample_bytes: the samples read are freed, as on a file system that punches holes
    # (S5IterableDataset's cost, for shards of per_shard samples of that size)
    cost = None
    if sample_bytes:
        size = per_shard * sample_bytes
        shards = ShardSet([Shard(f"s3://b/{s}.tar", size, "", per_shard) for s in range(n_shards)], Access())
        cost = shards.order_cost(size)
    idx = order.shard_order(n, 0, 0, units, window, cost=cost)
    parts = [idx[w::workers] for w in range(workers)]
    # the DataLoader takes one batch from each worker in turn
    per_worker = [[[i // per_shard for i in p[a : a + batch]] for a in range(0, len(p), batch)] for p in parts]
    out: list[list[int]] = []
    for k in range(max(map(len, per_worker))):
        out += [bs[k] for bs in per_worker if k < len(bs)]
    return out, window


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/shard_mixing.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=60)
    p.add_argument("--per-shard", type=int, default=100)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--buffer", type=int, default=1000, help="WebDataset's shuffle buffer (samples)")
    p.add_argument("--budget-shards", type=int, default=0,
                   help="s5loader's staging budget in shards (default: what WebDataset holds, its buffer "
                        "and the shard it reads, in each worker)")
    p.add_argument("--sample-bytes", type=int, default=100_000,
                   help="the samples' size for the iterable's order, which opens shards as the bytes of samples "
                        "read are freed (default 100000: 10 MB shards of 100 samples)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    budget = args.budget_shards or args.workers * (-(-args.buffer // args.per_shard) + 1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="s5loader-mixing-") as d:
        paths = write_shards(d, args.shards, args.per_shard)
        wds_b = webdataset_batches(paths, args.workers, args.batch, args.buffer, args.seed)
        rows.append((f"webdataset, shardshuffle + shuffle({args.buffer}), {args.workers} workers", mixing(wds_b)))
    for iterable, sample_bytes in ((False, 0), (True, 0), (True, args.sample_bytes)):
        b, window = s5loader_batches(args.shards, args.per_shard, args.workers, args.batch, budget, args.seed,
                                     iterable, sample_bytes)
        name = (f"S5IterableDataset, shuffle=True, {args.workers} workers, {window} open shard(s) each"
                if iterable else f"S5Sampler, shuffle=True, {window} open shards")
        if iterable:
            name += (f", {sample_bytes // 1000} KB samples freed as read (more shards open as room frees)"
                     if sample_bytes else ", samples not freed as read (a file system without hole punching)")
        rows.append((name, mixing(b)))
    print(f"{args.shards} class-sorted shards x {args.per_shard} samples; batch {args.batch}; "
          f"s5loader budget: {budget} shards\n")
    print("| order | distinct shards per 64 | per 256 | in the first batch |")
    print("|---|---:|---:|---:|")
    for name, m in rows:
        print(f"| {name} | {m['per_64']:.1f} | {m['per_256']:.1f} | {m['first_batch']:.0f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "budget_shards": budget, "rows": [{"order": n, **m} for n, m in rows]}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
