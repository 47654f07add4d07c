"""JSON Lines manifests: one object per line (its URI, and where known its size, ETag and extra
fields such as a label), read into a sample index.

Lines of the usual shape (``uri``, ``size``, maybe ``etag``, then any extra fields) take a
fast path that gives exactly what the full path (``json.loads`` per line) gives: a chunk of
lines that all have that shape is read by one regular-expression pass and handed to the
builder column by column; any other chunk is read line by line, each line by the per-line
pattern or else in full. Extra fields of plain scalars are read by a pattern, others by
``json.loads`` once per distinct text (labels repeat)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from operator import itemgetter
from typing import Any, Literal

from .._s3api.client import s3_client
from .._s3api.errors import boto3_error
from .._util.uri import parse_s3_uri
from ..config import Access
from ..exceptions import EmptySourceError, ManifestError, S5LoaderError
from .builder import IndexBuilder
from .compact import SampleIndex
from .listing import stat_objects
from .sorting import SameObjectTwice


def index_manifest(path_or_uri: str, access: Access | str | None, group_by: str) -> SampleIndex:
    """Read a JSON Lines manifest from a local path or an s3 URI into an index, chunk by chunk.

    Each line is either a JSON string (an object URI) or an object with ``"uri"`` and, where
    known, ``"size"`` and ``"etag"``; any other keys are extra fields carried into the sample.
    Blank lines are ignored. Objects without a size get one HEAD request each.

    Raises:
        ManifestError: a line is not valid (the message names the manifest and the line
            number), or an object is listed twice.
        EmptySourceError: the manifest lists no object.
    """
    builder = IndexBuilder(group_by, source=path_or_uri)
    reader = _ManifestReader(path_or_uri, builder)
    for chunk in _read_chunks(path_or_uri, access):
        reader.add_chunk(chunk)
    if not reader.count:
        raise EmptySourceError(f"the manifest {path_or_uri} lists no object")
    missing = reader.missing
    if missing:
        for (order, _, rec), obj in zip(missing, stat_objects([m[1] for m in missing], access), strict=True):
            builder.add(obj.uri, obj.key, obj.size, obj.etag, rec, order=order)
    try:
        return builder.build()
    except SameObjectTwice as exc:
        raise ManifestError(f"{path_or_uri}: {exc.uri} is listed twice") from exc


class _ManifestReader:
    """Feeds manifest lines to a builder, counting objects (their order in the manifest) and
    lines (for messages), and keeping the objects that still need a size."""

    def __init__(self, source: str, builder: IndexBuilder) -> None:
        self.source = source
        self.builder = builder
        self.count = 0
        self.lineno = 0
        self.missing: list[tuple[int, str, dict[str, Any]]] = []
        self._tails: dict[str, str | None | Literal[False]] = {}

    def add_chunk(self, chunk: str) -> None:
        """Whole lines: in one pass where every line has the usual shape, else line by line."""
        if not chunk:
            return
        n_lines = chunk.count("\n") + (not chunk.endswith("\n"))
        lines = _CANON_LINES if _CANON_LINES.match(chunk) else _LOOSE_LINES
        rows = lines.findall(chunk)
        if len(rows) == n_lines and self._add_rows(rows):
            self.lineno += n_lines
            return
        for line in chunk.split("\n")[:n_lines]:
            self.add_line(line)

    def _add_rows(self, rows: list[tuple[str, str, str, str, str]]) -> bool:
        """Lines matched loosely, checked here a column at a time: JSON strings free of escapes
        and control characters, no folder key, bucket names that parse_s3_uri accepts, extra
        fields of plain scalars. ``False`` (nothing added) where the lines need a closer look."""
        buckets, keys, sizes, etags, tails = (list(map(itemgetter(i), rows)) for i in range(5))
        strings = '"'.join(keys) + '"' + "".join(etags)
        # printable: no control character (nor, to be safe, a rarer one the full path reads)
        if not strings.isprintable() or "\\" in strings or '/"' in strings:
            return False
        if not all(map(_BUCKET, set(buckets))):
            return False
        extras = self._extras_json(tails)
        if extras is None:
            return False
        self.builder.add_many(buckets, keys, list(map(int, sizes)), etags, extras, self.count + 1)
        self.count += len(rows)
        return True

    def _extras_json(self, tails: list[str]) -> list[str | None] | None:
        """Each line's extra fields as the JSON text ``json.dumps`` writes; ``None`` if a line
        must take the full path. Labels repeat, so each distinct tail is read once."""
        known = self._tails
        table = {t: known[t] if t in known else _tail_json(t) for t in set(tails)}
        if False in table.values():
            return None
        if len(known) < _TAIL_CACHE:
            known.update(table)
        return list(map(table.__getitem__, tails))  # type: ignore[arg-type]

    def add_line(self, line: str) -> None:
        self.lineno += 1
        m = _FAST_LINE.match(line)
        if m is not None and not m[2].endswith("/"):
            extra = _tail_json(line[m.end() :])
            if extra is not False:
                self.count += 1
                self.builder.add(
                    f"s3://{m[1]}/{m[2]}",
                    m[2],
                    int(m[3]),
                    m[4] or "",
                    None,
                    order=self.count,
                    extra_json=extra,
                )
                return
        if not line.strip():
            return
        source, lineno = self.source, self.lineno
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ManifestError(
                f"{source} line {lineno}: not valid JSON ({exc.msg}): {line[:200]!r}"
            ) from exc
        if isinstance(rec, str):
            rec = {"uri": rec}
        if not isinstance(rec, dict) or not isinstance(rec.get("uri"), str):
            raise ManifestError(
                f"{source} line {lineno}: expected a URI string or an object with a 'uri' field, "
                f"got {line[:200]!r}"
            )
        uri = rec.pop("uri")
        try:
            u = parse_s3_uri(uri)
        except S5LoaderError as exc:
            raise ManifestError(f"{source} line {lineno}: {exc}") from exc
        if not u.key or u.key.endswith("/"):
            raise ManifestError(f"{source} line {lineno}: {uri!r} names no object")
        size, etag = rec.pop("size", None), rec.pop("etag", "")
        self.count += 1
        if size is None:
            self.missing.append((self.count, uri, rec))
            return
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(f"{source} line {lineno}: size must be a non-negative int, got {size!r}")
        self.builder.add(uri, u.key, size, str(etag).strip('"'), rec, order=self.count)


# A manifest line in the usual shape, its JSON strings free of escapes and control characters,
# its bucket name one that parse_s3_uri accepts, then any extra fields of plain scalars (most
# manifests carry a label); any other line takes the full path.
_SCALAR = r'(?:"[ !#-\[\]-~]*"|-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null)'
_HEAD = (
    r'[ \t]*\{[ \t]*"uri"[ \t]*:[ \t]*"s3://([A-Za-z0-9][A-Za-z0-9._-]{1,254})/([^"\\\x00-\x1f]+)"'
    r'[ \t]*,[ \t]*"size"[ \t]*:[ \t]*(0|[1-9][0-9]*)[ \t]*'
    r'(?:,[ \t]*"etag"[ \t]*:[ \t]*"([^"\\\x00-\x1f]*)"[ \t]*)?'
)
_FIELDS = r'((?:,[ \t]*"[ !#-\[\]-~]*"[ \t]*:[ \t]*' + _SCALAR + r"[ \t]*)*)"
_FAST_LINE = re.compile(_HEAD)
# What may follow those fields on a fast line: extra fields of plain scalars, then the end.
_FAST_TAIL = re.compile(_FIELDS + r"\}[ \t]*\r?\n?")
# Whole lines of about that shape in a chunk, (bucket, key, size, etag, the rest) each, to be
# checked a column at a time: as json.dumps writes them, or with any spaces and tabs.
_CANON_LINES = re.compile(
    r'^\{"uri": "s3://([^"/\n]*)/([^"\n]+)", "size": (0|[1-9][0-9]*)(?:, "etag": "([^"\n]*)")?(.*)$',
    re.MULTILINE,
)
_LOOSE_LINES = re.compile(
    r'^[ \t]*\{[ \t]*"uri"[ \t]*:[ \t]*"s3://([^"/\n]*)/([^"\n]+)"[ \t]*,'
    r'[ \t]*"size"[ \t]*:[ \t]*(0|[1-9][0-9]*)'
    r'[ \t]*(?:,[ \t]*"etag"[ \t]*:[ \t]*"([^"\n]*)"[ \t]*)?(.*)$',
    re.MULTILINE,
)
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,254}").fullmatch
_FAST_PAIR = re.compile(r'[ \t]*,[ \t]*"([ !#-\[\]-~]*)"[ \t]*:[ \t]*(' + _SCALAR + r")[ \t]*")
_RESERVED = frozenset(("uri", "size", "etag"))
_TAIL_CACHE = 1 << 16
_CHUNK = 1 << 22  # characters read at a time (whole lines)


def _tail_json(tail: str) -> str | None | Literal[False]:
    """What follows the known fields of a fast line: its extra fields as :func:`_fields_json`
    gives them, else (escapes, text beyond ASCII, nested values, a field twice) as the full
    path reads them, by ``json.loads`` (once per distinct tail: labels repeat); ``False`` where
    the full path must decide (a known field again, no extra field after a comma, not JSON)."""
    m = _FAST_TAIL.fullmatch(tail)
    fields = _fields_json(m[1]) if m is not None else False
    if fields is not False:
        return fields
    rest = tail.lstrip(" \t")
    if not rest.startswith(","):
        return False
    try:  # the line is '{' + known fields + rest: rest's members make the same object
        extra = json.loads("{" + rest[1:])
    except ValueError:
        return False
    return (
        json.dumps(extra)
        if isinstance(extra, dict) and extra and not _RESERVED.intersection(extra)
        else False
    )


def _fields_json(fields: str) -> str | None | Literal[False]:
    """Extra fields of a fast manifest line: ``None`` for none, else the JSON text
    ``json.dumps`` would write for them (so the index is the same whichever path read the
    line), or ``False`` where the full path must decide (a field named twice or like a known
    one, a float out of range)."""
    if not fields:
        return None
    out = []
    seen = set()
    for key, value in _FAST_PAIR.findall(fields):
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
    return "{" + ", ".join(out) + "}"


def _read_chunks(path_or_uri: str, access: Access | str | None) -> Iterator[str]:
    """The manifest as chunks of whole lines."""
    if path_or_uri.startswith("s3://"):
        u = parse_s3_uri(path_or_uri)
        client = s3_client(access)
        try:
            body = client.get_object(Bucket=u.bucket, Key=u.key)["Body"]
            rest = b""
            for piece in body.iter_chunks(chunk_size=_CHUNK):
                head, nl, rest = (rest + piece).rpartition(b"\n")
                if nl:
                    yield (head + nl).decode("utf-8")
            if rest:
                yield rest.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ManifestError(f"the manifest {path_or_uri} is not UTF-8 text: {exc}") from exc
        except Exception as exc:
            raise boto3_error(exc, path_or_uri) from exc
        return
    try:
        f = open(path_or_uri, encoding="utf-8")
    except OSError as exc:
        raise ManifestError(f"cannot read the manifest {path_or_uri!r}: {exc.strerror}") from exc
    with f:
        while chunk := f.read(_CHUNK):
            yield chunk + f.readline() if not chunk.endswith("\n") else chunk
