"""JSON Lines manifests: one object per line (its URI, and where known its size, ETag and extra
fields such as a label), read line by line into a sample index. Lines of the usual shape take
a fast path (regular expressions, no ``json.loads``) that gives exactly what the full path
gives."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any, Literal

from .._s3api.client import s3_client
from .._s3api.errors import boto3_error
from .._util.uri import parse_s3_uri
from ..config import Access
from ..exceptions import EmptySourceError, ManifestError, S5LoaderError
from .builder import IndexBuilder, SameObjectTwice
from .compact import SampleIndex
from .listing import stat_objects


def index_manifest(path_or_uri: str, access: Access | str | None, group_by: str) -> SampleIndex:
    """Read a JSON Lines manifest from a local path or an s3 URI into an index, line by line.

    Each line is either a JSON string (an object URI) or an object with ``"uri"`` and, where
    known, ``"size"`` and ``"etag"``; any other keys are extra fields carried into the sample.
    Blank lines are ignored. Objects without a size get one HEAD request each.

    Raises:
        ManifestError: a line is not valid (the message names the manifest and the line
            number), or an object is listed twice.
        EmptySourceError: the manifest lists no object.
    """
    builder = IndexBuilder(group_by, source=path_or_uri)
    missing: list[tuple[int, str, dict[str, Any]]] = []
    count = 0
    fast = _FAST_LINE.match
    tails: dict[str, str | None | Literal[False]] = {}
    for lineno, line in enumerate(_read_lines(path_or_uri, access), 1):
        m = fast(line)
        if m is not None and not m[2].endswith("/"):
            # the usual {"uri": ..., "size": ..., "etag": ..., "label": ...} without escapes:
            # what json.loads and parse_s3_uri make of it, at a fraction of the cost
            # the rest of the line: "}" alone, or extra fields (labels repeat, so most tails
            # were met before and cost one look-up)
            tail = line[m.end() :]
            extra = tails.get(tail, _MISSING)
            if extra is _MISSING:
                extra = _fast_extra(tail)
                if len(tails) < _TAIL_CACHE:
                    tails[tail] = extra
            if extra is not False:
                count += 1
                builder.add(f"s3://{m[1]}/{m[2]}", m[2], int(m[3]), m[4] or "", None, order=count, extra_json=extra)
                continue
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
        count += 1
        if size is None:
            missing.append((count, uri, rec))
            continue
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(f"{path_or_uri} line {lineno}: size must be a non-negative int, got {size!r}")
        builder.add(uri, u.key, size, str(etag).strip('"'), rec, order=count)
    if not count:
        raise EmptySourceError(f"the manifest {path_or_uri} lists no object")
    if missing:
        for (order, _, rec), obj in zip(missing, stat_objects([m[1] for m in missing], access), strict=True):
            builder.add(obj.uri, obj.key, obj.size, obj.etag, rec, order=order)
    try:
        return builder.build()
    except SameObjectTwice as exc:
        raise ManifestError(f"{path_or_uri}: {exc.uri} is listed twice") from exc


# A manifest line in the usual shape, its JSON strings free of escapes and control characters,
# its bucket name one that parse_s3_uri accepts, then any extra fields of plain scalars (most
# manifests carry a label); any other line takes the full path.
_SCALAR = r'(?:"[ !#-\[\]-~]*"|-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null)'
_FAST_LINE = re.compile(
    r'[ \t]*\{[ \t]*"uri"[ \t]*:[ \t]*"s3://([A-Za-z0-9][A-Za-z0-9._-]{1,254})/([^"\\\x00-\x1f]+)"'
    r'[ \t]*,[ \t]*"size"[ \t]*:[ \t]*(0|[1-9][0-9]*)[ \t]*'
    r'(?:,[ \t]*"etag"[ \t]*:[ \t]*"([^"\\\x00-\x1f]*)"[ \t]*)?'
)
# What may follow those fields on a fast line: extra fields of plain scalars, then the end.
_FAST_TAIL = re.compile(r'((?:,[ \t]*"[ !#-\[\]-~]*"[ \t]*:[ \t]*' + _SCALAR + r'[ \t]*)*)\}[ \t]*\r?\n?')
_FAST_PAIR = re.compile(r'[ \t]*,[ \t]*"([ !#-\[\]-~]*)"[ \t]*:[ \t]*(' + _SCALAR + r')[ \t]*')
_RESERVED = frozenset(("uri", "size", "etag"))
_TAIL_CACHE = 1 << 16
_MISSING: Any = object()


def _fast_extra(tail: str) -> str | None | Literal[False]:
    """The end of a fast manifest line: ``None`` for a plain ``}``, the extra fields as the JSON
    text ``json.dumps`` would write for them (so the index is the same whichever path read the
    line), or ``False`` where the full path must decide (anything else, a field named twice or
    like a known one, a float out of range)."""
    m = _FAST_TAIL.fullmatch(tail)
    if m is None:
        return False
    pairs = _FAST_PAIR.findall(m[1])
    out = []
    seen = set()
    for key, value in pairs:
        if key in _RESERVED or key in seen:
            return False
        seen.add(key)
        c = value[0]
        if c == '"' or c in "tfn":
            text = value
        elif "." in value or "e" in value or "E" in value:
            f = float(value)
            if not math.isfinite(f):
                return False
            text = repr(f)
        else:
            text = str(int(value))
        out.append(f'"{key}": {text}')
    return "{" + ", ".join(out) + "}" if out else None


def _read_lines(path_or_uri: str, access: Access | str | None) -> Iterator[str]:
    if path_or_uri.startswith("s3://"):
        u = parse_s3_uri(path_or_uri)
        client = s3_client(access)
        try:
            body = client.get_object(Bucket=u.bucket, Key=u.key)["Body"]
            for raw in body.iter_lines(chunk_size=1 << 20, keepends=True):
                yield raw.decode("utf-8")
        except Exception as exc:
            raise boto3_error(exc, path_or_uri) from exc
        return
    try:
        f = open(path_or_uri, encoding="utf-8")
    except OSError as exc:
        raise ManifestError(f"cannot read the manifest {path_or_uri!r}: {exc.strerror}") from exc
    with f:
        yield from f
