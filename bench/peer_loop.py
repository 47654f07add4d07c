#!/usr/bin/env python3
"""One loader's epochs over the side-by-side data set of ``bench/peers.py``, in a process of its
own: run by the main virtual environment for s5loader, and by ``.venv-peers`` (``make bench``
builds it) for litdata and MosaicML streaming, whose requirements would replace the main
environment's botocore and numpy.

Each loader is set up as its documentation says, reads ``--epochs`` shuffled epochs (batch
``--batch``, ``--workers`` DataLoader workers), and every sample is checked: its bytes are the
ones ``bench/peers.py`` wrote for its key, and each key comes once an epoch. One JSON line per
epoch on stdout: samples, seconds, samples/s, the first batch, and CPU seconds split into this
process (``main``) and its children (DataLoader workers, s5cmd), taken from ``os.times()``
around the epoch (the workers end with it and are reaped).

    python bench/peer_loop.py KIND --endpoint URL --bucket data --samples N --size BYTES \\
        --cache DIR [--epochs 2] [--batch 32] [--workers 2] [--seed 0]

KIND: s5loader-raw, s5loader-raw-block, s5loader-shards, s5loader-iterable, litdata-raw,
litdata-shards, mosaic-shards; or convert-s5loader, convert-litdata, convert-mds (``raw/`` into
each one's shards).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

KINDS = (
    "s5loader-raw",
    "s5loader-raw-block",
    "s5loader-shards",
    "s5loader-iterable",
    "litdata-raw",
    "litdata-shards",
    "mosaic-shards",
)


def sample_bytes(i: int, size: int) -> bytes:
    """What ``bench/peers.py`` writes for sample ``i``: its own number's digest, repeated."""
    seed = hashlib.sha256(str(i).encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def key_number(key: str) -> int:
    """``raw/000012.bin``, ``000012`` or ``s3://data/raw/000012.bin`` -> 12."""
    return int(os.path.basename(key).split(".", 1)[0])


def collate(batch: list[Any]) -> list[Any]:
    return batch


def collate_items(batch: list[dict[str, Any]]) -> list[tuple[str, bytes]]:
    """A batch of litdata's or MosaicML's items as (key, bytes), in the worker: litdata gives a
    ``bytes`` field as a memoryview, which cannot cross to the training process."""
    return [(x["key"], bytes(x["data"])) for x in batch]


class Checker:
    """Counts an epoch's samples and checks each (its bytes, once an epoch)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.seen: set[int] = set()
        self.bytes = 0

    def add(self, key: str, data: bytes) -> None:
        i = key_number(key)
        if i in self.seen:
            raise RuntimeError(f"sample {key!r} came twice in one epoch")
        if data != sample_bytes(i, self.size):
            raise RuntimeError(f"sample {key!r} has other bytes than were written")
        self.seen.add(i)
        self.bytes += len(data)


def cpu() -> tuple[float, float]:
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system


# -- the loaders: each returns (start epoch e -> an iterable of batches of (key, bytes)) ------
Loader = Callable[[int], Iterable[list[tuple[str, bytes]]]]


def s5loader_loader(a: argparse.Namespace, kind: str) -> tuple[Loader, Callable[[], None]]:
    from torch.utils.data import DataLoader

    from s5loader import S5Dataset, S5IterableDataset, S5Sampler

    bucket = f"s3://{a.bucket}"
    if kind.startswith("s5loader-raw"):
        ds = S5Dataset.from_prefix(
            f"{bucket}/raw/",
            endpoint_url=a.endpoint,
            group_by="object",
            transform=lambda x: (x["__key__"], x["data"]),
        )
    else:
        ds = S5Dataset.from_shards(
            f"{bucket}/s5shards/", endpoint_url=a.endpoint, transform=lambda x: (x["__key__"], x["bin"])
        )
    if kind == "s5loader-iterable":
        it = S5IterableDataset(
            ds, shuffle=True, seed=a.seed, staging_dir=a.cache, batch_size=a.batch, epoch_cache=ds.total_bytes
        )

        def epoch_iterable(e: int) -> Iterable[list[tuple[str, bytes]]]:
            it.set_epoch(e)
            return DataLoader(it, batch_size=a.batch, num_workers=a.workers, collate_fn=collate)

        return epoch_iterable, it.close
    shuffle: bool | str = "block" if kind == "s5loader-raw-block" else True
    sampler = S5Sampler(ds, shuffle=shuffle, seed=a.seed, staging_dir=a.cache, epoch_cache=ds.total_bytes)

    def epoch_sampler(e: int) -> Iterable[list[tuple[str, bytes]]]:
        sampler.set_epoch(e)
        return DataLoader(ds, sampler=sampler, batch_size=a.batch, num_workers=a.workers, collate_fn=collate)

    return epoch_sampler, sampler.close


def _litdata_over_http() -> None:
    """litdata reads through obstore, which refuses a plain-http endpoint unless told (forked
    DataLoader workers inherit this)."""
    from litdata.streaming import downloader

    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(options, dict):
        options["allow_http"] = "true"


def litdata_loader(a: argparse.Namespace, kind: str) -> tuple[Loader, Callable[[], None]]:
    import litdata

    _litdata_over_http()
    options = {"endpoint_url": a.endpoint}
    if kind == "litdata-raw":
        raw = litdata.StreamingRawDataset(
            f"s3://{a.bucket}/raw/", cache_dir=a.cache, storage_options=options, cache_files=True
        )
        keys = [f.path for f in raw.items]

        class Keyed:  # the raw data set gives bytes; its items' paths name them
            def __len__(self) -> int:
                return len(raw)

            def __getitem__(self, i: int) -> tuple[str, bytes]:
                return keys[i], raw[i]

            def __getitems__(self, idx: list[int]) -> list[tuple[str, bytes]]:
                return list(zip([keys[i] for i in idx], raw.__getitems__(idx), strict=True))

        keyed = Keyed()

        def epoch_raw(e: int) -> Iterable[list[tuple[str, bytes]]]:
            import torch
            from torch.utils.data import DataLoader

            g = torch.Generator().manual_seed(a.seed + e)
            return DataLoader(  # type: ignore[call-overload]
                keyed,
                batch_size=a.batch,
                num_workers=a.workers,
                shuffle=True,
                generator=g,
                collate_fn=collate,
            )

        return epoch_raw, lambda: None
    ds = litdata.StreamingDataset(
        f"s3://{a.bucket}/litdata/",
        cache_dir=a.cache,
        shuffle=True,
        seed=a.seed,
        max_cache_size="100GB",  # holds the data set: epoch 2 reads local chunks
        storage_options=options,
    )

    def epoch_shards(e: int) -> Iterable[list[tuple[str, bytes]]]:
        ds.set_epoch(e + 1)
        return litdata.StreamingDataLoader(
            ds, batch_size=a.batch, num_workers=a.workers, collate_fn=collate_items
        )

    return epoch_shards, lambda: None


def mosaic_loader(a: argparse.Namespace, kind: str) -> tuple[Loader, Callable[[], None]]:
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader

    os.environ["S3_ENDPOINT_URL"] = a.endpoint  # how MosaicML's boto3 client reaches another store
    ds = StreamingDataset(
        remote=f"s3://{a.bucket}/mds/", local=a.cache, shuffle=True, shuffle_seed=a.seed, batch_size=a.batch
    )

    def epoch_mds(e: int) -> Iterable[list[tuple[str, bytes]]]:
        return DataLoader(ds, batch_size=a.batch, num_workers=a.workers, collate_fn=collate_items)

    return epoch_mds, lambda: None


# -- the conversions: raw/ into each loader's shards, timed by the caller -----------------------
def _client(a: argparse.Namespace) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=a.endpoint, region_name="us-east-1")


_CLIENT: Any = None


def _litdata_item(item: tuple[str, str]) -> dict[str, Any]:
    """One sample for litdata's ``optimize``: fetched here, in its worker (as its docs do)."""
    global _CLIENT
    import boto3

    bucket, key = item
    if _CLIENT is None:
        _CLIENT = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
    return {"key": key, "data": _CLIENT.get_object(Bucket=bucket, Key=key)["Body"].read()}


def convert(a: argparse.Namespace) -> None:
    """Convert ``raw/`` into ``s5shards/`` (``s5loader.pack``), ``litdata/`` (``optimize``) or
    ``mds/`` (``MDSWriter``, 16 threads fetching), chunks of ``--shard-bytes``; timed by the
    caller as a whole process, each alike (its interpreter's start and imports included)."""
    keys = [f"raw/{i:06d}.bin" for i in range(a.samples)]
    if a.kind == "convert-s5loader":
        import s5loader

        s5loader.pack(
            f"s3://{a.bucket}/raw/",
            f"s3://{a.bucket}/s5shards/",
            shard_size=a.shard_bytes,
            staging_dir=a.cache,
            endpoint_url=a.endpoint,
        )
        return
    if a.kind == "convert-litdata":
        import litdata

        _litdata_over_http()
        os.environ["AWS_ENDPOINT_URL"] = a.endpoint  # the workers' own clients
        os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = os.path.join(a.cache, "chunks")
        os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] = os.path.join(a.cache, "data")
        litdata.optimize(
            fn=_litdata_item,
            inputs=[(a.bucket, k) for k in keys],
            output_dir=f"s3://{a.bucket}/litdata/",
            chunk_bytes=a.shard_bytes,
            num_workers=os.cpu_count() or 1,
            storage_options={"endpoint_url": a.endpoint},
            mode="overwrite",
        )
        return
    from concurrent.futures import ThreadPoolExecutor

    from streaming import MDSWriter

    os.environ["S3_ENDPOINT_URL"] = a.endpoint
    c = _client(a)
    out = (os.path.join(a.cache, "mds"), f"s3://{a.bucket}/mds/")
    with (
        MDSWriter(out=out, columns={"key": "str", "data": "bytes"}, size_limit=a.shard_bytes) as w,
        ThreadPoolExecutor(16) as pool,
    ):
        for key, data in zip(
            keys, pool.map(lambda k: c.get_object(Bucket=a.bucket, Key=k)["Body"].read(), keys), strict=True
        ):
            w.write({"key": key, "data": data})


def run(a: argparse.Namespace) -> None:
    make = s5loader_loader if a.kind.startswith("s5loader") else litdata_loader
    make = mosaic_loader if a.kind.startswith("mosaic") else make
    t0 = time.perf_counter()
    loader, close = make(a, a.kind)
    setup_s = time.perf_counter() - t0
    try:
        for e in range(a.epochs):
            check = Checker(a.size)
            main0, kids0 = cpu()
            t = time.perf_counter()
            first = None
            it: Any = iter(loader(e))
            for batch in it:
                if first is None:
                    first = time.perf_counter() - t
                for key, data in batch:
                    check.add(key, bytes(data))
            it = None  # the workers end, and are reaped
            seconds = time.perf_counter() - t
            main1, kids1 = cpu()
            if len(check.seen) != a.samples:
                raise RuntimeError(f"epoch {e}: {len(check.seen)} of {a.samples} samples")
            line = {
                "kind": a.kind,
                "epoch": e + 1,
                "samples": len(check.seen),
                "seconds": round(seconds, 3),
                "samples_per_s": round(len(check.seen) / seconds, 1),
                "first_batch_s": round(first or 0.0, 3),
                "setup_s": round(setup_s, 3) if e == 0 else 0.0,
                "cpu_main_s": round(main1 - main0, 3),
                "cpu_children_s": round(kids1 - kids0, 3),
            }
            print(json.dumps(line), flush=True)
    finally:
        close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("kind", choices=(*KINDS, "convert-s5loader", "convert-litdata", "convert-mds"))
    p.add_argument("--endpoint", required=True)
    p.add_argument("--bucket", default="data")
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--cache", required=True, help="the loader's local cache or staging directory")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-bytes", type=int, default=64 * 1024 * 1024, help="conversions: chunk size")
    a = p.parse_args(argv)
    if a.kind.startswith("convert-"):
        convert(a)
    else:
        run(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
