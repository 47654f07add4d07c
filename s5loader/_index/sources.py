"""The sample indexes behind :class:`~s5loader.S5Dataset`'s constructors: a prefix listed, object
URIs read with a HEAD each, a manifest, or an index file that :meth:`S5Dataset.save_index
<s5loader.S5Dataset.save_index>` wrote (and the saving of one to S3)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from .._s3api.client import s3_client
from .._s3api.errors import boto3_error
from .._s5cmd import S5cmd
from .._util.uri import as_folder, parse_s3_uri
from ..config import Access
from ..exceptions import ConfigError, S3URIError
from . import saved as _indexfile
from .compact import SampleIndex
from .labels import check_label, folder_labels, warn_grouping
from .listing import index_objects, index_prefix
from .manifest import index_manifest
from .sample import check_group_by
from .share import shared_index


def labelled(
    index: SampleIndex, label: str | None, base: str | None, source: str, group_by: str
) -> SampleIndex:
    """``index`` with an int ``"label"`` per sample for ``label="folder"`` (the folders below
    ``base``); warns where the grouping looks wrong for the keys."""
    warn_grouping(index, group_by, source)
    if label == "folder":
        index, _ = folder_labels(index, base, source)
    return index


def prefix_index(
    prefix: str, access: Access | None, endpoint_url: str | None, group_by: str, label: str | None
) -> tuple[SampleIndex, Access]:
    """The labelled index of every object under ``prefix`` (see :meth:`S5Dataset.from_prefix
    <s5loader.S5Dataset.from_prefix>`), listed by one process of the job, and the store."""
    check_group_by(group_by)
    check_label(label)
    if label is not None and group_by == "folder":
        raise ConfigError(
            f"label='folder' with group_by='folder' would make each class folder under {prefix} "
            "one sample; use group_by='object' (one image, one sample) or 'stem'"
        )
    # A prefix names a folder: "s3://b/train" never reads the siblings train-old/ or trainval/.
    prefix = as_folder(prefix)
    uri = parse_s3_uri(prefix)
    store = Access.coerce(access, endpoint_url)
    index = shared_index(
        lambda: index_prefix(prefix, S5cmd(access=store), group_by),
        ["prefix", prefix, store.endpoint(), group_by],
    )
    return labelled(index, label, uri.key, prefix, group_by), store


def objects_index(
    uris: Iterable[str], access: Access | None, endpoint_url: str | None, group_by: str, label: str | None
) -> tuple[SampleIndex, Access]:
    """The labelled index of the given object URIs (one HEAD each), built by one process, and
    the store."""
    check_group_by(group_by)
    check_label(label)
    uris = list(uris)
    for u in uris:
        if not parse_s3_uri(u).key:
            raise S3URIError(f"{u!r} names a bucket, not an object")
    digest = hashlib.sha256("\n".join(uris).encode("utf-8", "surrogatepass")).hexdigest()
    store = Access.coerce(access, endpoint_url)
    samples = shared_index(
        lambda: index_objects(uris, store, group_by),
        ["objects", digest, store.endpoint(), group_by],
    )
    return labelled(samples, label, None, "the object list", group_by), store


def manifest_index(
    path_or_uri: str, access: Access | None, endpoint_url: str | None, group_by: str, label: str | None
) -> tuple[SampleIndex, Access]:
    """The labelled index of the objects a JSON Lines manifest lists, read by one process, and
    the store."""
    check_group_by(group_by)
    check_label(label)
    store = Access.coerce(access, endpoint_url)
    samples = shared_index(
        lambda: index_manifest(path_or_uri, store, group_by),
        ["manifest", path_or_uri, store.endpoint(), group_by],
    )
    return labelled(samples, label, None, path_or_uri, group_by), store


def load_index(path_or_uri: str, store: Access) -> SampleIndex:
    """The index an index file holds (a local path or an s3 URI)."""
    if path_or_uri.startswith("s3://"):
        return _indexfile.loads(read_object(path_or_uri, store), path_or_uri)
    return _indexfile.load(path_or_uri)


def save_index(index: SampleIndex, path_or_uri: str, store: Access) -> None:
    """Write ``index`` to an index file (a local path or an s3 URI)."""
    data = _indexfile.index_bytes(index)
    if not path_or_uri.startswith("s3://"):
        _indexfile.save(index, path_or_uri)
        return
    u = parse_s3_uri(path_or_uri)
    client = s3_client(store)
    try:
        client.put_object(Bucket=u.bucket, Key=u.key, Body=data)
    except Exception as exc:
        raise boto3_error(exc, path_or_uri) from exc


def read_object(uri: str, access: Access | str | None) -> bytes:
    """The bytes of one object."""
    u = parse_s3_uri(uri)
    try:
        return bytes(s3_client(access).get_object(Bucket=u.bucket, Key=u.key)["Body"].read())
    except Exception as exc:
        raise boto3_error(exc, uri) from exc
