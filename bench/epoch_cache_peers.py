#!/usr/bin/env python3
"""What a cache of the same size saves per epoch under a per-epoch shuffle: s5loader's epoch
cache beside litdata's ``max_cache_size``.

The same ``--samples`` samples of ``--size`` bytes are written twice to a local SeaweedFS: as raw
objects (``NNNNNN.image`` + ``.label``) for s5loader, and with ``litdata.optimize`` into chunks of
``--chunk-bytes`` for litdata's ``StreamingDataset``. Each reads ``--epochs`` shuffled epochs
(``set_epoch``) with a cache of half the data set and one of the whole data set, through the
request-counting proxy of ``s5loader_bench/proxy.py``; the figure compared is the bytes each
epoch fetched from S3 as a share of the first epoch's (s5loader: bytes staged; litdata: chunk
GETs times the chunk size, every chunk but the last being full). Request latency plays no part
in these counts, so the proxy adds none.

litdata reads with ``num_workers=0``: its obstore downloader is built with client options
that refuse a plain-http endpoint, which this script patches in the process that downloads
(DataLoader workers start their own). MosaicML streaming is not run: installing it here would
replace the torch and numpy this environment is built on.

    PYTHONPATH=.:bench .venv/bin/python bench/epoch_cache_peers.py [--samples 600] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any

import boto3
from torch.utils.data import DataLoader

from s5loader import S5Dataset, S5Sampler
from s5loader.testing import SeaweedFS
from s5loader_bench.proxy import ProxyProcess

CREDS = {"aws_access_key_id": "x", "aws_secret_access_key": "x", "region_name": "us-east-1"}


def _item(i: int) -> dict[str, Any]:
    return {"image": i.to_bytes(4, "little") * (SIZE // 4), "label": i % 10}


SIZE = 32768


def collate(batch: list[Any]) -> int:
    return len(batch)


def run_s5loader(proxy: ProxyProcess, root: str, epochs: int) -> dict[str, list[float]]:
    ds = S5Dataset.from_prefix("s3://data/raw/", endpoint_url=proxy.endpoint)
    out = {}
    for name, frac in (("half", 0.5), ("all", 1.0)):
        staging = os.path.join(root, f"s5l-{name}")
        os.makedirs(staging)
        fetched = []
        with S5Sampler(
            ds,
            budget=ds.total_bytes // 8,
            epoch_cache=int(ds.total_bytes * frac),
            staging_dir=staging,
            seed=1,
        ) as sampler:
            for e in range(epochs):
                sampler.set_epoch(e)
                sum(DataLoader(ds, sampler=sampler, batch_size=32, num_workers=2, collate_fn=collate))
                fetched.append(sampler.metrics().fetched_bytes)
        out[name] = [round(f / fetched[0], 3) for f in fetched]
        print("s5loader", name, out[name], flush=True)
    return out


def run_litdata(proxy: ProxyProcess, root: str, epochs: int, total: int) -> dict[str, list[float]]:
    import litdata.streaming.downloader as ldd
    from litdata import StreamingDataset

    ldd._OBSTORE_CLIENT_OPTIONS["allow_http"] = True  # type: ignore[index]  # a plain-http local endpoint
    out = {}
    for name, frac in (("half", 0.5), ("all", 1.0)):
        ds = StreamingDataset(
            "s3://data/ld/",
            cache_dir=os.path.join(root, f"ld-{name}"),
            shuffle=True,
            seed=1,
            max_cache_size=int(total * frac),
            storage_options={"endpoint_url": proxy.endpoint, **CREDS},
        )
        gets = []
        for e in range(epochs):
            ds.set_epoch(e + 1)
            before = proxy.counts()["GET"]
            sum(1 for _ in DataLoader(ds, batch_size=None, num_workers=0))
            gets.append(proxy.counts()["GET"] - before)
        out[name] = [round(g / gets[0], 3) for g in gets]
        print("litdata", name, gets, out[name], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from litdata import optimize

    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--samples", type=int, default=600)
    p.add_argument("--chunk-bytes", default="1MB")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "x")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "x")
    root = tempfile.mkdtemp(prefix="s5l-peers-", dir="/tmp")
    try:
        local = os.path.join(root, "litdata")
        optimize(
            fn=_item,
            inputs=list(range(args.samples)),
            output_dir=local,
            chunk_bytes=args.chunk_bytes,
            num_workers=1,
            verbose=False,
        )
        with SeaweedFS(os.path.join(root, "weed"), ("data",)) as weed:
            s3 = boto3.client("s3", endpoint_url=weed.endpoint, **CREDS)
            for i in range(args.samples):
                item = _item(i)
                s3.put_object(Bucket="data", Key=f"raw/{i:06d}.image", Body=item["image"])
                s3.put_object(Bucket="data", Key=f"raw/{i:06d}.label", Body=str(item["label"]).encode())
            for f in os.listdir(local):
                s3.upload_file(os.path.join(local, f), "data", f"ld/{f}")
            chunks = [f for f in os.listdir(local) if f.endswith(".bin")]
            total = sum(os.path.getsize(os.path.join(local, f)) for f in chunks)
            with ProxyProcess(weed.endpoint, 0) as proxy:
                result = {
                    "samples": args.samples,
                    "size": SIZE,
                    "chunks": len(chunks),
                    "chunk_bytes": args.chunk_bytes,
                    "s5loader": run_s5loader(proxy, root, args.epochs),
                    "litdata": run_litdata(proxy, root, args.epochs, total),
                }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
