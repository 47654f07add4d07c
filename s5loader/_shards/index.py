"""Where the shards and their sample counts come from: a source (an s3 prefix of ``*.tar`` and
gzip-compressed ``*.tar.gz``/``*.tgz``, a list of URIs, or a WebDataset brace pattern) and a
wids-style JSON shard list, which ``s5loader index-shards`` builds by reading each shard's tar
headers.

The shard list is webdataset's indexed format (``wids``)::

    {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": ...,
     "shardlist": [{"url": "shard-000000.tar", "nsamples": 1000, "filesize": 10485760}, ...]}

A ``url`` is an s3 URI or a path relative to the folder that holds the index. A compressed
shard's entry also gives ``"tarsize"``, the size of its tar (s5loader's own key: staging the
shard takes both).
"""

from __future__ import annotations

import json
import logging
import posixpath
from collections.abc import Sequence
from typing import Any, NamedTuple

from .._s3api.client import s3_client
from .._s3api.errors import boto3_error
from .._util.uri import GZIP_TAR, parse_s3_uri
from ..config import Access
from ..exceptions import ObjectNotFoundError, ShardIndexError
from .source import expand_braces as expand_braces
from .source import folder_of, resolve

log = logging.getLogger(__name__)

WIDS_KIND = "wids-shard-index-v1"
DEFAULT_INDEX = "wids.json"
PACK_RECORD = "s5loader_pack"  # s5loader pack's key in the indexes it writes: its plan (see _pack/state.py)


class Shard(NamedTuple):
    """One shard: its URI, size, ETag and number of samples; for a gzip-compressed shard
    (``.tar.gz``, ``.tgz``) also the size of its tar (``tarsize``, 0 for a plain tar)."""

    uri: str
    size: int
    etag: str
    nsamples: int
    tarsize: int = 0

    @property
    def disk(self) -> int:
        """The most bytes the shard takes when staged: a compressed shard and its tar lie
        side by side while it is decompressed."""
        return self.size + self.tarsize


# -- the shard list ---------------------------------------------------------------------
def parse_index(data: bytes, where: str) -> dict[str, int]:
    """``{shard URI: nsamples}`` from a wids JSON shard list; relative URLs are resolved
    against the folder of ``where`` (the index's own URI or path).

    Raises:
        ShardIndexError: not JSON, no ``shardlist``, or a bad entry (named by position).
    """
    return {uri: n for uri, (n, _) in parse_entries(data, where).items()}


def parse_entries(data: bytes, where: str) -> dict[str, tuple[int, int]]:
    """``{shard URI: (nsamples, tarsize)}`` from a wids JSON shard list, as :func:`parse_index`;
    ``tarsize`` (s5loader's own key: the decompressed size of a compressed shard) is 0 where
    an entry has none."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ShardIndexError(f"the shard index {where} is not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("shardlist"), list):
        raise ShardIndexError(
            f"the shard index {where} has no 'shardlist' list (a wids shard index is expected)"
        )
    kind = doc.get("__kind__", WIDS_KIND)
    if kind != WIDS_KIND:
        raise ShardIndexError(f"the shard index {where} is a {kind!r}, not a {WIDS_KIND!r}")
    base = folder_of(where) if where.startswith("s3://") else ""
    extra = doc.get("base")
    if isinstance(extra, str) and extra and (extra.startswith("s3://") or "://" not in extra):
        # widsindex's "base": the folder relative URLs are below (an s3 URL, or relative to
        # the index); a base of another scheme names where someone else keeps a copy
        base = _join(base, extra.rstrip("/") + "/", where, "base")
    out: dict[str, tuple[int, int]] = {}
    for i, entry in enumerate(doc["shardlist"]):
        url = entry.get("url") if isinstance(entry, dict) else None
        n = entry.get("nsamples") if isinstance(entry, dict) else None
        if not isinstance(url, str) or not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ShardIndexError(
                f"the shard index {where}: entry {i} needs a 'url' string and an int 'nsamples' >= 0, "
                f"got {entry!r}"
            )
        t = entry.get("tarsize", 0)
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ShardIndexError(
                f"the shard index {where}: entry {i} has a 'tarsize' that is not an int >= 0: {t!r}"
            )
        out[_join(base, url, where, f"entry {i}")] = (n, t)
    return out


def index_meta(data: bytes) -> dict[str, Any]:
    """What an index says of its shards beyond the list (empty where it says nothing, or is no
    JSON object): ``shuffled`` (``s5loader pack --shuffle`` wrote them: their samples are mixed
    across shards) and ``classes`` (the class names of the int labels, ``pack --label folder``)."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(doc, dict):
        return {}
    out: dict[str, Any] = {}
    record = doc.get(PACK_RECORD)
    options = record.get("options") if isinstance(record, dict) else None
    if isinstance(options, dict) and options.get("shuffle") is True:
        out["shuffled"] = True
    classes = doc.get("classes")
    if isinstance(classes, list) and all(isinstance(c, str) for c in classes) and classes:
        out["classes"] = list(classes)
    return out


def _join(base: str, url: str, where: str, what: str) -> str:
    """``url`` resolved against the s3 folder ``base`` as wids does (``./`` and ``..``
    folded). Refused: a relative URL that leaves its bucket or has no s3 folder to resolve
    against, and an s3:// URL with a ``.`` or ``..`` component (S3 would take it literally,
    wids would not).
    """
    if url.startswith("s3://"):
        bucket, _, key = url[5:].partition("/")
        if any(p in (".", "..") for p in key.split("/")):
            raise ShardIndexError(
                f"the shard index {where}: {what} ({url!r}) has a '.' or '..' component; refused"
            )
        return url
    if not base:
        raise ShardIndexError(
            f"the shard index {where}: {what} has the relative URL {url!r}; a local index needs s3:// URLs"
        )
    if url.startswith("/"):
        raise ShardIndexError(
            f"the shard index {where}: {what} has the absolute path {url!r}; use an s3:// URL"
        )
    bucket, _, key = base[5:].partition("/")
    depth = 0
    for p in (key + url).split("/"):
        depth += -1 if p == ".." else 0 if p in ("", ".") else 1
        if depth < 0:
            raise ShardIndexError(
                f"the shard index {where}: {what} ({url!r}) leads outside the bucket s3://{bucket}/"
            )
    folded = posixpath.normpath(key + url)
    return f"s3://{bucket}/{folded}" + ("/" if url.endswith("/") and folded != "." else "")


def format_index(shards: Sequence[Shard], index_uri: str, name: str = "") -> bytes:
    """A wids JSON shard list; URLs below the index's folder are written relative to it."""
    base = folder_of(index_uri) if index_uri.startswith("s3://") else ""
    entries = []
    for s in shards:
        url = s.uri[len(base) :] if base and s.uri.startswith(base) else s.uri
        entry: dict[str, Any] = {"url": url, "nsamples": s.nsamples, "filesize": s.size}
        if s.tarsize:
            entry["tarsize"] = s.tarsize  # a compressed shard's tar: what staging it takes beside it
        entries.append(entry)
    doc = {"__kind__": WIDS_KIND, "wids_version": 1, "name": name, "shardlist": entries}
    return (json.dumps(doc, indent=1) + "\n").encode()


def read_index(where: str, access: Access | str | None) -> dict[str, tuple[int, int]] | None:
    """The shard list at an s3 URI or a local path (as :func:`parse_entries`); None when
    there is none."""
    body = read_bytes(where, access)
    return None if body is None else parse_entries(body, where)


def read_bytes(where: str, access: Access | str | None) -> bytes | None:
    """The bytes of the file at an s3 URI or a local path; None when there is none."""
    if not where.startswith("s3://"):
        try:
            with open(where, "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None
    u = parse_s3_uri(where)
    try:
        return bytes(s3_client(access).get_object(Bucket=u.bucket, Key=u.key)["Body"].read())
    except Exception as exc:
        err = boto3_error(exc, where)
        if isinstance(err, ObjectNotFoundError):
            return None
        raise err from exc


def load_shards(
    source: str | Sequence[str], index: str | None, access: Access | str | None
) -> tuple[list[Shard], str, dict[str, Any]]:
    """The shards of ``source`` with their sample counts from ``index`` (else the default
    index next to the shards), the index's location, and what else it says (:func:`index_meta`).

    Raises:
        ShardIndexError: no index, or one that lacks a shard; the message says to run
            ``s5loader index-shards SOURCE``.
    """
    objects, folder = resolve(source, access)
    where = index or folder + DEFAULT_INDEX
    body = read_bytes(where, access)
    counts = None if body is None else parse_entries(body, where)
    hint = f"build one with: s5loader index-shards {_quote_source(source)}"
    if counts is None:
        raise ShardIndexError(
            f"no shard index at {where}: {hint}" + ("" if index else " (or pass index=...)")
        )
    shards = []
    for o in objects:
        if o.uri not in counts:
            raise ShardIndexError(f"the shard index {where} does not list {o.uri}: {hint}")
        n, tarsize = counts[o.uri]
        if o.uri.endswith(GZIP_TAR) and not tarsize and n:
            raise ShardIndexError(
                f"{o.uri} is a gzip-compressed shard, and the shard index {where} does not give "
                f"the size of its tar (the 'tarsize' that staging it needs): {hint}"
            )
        shards.append(Shard(o.uri, o.size, o.etag, n, tarsize))
    return shards, where, index_meta(body or b"")


def _quote_source(source: str | Sequence[str]) -> str:
    if isinstance(source, str):
        return f"'{source}'" if "{" in source else source
    return " ".join(source)
