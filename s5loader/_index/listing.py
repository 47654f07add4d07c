"""Listing: the objects under a prefix (one streamed ``s5cmd ls``, listed again after a
transient failure), or the sizes of given URIs (one HEAD each), grouped into samples (``stem``,
``folder`` or ``object``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .._s3api.client import s3_client
from .._s3api.errors import boto3_error
from .._s5cmd import ObjectInfo, S5cmd
from .._s5cmd.process import _GlobInPrefix
from .._util.uri import parse_s3_uri
from ..config import Access
from ..exceptions import (
    EmptySourceError,
    FetchError,
)
from ..progress import Progress
from .builder import IndexBuilder
from .compact import SampleIndex
from .near import beside_hint

log = logging.getLogger(__name__)


def group(
    objects: Iterable[ObjectInfo],
    group_by: str,
    base: str = "",
    extras: dict[str, dict[str, Any]] | None = None,
    source: str = "",
) -> SampleIndex:
    """Group objects into samples, sorted by sample key, then by field name.

    Args:
        objects: the objects, in any order.
        group_by: ``stem`` (``0001.jpg`` + ``0001.cls``), ``folder`` (one sub-folder per sample)
            or ``object`` (one object per sample).
        base: the listed key prefix; ``folder`` samples are its sub-folders. Empty for
            object lists, where a sample is the folder an object lies in.
        extras: extra fields per object URI (from a manifest), merged into its sample.
        source: what was listed, for messages.

    Raises:
        ConfigError: a sample would have the same field twice.
    """
    builder = IndexBuilder(group_by, base=base, source=source)
    for obj in objects:
        builder.add(obj.uri, obj.key, obj.size, obj.etag, extras.get(obj.uri) if extras else None)
    return builder.build()


LIST_ATTEMPTS = 4
_PAGE = 1000  # keys per LIST response (the S3 maximum, which s5cmd asks for)
_PROGRESS_DELAY = 1.0  # seconds of listing before its progress shows


@dataclass
class _Listing:
    """One attempt at listing a prefix: the builder the objects go to, how many came and how
    they were listed."""

    builder: IndexBuilder
    progress: Progress
    seen: int = 0
    how: str = "s5cmd ls"

    def add(self, objects: Iterable[ObjectInfo]) -> None:
        """Add ``objects`` (each with ``uri``, ``key``, ``size``, ``etag``) to the builder,
        counting them on the progress line a page at a time."""
        for obj in objects:
            self.builder.add(obj.uri, obj.key, obj.size, obj.etag)
            self.seen += 1
            if not self.seen % _PAGE:
                self.progress.set(self.seen)


def index_prefix(prefix: str, s5cmd: S5cmd, group_by: str) -> SampleIndex:
    """List the objects under ``s3://bucket/prefix`` with ``s5cmd ls`` and group them, reading
    the listing as it streams in. A listing that fails on a transient error (the store
    dropped the connection, a 5xx after s5cmd's own retries) starts again, up to
    ``LIST_ATTEMPTS`` times with a growing pause.

    Raises:
        S3URIError, NoSuchBucketError, AccessDeniedError, EndpointError, EmptySourceError
        FetchError: the listing kept failing; the message names the prefix and why.
    """
    uri = parse_s3_uri(prefix)
    start = time.monotonic()
    # A large listing shows a counter on a terminal, a log line every few seconds elsewhere;
    # one that takes under a second shows nothing.
    progress = Progress(f"listing {prefix}", delay=_PROGRESS_DELAY, logger=log, final_line=False)
    with progress:
        for attempt in range(1, LIST_ATTEMPTS + 1):
            listing = _Listing(IndexBuilder(group_by, base=uri.key, source=prefix, listing=True), progress)
            try:
                try:
                    listing.add(s5cmd.list(str(uri)))
                except _GlobInPrefix:
                    listing.how = "the S3 API (s5cmd ls reads '*?[' in a prefix as wildcards)"
                    listing.add(_list_boto3(uri.bucket, uri.key, s5cmd.settings))
            except EmptySourceError:
                pass  # told below, with the keys beside an empty folder
            except FetchError as exc:
                if attempt == LIST_ATTEMPTS:
                    raise FetchError(f"cannot list {prefix} ({attempt} attempts): {exc}") from exc
                delay = 0.5 * 2 ** (attempt - 1)
                progress.clear()
                log.warning(
                    "listing %s failed after %d object(s) (%s); listing again in %.1fs",
                    prefix,
                    listing.seen,
                    exc,
                    delay,
                )
                time.sleep(delay)
                continue
            break
        progress.set(listing.seen)
    seen = listing.seen
    if not seen:
        raise EmptySourceError(f"no object under {prefix}{beside_hint(uri.bucket, uri.key, s5cmd.settings)}")
    listed = time.monotonic() - start
    index = listing.builder.build()
    log.info(
        "listed %s with %s: %d objects in %.1fs (%d attempt(s), about %d LIST requests), "
        "%d samples indexed in %.1fs",
        prefix,
        listing.how,
        seen,
        listed,
        attempt,
        attempt - 1 + max(1, -(-seen // _PAGE)),
        len(index),
        time.monotonic() - start - listed,
    )
    return index


def list_prefix(prefix: str, s5cmd: S5cmd) -> list[ObjectInfo]:
    """Every object under ``s3://bucket/prefix``, ungrouped (for :mod:`s5loader.fetch`).

    Raises:
        S3URIError, NoSuchBucketError, AccessDeniedError, EndpointError, EmptySourceError
    """
    uri = parse_s3_uri(prefix)
    try:
        objects = list(s5cmd.list(str(uri)))
    except _GlobInPrefix:
        objects = list(_list_boto3(uri.bucket, uri.key, s5cmd.settings))
    if not objects:
        raise EmptySourceError(f"no object under {prefix}")
    return objects


def index_objects(uris: Sequence[str], access: Access | str | None, group_by: str) -> SampleIndex:
    """The given objects (one HEAD each for sizes and ETags), grouped."""
    return group(stat_objects(uris, access), group_by, source="the object list")


def _list_boto3(bucket: str, prefix: str, access: Access | str | None) -> Iterator[ObjectInfo]:
    # s5cmd's ls reads '*', '?' and '[' in a prefix as wildcards; list such a prefix by API.
    a = Access.coerce(access)
    client = s3_client(a)
    api = "list_objects" if a.list_objects_v1 else "list_objects_v2"
    try:
        for page in client.get_paginator(api).paginate(Bucket=bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                yield ObjectInfo(f"s3://{bucket}/{o['Key']}", o["Key"], o["Size"], o["ETag"].strip('"'))
    except Exception as exc:  # botocore's errors: map them to ours
        raise boto3_error(exc, f"s3://{bucket}/{prefix}") from exc


def stat_objects(uris: Sequence[str], access: Access | str | None) -> list[ObjectInfo]:
    """Sizes and ETags of individual objects, one HEAD each (for manifests without sizes).

    Raises:
        ObjectNotFoundError, AccessDeniedError, NoSuchBucketError, EndpointError
    """
    client = s3_client(access)
    out = []
    for uri in uris:
        u = parse_s3_uri(uri)
        try:
            head = client.head_object(Bucket=u.bucket, Key=u.key)
        except Exception as exc:
            raise boto3_error(exc, uri) from exc
        out.append(ObjectInfo(uri, u.key, int(head["ContentLength"]), head.get("ETag", "").strip('"')))
    return out
