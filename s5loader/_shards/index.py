"""Where the shards and their sample counts come from: a source (an s3 prefix of ``*.tar`` and
gzip-compressed ``*.tar.gz``/``*.tgz``, a list of URIs, or a WebDataset brace pattern) and a wids-style JSON shard list, which
``s5loader index-shards`` builds by reading each shard's tar headers.

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
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from .._index.listing import list_prefix, stat_objects
from .._s3api.client import s3_client
from .._s3api.errors import boto3_error
from .._util.uri import COMPRESSED_TAR, GZIP_TAR, SHARD_SUFFIXES, as_folder, parse_s3_uri
from ..config import Access
from ..exceptions import (
    ConfigError,
    EmptySourceError,
    ObjectNotFoundError,
    S5LoaderError,
    ShardError,
    ShardIndexError,
)
from ..s5cmd import ObjectInfo, S5cmd

log = logging.getLogger(__name__)

WIDS_KIND = "wids-shard-index-v1"
DEFAULT_INDEX = "wids.json"
PACK_RECORD = "s5loader_pack"  # s5loader pack's key in the indexes it writes: its plan (see _pack/state.py)

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)")


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


def expand_braces(pattern: str) -> list[str]:
    """Expand WebDataset brace notation: ``shard-{000..002}.tar`` (zero padding kept),
    ``{a,b}``; several braces multiply.

    Raises:
        ConfigError: an empty or reversed range.
    """
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    head, tail, body = pattern[: m.start()], pattern[m.end() :], m[1]
    r = _RANGE.fullmatch(body)
    if r is not None:
        lo, hi = int(r[1]), int(r[2])
        if hi < lo:
            raise ConfigError(f"the range {{{body}}} in {pattern!r} runs backwards")
        width = len(r[1]) if r[1].lstrip("-").startswith("0") else 0
        choices = [f"{i:0{width}d}" for i in range(lo, hi + 1)]
    else:
        choices = body.split(",")
    return [head + c + rest for c in choices for rest in expand_braces(tail)]


def _refuse_compressed(uri: str) -> None:
    """A shard compressed other than with gzip is named as such before anything else is said
    about it (its index, its listing): no later step could read it."""
    if uri.endswith(COMPRESSED_TAR) and not uri.endswith(GZIP_TAR):
        raise ShardError(
            f"{uri} is a compressed tar shard that s5loader cannot read; it reads .tar and "
            f"gzip-compressed .tar.gz/.tgz shards: decompress it (zstd -d, xz -d, ...) into a "
            f".tar or recompress it with gzip, then run s5loader index-shards on those"
        )


def _folder(uri: str) -> str:
    return uri[: uri.rfind("/") + 1]


def resolve(source: str | Sequence[str], access: Access | str | None) -> tuple[list[ObjectInfo], str]:
    """The shards a source names, with sizes and ETags, and the folder for its default index.

    Args:
        source: ``s3://b/train/`` (every ``*.tar``, ``*.tar.gz`` and ``*.tgz`` below it, in key order), a brace pattern
            (``s3://b/train/shard-{000000..000999}.tar``, in pattern order), one shard URI,
            or a list of shard URIs (in list order).

    Raises:
        S3URIError, EmptySourceError, ObjectNotFoundError (a shard the pattern or list
        names does not exist), and the listing's errors.
    """
    if not isinstance(source, str):
        uris = [str(u) for u in source]
        if not uris:
            raise EmptySourceError("the shard list is empty")
        for u in uris:
            parse_s3_uri(u)
            _refuse_compressed(u)
        folders = {_folder(u) for u in uris}
        folder = folders.pop() if len(folders) == 1 else _folder(posixpath.commonprefix(uris))
        return stat_objects(uris, access), folder
    parse_s3_uri(source)
    _refuse_compressed(source)
    if "{" in source:
        uris = expand_braces(source)
        for u in uris:
            _refuse_compressed(u)
        literal = source[: source.index("{")]
        try:
            found = {o.uri: o for o in list_prefix(literal, S5cmd(access=Access.coerce(access)))}
        except EmptySourceError:
            found = {}
        missing = [u for u in uris if u not in found]
        if missing:
            raise ObjectNotFoundError(
                f"{missing[0]}: no such shard ({len(missing)} of the {len(uris)} shards {source} names are missing)"
            )
        return [found[u] for u in uris], _folder(literal)
    if source.endswith(SHARD_SUFFIXES):
        return stat_objects([source], access), _folder(source)
    given, source = source, as_folder(source)  # a prefix names a folder, never its siblings
    try:
        listed = list_prefix(source, S5cmd(access=Access.coerce(access)))
    except EmptySourceError:
        if given != source and _is_object(given, access):
            raise ShardError(
                f"{given} is an object, not a tar shard (a .tar) nor a folder of them: name its "
                "shards, a brace pattern of them, or their folder"
            ) from None
        raise
    objects = sorted((o for o in listed if o.key.endswith(SHARD_SUFFIXES)), key=lambda o: o.key)
    if not objects:
        packed = [o.uri for o in listed if o.key.endswith(COMPRESSED_TAR)]
        if packed:
            raise EmptySourceError(
                f"no *.tar or *.tar.gz shard under {source}, only other compressed ones such as "
                f"{packed[0]}; s5loader reads .tar and gzip-compressed .tar.gz/.tgz shards"
            )
        raise EmptySourceError(f"no *.tar or *.tar.gz shard under {source}")
    return objects, _folder(source)


def _is_object(uri: str, access: Access | str | None) -> bool:
    try:
        stat_objects([uri], access)
    except S5LoaderError:
        return False
    return True


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
        raise ShardIndexError(f"the shard index {where} has no 'shardlist' list (a wids shard index is expected)")
    kind = doc.get("__kind__", WIDS_KIND)
    if kind != WIDS_KIND:
        raise ShardIndexError(f"the shard index {where} is a {kind!r}, not a {WIDS_KIND!r}")
    base = _folder(where) if where.startswith("s3://") else ""
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
                f"the shard index {where}: entry {i} needs a 'url' string and an int 'nsamples' >= 0, got {entry!r}"
            )
        t = entry.get("tarsize", 0)
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ShardIndexError(f"the shard index {where}: entry {i} has a 'tarsize' that is not an int >= 0: {t!r}")
        out[_join(base, url, where, f"entry {i}")] = (n, t)
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
            raise ShardIndexError(f"the shard index {where}: {what} ({url!r}) has a '.' or '..' component; refused")
        return url
    if not base:
        raise ShardIndexError(f"the shard index {where}: {what} has the relative URL {url!r}; a local index needs s3:// URLs")
    if url.startswith("/"):
        raise ShardIndexError(f"the shard index {where}: {what} has the absolute path {url!r}; use an s3:// URL")
    bucket, _, key = base[5:].partition("/")
    depth = 0
    for p in (key + url).split("/"):
        depth += -1 if p == ".." else 0 if p in ("", ".") else 1
        if depth < 0:
            raise ShardIndexError(f"the shard index {where}: {what} ({url!r}) leads outside the bucket s3://{bucket}/")
    folded = posixpath.normpath(key + url)
    return f"s3://{bucket}/{folded}" + ("/" if url.endswith("/") and folded != "." else "")


def format_index(shards: Sequence[Shard], index_uri: str, name: str = "") -> bytes:
    """A wids JSON shard list; URLs below the index's folder are written relative to it."""
    base = _folder(index_uri) if index_uri.startswith("s3://") else ""
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
) -> tuple[list[Shard], str]:
    """The shards of ``source`` with their sample counts from ``index`` (else the default
    index next to the shards), and the index's location.

    Raises:
        ShardIndexError: no index, or one that lacks a shard; the message says to run
            ``s5loader index-shards SOURCE``.
    """
    objects, folder = resolve(source, access)
    where = index or folder + DEFAULT_INDEX
    counts = read_index(where, access)
    hint = f"build one with: s5loader index-shards {_quote_source(source)}"
    if counts is None:
        raise ShardIndexError(f"no shard index at {where}: {hint}" + ("" if index else " (or pass index=...)"))
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
    return shards, where


def _quote_source(source: str | Sequence[str]) -> str:
    if isinstance(source, str):
        return f"'{source}'" if "{" in source else source
    return " ".join(source)
