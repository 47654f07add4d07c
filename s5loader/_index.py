"""Where the sample index comes from: listing a prefix, reading a manifest or taking a list of
URIs, then grouping objects into samples (``stem``, ``folder`` or ``object``)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from ._s5cmd import ObjectInfo, S5cmd, _GlobInPrefix, resolve_endpoint
from ._uri import parse_s3_uri
from .exceptions import (
    AccessDeniedError,
    ConfigError,
    EmptySourceError,
    EndpointError,
    FetchError,
    ManifestError,
    NoSuchBucketError,
    ObjectNotFoundError,
    S5LoaderError,
)

log = logging.getLogger(__name__)

GROUP_BY = ("stem", "folder", "object")
LABELS = ("folder",)
# A grouping that puts more objects than this into a sample on average is probably a
# folder-per-class layout grouped by folder (an ImageFolder read with group_by="folder").
_MANY_FIELDS = 20


class Field(NamedTuple):
    """One object of a sample: the field name, its URI, size and ETag."""

    name: str
    uri: str
    size: int
    etag: str


class Sample(NamedTuple):
    """One sample: its key, its objects and the extra fields a manifest carried."""

    key: str
    fields: tuple[Field, ...]
    extra: dict[str, Any] | None = None

    @property
    def size(self) -> int:
        return sum(f.size for f in self.fields)


def check_group_by(group_by: str) -> str:
    if group_by not in GROUP_BY:
        raise ConfigError(f"group_by must be one of {', '.join(GROUP_BY)}; got {group_by!r}")
    return group_by


def check_label(label: str | None) -> str | None:
    if label is not None and label not in LABELS:
        raise ConfigError(f"label must be None or one of {', '.join(LABELS)}; got {label!r}")
    return label


def folder_labels(samples: list[Sample], base: str | None, source: str = "") -> tuple[list[Sample], list[str]]:
    """Label each sample with its class folder, as torchvision's ``ImageFolder`` does.

    The class of a sample is the first folder below ``base`` on its key (``train/cat/1.jpg``
    under ``train/`` is ``cat``), or, for object lists and manifests (``base`` None), the
    folder that holds it. Classes are the sorted folder names; each sample gets
    ``"label"``, the class's index, among its extra fields. Samples without a class folder
    are left out with a warning (``ImageFolder`` ignores files beside the class folders).

    Returns:
        the labelled samples and the classes.

    Raises:
        ConfigError: a sample already has a field or manifest key named ``label``.
    """
    names: list[str | None] = []
    for s in samples:
        path = s.key
        if base is not None:
            rel = path[len(base):] if path.startswith(base) else path
            cls, slash, _ = rel.partition("/")
            names.append(cls if slash and cls else None)
        else:
            head, slash, _ = path.rpartition("/")
            names.append(head.rpartition("/")[2] if slash and head else None)
    classes = sorted({n for n in names if n is not None})
    class_to_idx = {c: i for i, c in enumerate(classes)}
    out: list[Sample] = []
    left_out = [s.key for s, n in zip(samples, names, strict=True) if n is None]
    for s, n in zip(samples, names, strict=True):
        if n is None:
            continue
        if any(f.name == "label" for f in s.fields) or (s.extra and "label" in s.extra):
            raise ConfigError(
                f"sample {s.key!r} ({s.fields[0].uri}) already has a field 'label'; "
                "label='folder' would hide it (leave label=None and read it yourself)"
            )
        out.append(s._replace(extra={**(s.extra or {}), "label": class_to_idx[n]}))
    if left_out:
        log.warning(
            "label='folder' left out %d sample(s) of %s that lie in no class folder, e.g. %s",
            len(left_out), source or "the source", ", ".join(left_out[:3]),
        )
    return out, classes


def _warn_grouping(samples: list[Sample], n_objects: int, group_by: str, source: str) -> None:
    """Warn about groupings that are most likely not what the layout wants."""
    if samples and n_objects >= 2 * _MANY_FIELDS and n_objects > _MANY_FIELDS * len(samples):
        log.warning(
            "group_by=%r made %d sample(s) of %d objects in %s (%.0f objects per sample): if the "
            "folders are classes (an ImageFolder layout, train/<class>/<image>), use "
            "group_by='object', label='folder'",
            group_by, len(samples), n_objects, source or "the source", n_objects / len(samples),
        )
    if group_by != "stem":
        return
    counts: dict[str, int] = {}
    for s in samples:
        for f in s.fields:
            counts[f.name] = counts.get(f.name, 0) + 1
    if any(n != n.lower() for n in counts) and any(n == n.lower() and n.upper() != n for n in counts):
        log.warning(
            "group_by='stem' names fields by extension, case included, and %s mixes cases: %s; a "
            "sample has only the field of its own extension, so read e.g. sample.get('jpg') or "
            "sample.get('JPEG'), or use group_by='object' (field 'data')",
            source or "the source", ", ".join(f"{n!r} ({c})" for n, c in sorted(counts.items())),
        )


def group(
    objects: Iterable[ObjectInfo],
    group_by: str,
    base: str = "",
    extras: dict[str, dict[str, Any]] | None = None,
    source: str = "",
) -> list[Sample]:
    """Group objects into samples, sorted by sample key.

    Args:
        objects: the objects, in any order.
        group_by: ``stem`` (``0001.jpg`` + ``0001.cls``), ``folder`` (one sub-folder per sample)
            or ``object`` (one object per sample).
        base: the listed key prefix; ``folder`` samples are its sub-folders. Empty for
            object lists, where a sample is the folder an object lies in.
        extras: extra fields per object URI (from a manifest), merged into its sample.
        source: what was listed, for messages.
    """
    check_group_by(group_by)
    n_objects = 0
    groups: dict[tuple[str, str], list[Field]] = {}
    sample_extra: dict[tuple[str, str], dict[str, Any]] = {}
    skipped: list[str] = []
    for obj in objects:
        if obj.key.endswith("/") and obj.size == 0:
            continue  # a "directory marker", not data
        n_objects += 1
        bucket = obj.uri[5:].split("/", 1)[0]
        if group_by == "object":
            skey, field = obj.key, "data"
        elif group_by == "stem":
            head, _, base_name = obj.key.rpartition("/")
            stem, dot, ext = base_name.partition(".")
            if not dot or not stem or not ext:
                skipped.append(obj.uri)
                continue
            skey, field = (f"{head}/{stem}" if head else stem), ext
        else:
            rel = obj.key[len(base):] if base and obj.key.startswith(base) else obj.key
            if base:
                folder, slash, field = rel.partition("/")
                if not slash or not field:
                    skipped.append(obj.uri)
                    continue
                skey = base + folder
            else:
                skey, slash, field = obj.key.rpartition("/")
                if not slash:
                    skipped.append(obj.uri)
                    continue
        gkey = (bucket, skey)
        groups.setdefault(gkey, []).append(Field(field, obj.uri, obj.size, obj.etag))
        if extras and obj.uri in extras:
            sample_extra.setdefault(gkey, {}).update(extras[obj.uri])
    if skipped:
        why = {
            "stem": "no extension to name a field (expected NAME.FIELD)",
            "folder": "not inside a sub-folder",
        }[group_by]
        log.warning(
            "group_by=%r left out %d object(s) of %s with %s, e.g. %s",
            group_by, len(skipped), source or "the source", why, ", ".join(skipped[:3]),
        )
    buckets = {b for b, _ in groups}
    samples = []
    for gkey in sorted(groups):
        fields = tuple(sorted(groups[gkey]))
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ConfigError(
                f"sample {gkey[1]!r} has the field {dup!r} twice "
                f"({', '.join(f.uri for f in fields if f.name == dup)}); use another group_by"
            )
        key = gkey[1] if len(buckets) == 1 else f"{gkey[0]}/{gkey[1]}"
        samples.append(Sample(key, fields, sample_extra.get(gkey)))
    _warn_grouping(samples, n_objects, group_by, source)
    return samples


def list_prefix(prefix: str, s5cmd: S5cmd) -> list[ObjectInfo]:
    """List the objects under ``s3://bucket/prefix`` with one ``s5cmd ls``.

    Raises:
        S3URIError, NoSuchBucketError, AccessDeniedError, EndpointError, EmptySourceError
    """
    uri = parse_s3_uri(prefix)
    try:
        objects = list(s5cmd.list(str(uri)))
    except _GlobInPrefix:
        objects = _list_boto3(uri.bucket, uri.key, s5cmd.endpoint_url)
    if not objects:
        raise EmptySourceError(f"no object under {prefix}")
    return objects


def _list_boto3(bucket: str, prefix: str, endpoint_url: str | None) -> list[ObjectInfo]:
    # s5cmd's ls reads '*', '?' and '[' in a prefix as wildcards; list such a prefix by API.
    client = make_boto3_client(endpoint_url)
    out = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                out.append(ObjectInfo(f"s3://{bucket}/{o['Key']}", o["Key"], o["Size"], o["ETag"].strip('"')))
    except Exception as exc:  # botocore's errors: map them to ours
        raise boto3_error(exc, f"s3://{bucket}/{prefix}") from exc
    return out


def stat_objects(uris: Sequence[str], endpoint_url: str | None) -> list[ObjectInfo]:
    """Sizes and ETags of individual objects, one HEAD each (for manifests without sizes).

    Raises:
        ObjectNotFoundError, AccessDeniedError, NoSuchBucketError, EndpointError
    """
    client = make_boto3_client(endpoint_url)
    out = []
    for uri in uris:
        u = parse_s3_uri(uri)
        try:
            head = client.head_object(Bucket=u.bucket, Key=u.key)
        except Exception as exc:
            raise boto3_error(exc, uri) from exc
        out.append(ObjectInfo(uri, u.key, int(head["ContentLength"]), head.get("ETag", "").strip('"')))
    return out


def make_boto3_client(endpoint_url: str | None) -> Any:
    """A boto3 S3 client for the endpoint, with the AWS credential chain."""
    import boto3
    from botocore.config import Config

    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return boto3.session.Session().client(
        "s3",
        endpoint_url=resolve_endpoint(endpoint_url),
        region_name=region,
        config=Config(retries={"max_attempts": 5, "mode": "standard"}, max_pool_connections=64),
    )


def boto3_error(exc: Exception, uri: str) -> S5LoaderError:
    """Map a botocore exception about ``uri`` to one of ours."""
    code = ""
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        code = str(resp.get("Error", {}).get("Code", ""))
    msg = f"{uri}: {code + ': ' if code else ''}{exc}"
    if code == "NoSuchBucket":
        return NoSuchBucketError(msg)
    if code in ("NoSuchKey", "404", "NotFound"):
        return ObjectNotFoundError(msg)
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden"):
        return AccessDeniedError(msg)
    name = type(exc).__name__
    if name == "NoCredentialsError":
        return AccessDeniedError(msg)
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError"):
        return EndpointError(msg)
    return FetchError(msg)


def read_manifest(path_or_uri: str, endpoint_url: str | None) -> tuple[list[str], dict[str, dict[str, Any]], dict[str, ObjectInfo]]:
    """Read a JSON Lines manifest from a local path or an s3 URI.

    Each line is either a JSON string (an object URI) or an object with ``"uri"`` and, where
    known, ``"size"`` and ``"etag"``; any other keys are extra fields carried into the sample.
    Blank lines are ignored.

    Returns:
        the URIs in order, the extra fields per URI, and what the manifest said of sizes.

    Raises:
        ManifestError: a line is not valid; the message names the manifest and the line number.
    """
    text = _read_text(path_or_uri, endpoint_url)
    uris: list[str] = []
    extras: dict[str, dict[str, Any]] = {}
    known: dict[str, ObjectInfo] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{path_or_uri} line {lineno}: not valid JSON ({exc.msg}): {line[:200]!r}") from exc
        if isinstance(rec, str):
            rec = {"uri": rec}
        if not isinstance(rec, dict) or not isinstance(rec.get("uri"), str):
            raise ManifestError(
                f"{path_or_uri} line {lineno}: expected a URI string or an object with a "
                f"'uri' field, got {line[:200]!r}"
            )
        uri = rec.pop("uri")
        try:
            u = parse_s3_uri(uri)
        except S5LoaderError as exc:
            raise ManifestError(f"{path_or_uri} line {lineno}: {exc}") from exc
        if not u.key or u.key.endswith("/"):
            raise ManifestError(f"{path_or_uri} line {lineno}: {uri!r} names no object")
        size, etag = rec.pop("size", None), rec.pop("etag", "")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ManifestError(f"{path_or_uri} line {lineno}: size must be a non-negative int, got {size!r}")
            known[uri] = ObjectInfo(uri, u.key, size, str(etag).strip('"'))
        if uri in extras:
            raise ManifestError(f"{path_or_uri} line {lineno}: {uri} is listed twice")
        uris.append(uri)
        extras[uri] = rec
    if not uris:
        raise EmptySourceError(f"the manifest {path_or_uri} lists no object")
    return uris, extras, known


def _read_text(path_or_uri: str, endpoint_url: str | None) -> str:
    if path_or_uri.startswith("s3://"):
        u = parse_s3_uri(path_or_uri)
        client = make_boto3_client(endpoint_url)
        try:
            body = client.get_object(Bucket=u.bucket, Key=u.key)["Body"].read()
        except Exception as exc:
            raise boto3_error(exc, path_or_uri) from exc
        return body.decode("utf-8")
    try:
        with open(path_or_uri, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ManifestError(f"cannot read the manifest {path_or_uri!r}: {exc.strerror}") from exc

