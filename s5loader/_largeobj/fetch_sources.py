"""Where ``s5loader fetch`` reads from: the objects its sources name (an object, a prefix,
the volumes of a split archive, in natural key order), the file name of each inside the
destination, and the check of each against its ``.md5`` sibling or its ETag."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from typing import Any

from .._index.listing import list_prefix
from .._s3api.client import s3_client
from .._s3api.errors import boto3_error
from .._s5cmd import ObjectInfo, S5cmd
from .._util.uri import parse_s3_uri
from ..config import Access
from ..exceptions import EmptySourceError, ObjectNotFoundError, UnsafeArchiveError
from . import transfer as _transfer
from . import verify as _verify

log = logging.getLogger(__name__)


def is_dir_target(dest: str, uri: str) -> bool:
    return dest.endswith(("/", os.sep)) or os.path.isdir(dest) or uri.endswith("/")


_DIGITS = re.compile(r"(\d+)")


def natural_key(key: str) -> list[Any]:
    """Sort key that orders ``vol2`` before ``vol10``."""
    return [int(t) if t.isdigit() else t for t in _DIGITS.split(key)]


def resolve(
    uris: Sequence[str], s5: S5cmd, access: Access | str | None, skip_md5: bool, verify: bool
) -> tuple[list[ObjectInfo], dict[str, str], dict[str, ObjectInfo]]:
    """The objects to fetch, in order; the file name (relative to DEST) of each, by URI; the
    ``.md5`` objects seen beside them."""
    found: list[tuple[str, ObjectInfo]] = []  # (listing prefix, object)
    for uri in uris:
        u = parse_s3_uri(uri)
        if u.key and not uri.endswith("/"):
            try:
                size, etag = _transfer.head_size(uri, access)
                found.append((uri.rsplit("/", 1)[0] + "/", ObjectInfo(uri, u.key, size, etag)))
            except ObjectNotFoundError:
                pass  # a key prefix, such as the common start of a split archive's volumes
            else:
                if verify:  # its .md5 sibling, which no listing showed
                    try:
                        size, etag = _transfer.head_size(uri + ".md5", access)
                        found.append(
                            (
                                uri.rsplit("/", 1)[0] + "/",
                                ObjectInfo(uri + ".md5", u.key + ".md5", size, etag),
                            )
                        )
                    except ObjectNotFoundError:
                        pass
                continue
        try:
            listed = list_prefix(uri, s5)
        except EmptySourceError as exc:
            raise EmptySourceError(f"no object {uri} and no object under it") from exc
        base = uri if uri.endswith("/") or not u.key else uri.rsplit("/", 1)[0] + "/"
        found += [(base, o) for o in sorted(listed, key=lambda o: natural_key(o.key))]
    keys = {o.uri for _, o in found}
    md5_files = {o.uri: o for _, o in found if o.uri.endswith(".md5") and o.uri[:-4] in keys}
    objects: list[ObjectInfo] = []
    names: dict[str, str] = {}
    for base, o in found:
        if skip_md5 and o.uri in md5_files:
            continue
        rel = o.uri[len(base) :] if o.uri.startswith(base) else o.key.rsplit("/", 1)[-1]
        norm = os.path.normpath(rel)
        if not rel or os.path.isabs(rel) or norm == ".." or norm.startswith("../") or rel.endswith("/"):
            raise UnsafeArchiveError(f"{o.uri}: its key cannot be a file name inside the destination")
        objects.append(o)
        names[o.uri] = norm
    if not objects:
        raise EmptySourceError(f"nothing to fetch from {', '.join(uris)}")
    return objects, names, md5_files


def checker_for(
    o: ObjectInfo, md5_files: dict[str, ObjectInfo], access: Access | str | None
) -> _verify.Checker:
    md5 = None
    if o.uri + ".md5" in md5_files:
        u = parse_s3_uri(o.uri + ".md5")
        try:
            body = s3_client(access).get_object(Bucket=u.bucket, Key=u.key)["Body"].read()
        except Exception as exc:
            raise boto3_error(exc, str(u)) from exc
        md5 = _verify.parse_md5_file(body.decode("utf-8", "replace"), o.key.rsplit("/", 1)[-1])
        if md5 is None:
            log.warning("%s.md5 has no hash for %s; checking the ETag instead", o.uri, o.uri)
    checker = _verify.Checker(o.uri, o.size, o.etag, md5)
    if not checker.can_check:
        log.warning("%s: no .md5 file and an ETag that is not an MD5 (%r): size checked only", o.uri, o.etag)
    return checker
