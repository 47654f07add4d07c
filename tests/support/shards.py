"""Tar shards for the tests: made in memory, uploaded with their wids index, and the requests
and leftovers the shard tests look at."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
from collections import Counter

from torch.utils.data import DataLoader

from s5loader import S5Dataset, S5Sampler
from s5loader._shards import index as _shards
from s5loader._shards import indexing as _indexing
from s5loader._shards import tar as _tar
from support.stores import Store


def sample_bytes(i: int, size: int = 300) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (size // 32 + 1)


def tar_of(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_shards(
    n_shards: int, per_shard: int, size: int = 300
) -> tuple[dict[str, bytes], dict[str, dict[str, bytes]]]:
    """``{shard name: tar bytes}`` and the expected samples ``{key: {field: bytes}}``."""
    shards, expected = {}, {}
    k = 0
    for s in range(n_shards):
        members = []
        for _ in range(per_shard):
            key = f"s{k:05d}"
            fields = {"bin": sample_bytes(k, size), "cls": str(k % 7).encode()}
            expected[key] = fields
            members += [(f"{key}.{f}", v) for f, v in fields.items()]
            k += 1
        shards[f"shard-{s:03d}.tar"] = tar_of(members)
    return shards, expected


def put_indexed(store: Store, shards: dict[str, bytes]) -> str:
    """Upload the shards and their index; returns the source prefix."""
    store.put(shards)
    _indexing.build_index(store.uri(), store.endpoint)
    return store.uri()


def class_sorted_shards(
    store: Store, n_shards: int = 8, per_shard: int = 25, size: int = 2000
) -> tuple[str, dict[str, bytes], int]:
    """Shards of one class each (the class is the shard number), samples of ``size`` bytes;
    returns the source, the shards, and the largest shard's size."""
    shards = {
        f"shard-{s:03d}.tar": tar_of(
            [
                (f"c{s}-{j:03d}.{f}", data)
                for j in range(per_shard)
                for f, data in (("bin", sample_bytes(s * 1000 + j, size)), ("cls", b"%d" % s))
            ]
        )
        for s in range(n_shards)
    }
    return put_indexed(store, shards), shards, max(map(len, shards.values()))


def shard_gets(requests: list) -> Counter:  # type: ignore[type-arg]
    """GETs per shard name among a proxy's requests."""
    return Counter(
        path.split("?")[0].rsplit("/", 1)[-1]
        for method, path, _ in requests
        if method == "GET" and path.split("?")[0].endswith(".tar")
    )


def leftovers(path: str) -> list[str]:
    """The files left below ``path`` but the engine's control files."""
    out = []
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d not in (".calls",)]
        out += [os.path.join(root, f) for f in files if f not in (".lock", ".released")]
    return out


def load_all(ds: S5Dataset, sampler: S5Sampler, workers: int = 2) -> list[dict]:
    """Every sample the sampler orders, read through a DataLoader with `workers` workers."""
    loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=workers, collate_fn=lambda b: b)
    return [x for b in loader for x in b]


def put_indexed_with(store: Store, shards: dict[str, bytes], counts: dict[str, int]) -> str:
    """Upload shards (some unreadable) with an index that gives ``counts`` for the bad ones."""
    store.put(shards)
    listed = []
    for name, data in shards.items():
        n = counts.get(name)
        if n is None:
            n = len(_tar.scan_bytes(data, name))
        listed.append(_shards.Shard(store.uri(name), len(data), "", n))
    store.put({"wids.json": _shards.format_index(listed, store.uri("wids.json"))})
    return store.uri()


def gzip_shards(
    store: Store, n_shards: int = 6, per_shard: int = 10
) -> tuple[str, dict[str, bytes], dict[str, dict[str, bytes]]]:
    """Class-sorted shards, gzip-compressed, named .tar.gz and .tgz by turns, and indexed."""
    shards: dict[str, bytes] = {}
    expected: dict[str, dict[str, bytes]] = {}
    for s in range(n_shards):
        members = []
        for j in range(per_shard):
            key = f"c{s}-{j:03d}"
            fields = {"bin": sample_bytes(s * 1000 + j, 3000), "cls": b"%d" % s}
            expected[key] = fields
            members += [(f"{key}.{f}", v) for f, v in fields.items()]
        shards[f"shard-{s:03d}.{'tgz' if s % 2 else 'tar.gz'}"] = gzip.compress(tar_of(members), mtime=0)
    return put_indexed(store, shards), shards, expected


# A consumer process for the daemon tests: one JSON line per sample, its files' SHA-256.
CONSUMER = """
import hashlib, json, sys
from s5loader.consume import consume
with open(sys.argv[2], "a") as out:
    for s in consume(sys.argv[1], timeout=60):
        files = {k: hashlib.sha256(open(p, "rb").read()).hexdigest() for k, p in s.files.items()}
        out.write(json.dumps({"name": s.name, "files": files}) + "\\n")
        out.flush()
"""
