"""Building a wids shard index (``s5loader index-shards``): each shard's samples counted from
its tar headers with one streamed GET (a gzip-compressed shard decompressed as it streams by,
for the size of its tar too), and the index written next to the shards, where an index already
there is replaced only when asked (:func:`refuse_existing`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._s3api.client import s3_client
from .._s3api.errors import boto3_error
from .._s5cmd import ObjectInfo
from .._util.uri import parse_s3_uri
from ..config import Access
from ..exceptions import ConfigError
from . import tar as _tar
from .index import DEFAULT_INDEX, PACK_RECORD, Shard, format_index, read_bytes
from .source import resolve

log = logging.getLogger(__name__)


def refuse_existing(where: str, access: Access | str | None) -> None:
    """Refuse to replace the index at ``where``: another index may hold what a new one would
    not (``s5loader pack``'s holds each shard's MD5 and the record that finishes its reruns).

    Raises:
        ConfigError: there is one; names it, what wrote it, and ``--force``.
    """
    body = read_bytes(where, access)
    if body is None:
        return
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        doc = None
    what = ""
    if isinstance(doc, dict) and isinstance(doc.get(PACK_RECORD), dict):
        what = (
            " (s5loader pack wrote it, with each shard's MD5; S5Dataset.from_shards reads it as it is, "
            "and a new one would have no MD5s)"
        )
    raise ConfigError(
        f"{where} already exists{what}; pass --force (overwrite=True) to replace it, or --output "
        "to write the index elsewhere"
    )


def write_index(data: bytes, where: str, access: Access | str | None) -> None:
    if not where.startswith("s3://"):
        with open(where, "wb") as fh:
            fh.write(data)
        return
    u = parse_s3_uri(where)
    try:
        s3_client(access).put_object(Bucket=u.bucket, Key=u.key, Body=data)
    except Exception as exc:
        raise boto3_error(exc, where) from exc


class _Body:
    """A streamed GET body as the file object tarfile's stream mode reads."""

    def __init__(self, body: Any) -> None:
        self._body = body

    def read(self, n: int = -1) -> bytes:
        return bytes(self._body.read(n if n is not None and n >= 0 else None))


def count_samples(obj: ObjectInfo, access: Access | str | None, client: Any = None) -> tuple[int, int]:
    """The number of samples in one shard, read with one streamed GET (headers are parsed,
    data is skipped as it streams by; memory stays small), and for a gzip-compressed shard
    the size of its tar (else 0).

    Raises:
        ShardError, UnsafeArchiveError: the shard is not a readable tar (names it and the member).
    """
    u = parse_s3_uri(obj.uri)
    client = client or s3_client(access)
    try:
        body = client.get_object(Bucket=u.bucket, Key=u.key)["Body"]
    except Exception as exc:
        raise boto3_error(exc, obj.uri) from exc
    try:
        if _tar.is_gzip(obj.uri):
            samples, tarsize = _tar.scan_gzip(_Body(body), obj.uri)
            return len(samples), tarsize
        return len(_tar.scan(_Body(body), obj.size, obj.uri, stream=True)), 0
    finally:
        body.close()


def build_index(
    source: str | Sequence[str],
    access: Access | str | None,
    output: str | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    jobs: int = 8,
    overwrite: bool = False,
) -> tuple[str, list[Shard]]:
    """Count the samples of every shard of ``source`` and write the wids shard list to
    ``output`` (an s3 URI or a local path; default ``FOLDER/wids.json`` next to the shards).

    Args:
        progress: called with (shards done, shards in all, bytes read) after each shard.
        jobs: shards read at once.
        overwrite: replace an index already at ``output``; else that is refused, before any
            shard is read.

    Returns:
        Where the index went, and the shards with their counts.

    Raises:
        ConfigError: an index is at ``output`` already, and not ``overwrite``.
    """
    objects, folder = resolve(source, access)
    where = output or folder + DEFAULT_INDEX
    if not overwrite:
        refuse_existing(where, access)
    client = s3_client(access)
    done = nbytes = 0
    counts: list[tuple[int, int]] = []

    def one(o: ObjectInfo) -> tuple[int, int]:
        return count_samples(o, access, client)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for o, n in zip(objects, pool.map(one, objects), strict=True):
            counts.append(n)
            done += 1
            nbytes += o.size
            if progress is not None:
                progress(done, len(objects), nbytes)
    shards = [Shard(o.uri, o.size, o.etag, n, t) for o, (n, t) in zip(objects, counts, strict=True)]
    name = source if isinstance(source, str) else folder
    write_index(format_index(shards, where, name), where, access)
    log.info(
        "indexed %d shards (%d samples) of %s into %s",
        len(shards),
        sum(s.nsamples for s in shards),
        name,
        where,
    )
    return where, shards
