"""The shards a source names: a folder (every ``*.tar``, ``*.tar.gz`` and ``*.tgz`` below it), a
WebDataset brace pattern, one shard or a list of them, with sizes and ETags (:func:`resolve`).
A source that names no shard says what exists near it: the keys beside an empty folder, the
objects of a folder that holds no shard, the keys nearest by name to a shard that is missing."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence

from .._index.listing import list_prefix, stat_objects
from .._index.near import closest_beside, keys_beside
from .._s3api.client import s3_client
from .._s3api.errors import boto3_error
from .._s5cmd import ObjectInfo, S5cmd
from .._util.uri import COMPRESSED_TAR, GZIP_TAR, SHARD_SUFFIXES, as_folder, parse_s3_uri
from ..config import Access
from ..exceptions import (
    ConfigError,
    EmptySourceError,
    NoSuchBucketError,
    ObjectNotFoundError,
    S5LoaderError,
    ShardError,
)

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)")
NEAR = 3  # keys a hint names


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


def folder_of(uri: str) -> str:
    """The folder of ``uri`` (up to its last slash)."""
    return uri[: uri.rfind("/") + 1]


def resolve(source: str | Sequence[str], access: Access | str | None) -> tuple[list[ObjectInfo], str]:
    """The shards a source names, with sizes and ETags, and the folder for its default index.

    Args:
        source: ``s3://b/train/`` (every ``*.tar``, ``*.tar.gz`` and ``*.tgz`` below it, in
            key order), a brace pattern (``s3://b/train/shard-{000000..000999}.tar``, in
            pattern order), one shard URI, or a list of shard URIs (in list order).

    Raises:
        S3URIError, EmptySourceError, ObjectNotFoundError (a shard the pattern or list
        names does not exist), and the listing's errors.
    """
    if not isinstance(source, str):
        return _from_list([str(u) for u in source], access)
    parse_s3_uri(source)
    _refuse_compressed(source)
    if "{" in source:
        return _from_pattern(source, access)
    if source.endswith(SHARD_SUFFIXES):
        return [_stat(source, access)], folder_of(source)
    return _from_folder(source, access)


def _from_list(uris: list[str], access: Access | str | None) -> tuple[list[ObjectInfo], str]:
    """The shards of a list of URIs, each looked up; the folder they share."""
    if not uris:
        raise EmptySourceError("the shard list is empty")
    for u in uris:
        parse_s3_uri(u)
        _refuse_compressed(u)
    folders = {folder_of(u) for u in uris}
    folder = folders.pop() if len(folders) == 1 else folder_of(posixpath.commonprefix(uris))
    return [_stat(u, access) for u in uris], folder


def _from_pattern(source: str, access: Access | str | None) -> tuple[list[ObjectInfo], str]:
    """The shards a brace pattern names, in pattern order, found by listing the prefix before
    its first brace.

    Raises:
        ObjectNotFoundError: a shard the pattern names is missing.
    """
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
        near = _near(missing[0], access, [o for u, o in found.items() if u not in uris] or None)
        raise ObjectNotFoundError(
            f"{missing[0]}: no such shard ({len(missing)} of the {len(uris)} shards {source} names are "
            f"missing){near}"
        )
    return [found[u] for u in uris], folder_of(literal)


def _from_folder(source: str, access: Access | str | None) -> tuple[list[ObjectInfo], str]:
    """The shards listed under a folder, in key order.

    Raises:
        ShardError: ``source`` is an object that is no shard.
        EmptySourceError: no shard under the folder; the message says what is there or beside.
    """
    given, source = source, as_folder(source)  # a prefix names a folder, never its siblings
    try:
        listed = list_prefix(source, S5cmd(access=Access.coerce(access)))
    except EmptySourceError:
        if given != source and _is_object(given, access):
            raise ShardError(
                f"{given} is an object, not a tar shard (a .tar) nor a folder of them: name its "
                "shards, a brace pattern of them, or their folder"
            ) from None
        where = parse_s3_uri(source)
        beside = keys_beside(where.bucket, where.key, access, NEAR)
        if not beside:
            near = closest_beside(where.bucket, where.key, access)
            if not near:
                raise
            raise EmptySourceError(f"no object under {source}; did you mean {' or '.join(near)}?") from None
        why = (
            f"a prefix names a folder, so {given} reads only {source}, not the keys beside it"
            if given != source
            else "beside it are keys"
        )
        raise EmptySourceError(
            f"no object under {source}; {why} such as {', '.join(beside)}: name the folder they are in "
            f"({folder_of(beside[0])}), a brace pattern of the shards, or a list of them"
        ) from None
    objects = sorted((o for o in listed if o.key.endswith(SHARD_SUFFIXES)), key=lambda o: o.key)
    if not objects:
        packed = [o.uri for o in listed if o.key.endswith(COMPRESSED_TAR)]
        if packed:
            raise EmptySourceError(
                f"no *.tar or *.tar.gz shard under {source}, only other compressed ones such as "
                f"{packed[0]}; s5loader reads .tar and gzip-compressed .tar.gz/.tgz shards"
            )
        some = ", ".join(o.uri for o in listed[:NEAR])
        raise EmptySourceError(
            f"no *.tar or *.tar.gz shard under {source}: it holds {len(listed)} other object(s), "
            f"such as {some}. Shards are tar files of samples (s5loader pack writes them from objects "
            "like these); S5Dataset.from_prefix reads the objects themselves"
        )
    return objects, folder_of(source)


def _is_object(uri: str, access: Access | str | None) -> bool:
    try:
        stat_objects([uri], access)
    except S5LoaderError:
        return False
    return True


def _stat(uri: str, access: Access | str | None) -> ObjectInfo:
    """One shard's size and ETag (a HEAD); a missing one says what exists near it."""
    try:
        return stat_objects([uri], access)[0]
    except ObjectNotFoundError as exc:
        raise ObjectNotFoundError(f"{uri}: no such shard{_near(uri, access)}") from exc


def _near(uri: str, access: Access | str | None, listed: Sequence[ObjectInfo] | None = None) -> str:
    """What exists near the missing shard ``uri``, for the end of its message: the keys nearest
    to it by name among ``listed``, else among its folder's first 1000 (one LIST); that its
    folder is empty; or that its bucket does not exist (a HEAD cannot tell).

    Raises:
        NoSuchBucketError: the bucket of ``uri`` does not exist.
    """
    u = parse_s3_uri(uri)
    folder = u.key[: u.key.rfind("/") + 1]
    if listed is None:
        a = Access.coerce(access)
        try:
            found = (
                s3_client(a).list_objects_v2(Bucket=u.bucket, Prefix=folder, MaxKeys=1000).get("Contents", [])
            )
        except Exception as exc:  # noqa: BLE001 - botocore's errors, mapped; only the bucket's matters here
            if isinstance(boto3_error(exc, uri, a.endpoint()), NoSuchBucketError):
                raise boto3_error(exc, uri, a.endpoint()) from exc
            return ""
        keys = [o["Key"] for o in found]
    else:
        keys = [o.key for o in listed]
    if not keys:
        return f"; nothing exists under s3://{u.bucket}/{folder}"
    nearest = sorted(keys, key=lambda k: (-len(posixpath.commonprefix([k, u.key])), k))[:NEAR]
    return f"; the keys nearest to it by name: {', '.join(f's3://{u.bucket}/{k}' for k in nearest)}"
