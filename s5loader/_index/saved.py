"""The saved sample index: a versioned binary file (also what a pickled index carries).

Layout, all integers little-endian::

    8 bytes   magic b"S5LINDEX"
    4 bytes   format version (uint32), currently 1
    4 bytes   header length H (uint32)
    H bytes   header: UTF-8 JSON object
                {"meta": {"source": ..., "group_by": ...}, "samples": n, "objects": m,
                 "buckets": [...], "bucket_in_key": bool, "listing": bool,
                 "arrays": [[name, dtype, shape], ...], "payload": P}
    P bytes   payload: zlib stream of the arrays' bytes, in the header's order
    32 bytes  SHA-256 of everything before it

String tables are stored as lengths (the offsets are their running sums). A file with another
magic is not an index; another version is refused with a message saying to save it again; a
checksum that does not match means the file is damaged or truncated.
"""

from __future__ import annotations

import copyreg
import hashlib
import json
import os
import struct
import tempfile
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from ..exceptions import IndexFileError
from .compact import SampleIndex, Sparse, Strings

MAGIC = b"S5LINDEX"
VERSION = 1
_HEAD = struct.Struct("<8sII")
_DIGEST = 32


def _lengths(off: np.ndarray) -> np.ndarray:
    lens = np.diff(off)
    top = int(lens.max()) if len(lens) else 0
    return lens.astype(np.uint16 if top < 1 << 16 else np.uint32 if top < 1 << 32 else np.uint64)


def _offsets(lens: np.ndarray) -> np.ndarray:
    off = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    return off


def _arrays(index: SampleIndex) -> list[tuple[str, np.ndarray]]:
    out: list[tuple[str, np.ndarray]] = [
        ("text", np.frombuffer(index.text.blob, dtype=np.uint8)),
        ("text_len", _lengths(index.text.off)),
        ("bucket", index.bucket),
        ("size", index.size),
        ("etag", index.etag),
        ("etag_kind", index.etag_kind),
        ("name_at", index.name_at),
        ("fields", _lengths(index.first)),
        ("key_len", index.key_len),
    ]
    for name in ("irregular_keys", "irregular_names", "other_etags", "extras"):
        sparse: Sparse = getattr(index, name)
        out += [
            (f"{name}.at", sparse.at),
            (f"{name}.text", np.frombuffer(sparse.strings.blob, dtype=np.uint8)),
            (f"{name}.len", _lengths(sparse.strings.off)),
        ]
    if index.unused is not None:
        out += [
            ("unused.text", np.frombuffer(index.unused.blob, dtype=np.uint8)),
            ("unused.len", _lengths(index.unused.off)),
        ]
    out += [(f"column.{k}", v) for k, v in index.columns.items()]
    return out


def dumps(index: SampleIndex, level: int = 6) -> bytes:
    """The index as the bytes of an index file."""
    arrays = _arrays(index)
    comp = zlib.compressobj(level)
    chunks = [comp.compress(np.ascontiguousarray(a).data) for _, a in arrays]
    chunks.append(comp.flush())
    payload = b"".join(chunks)
    header = json.dumps(
        {
            "meta": index.meta,
            "samples": len(index),
            "objects": len(index.size),
            "buckets": index.buckets,
            "bucket_in_key": index.bucket_in_key,
            "listing": index.unused is not None,
            "arrays": [[name, a.dtype.str, list(a.shape)] for name, a in arrays],
            "payload": len(payload),
        }
    ).encode()
    body = _HEAD.pack(MAGIC, VERSION, len(header)) + header + payload
    return body + hashlib.sha256(body).digest()


def loads(data: bytes, where: str = "the index data") -> SampleIndex:
    """An index from the bytes of an index file.

    Raises:
        IndexFileError: not an index file, another format version, or damaged.
    """
    if len(data) < _HEAD.size + _DIGEST or data[:8] != MAGIC:
        raise IndexFileError(f"{where} is not an s5loader index file (no {MAGIC.decode()} header)")
    _, version, hlen = _HEAD.unpack_from(data)
    if version != VERSION:
        raise IndexFileError(
            f"{where} is an s5loader index of format version {version}; this version of s5loader "
            f"reads version {VERSION}: build the data set from its source and save the index again"
        )
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise IndexFileError(f"{where} is damaged or truncated (its SHA-256 checksum does not match)")
    try:
        header = json.loads(body[_HEAD.size : _HEAD.size + hlen])
        arrays, text = _unpack(header["arrays"], zlib.decompress(body[_HEAD.size + hlen :]))

        def strings(prefix: str) -> Strings:
            return Strings(arrays[f"{prefix}.text"].tobytes(), _offsets(arrays[f"{prefix}.len"]))

        def sparse(prefix: str) -> Sparse:
            return Sparse(arrays[f"{prefix}.at"], strings(prefix))

        return SampleIndex(
            text=Strings(text, _offsets(arrays["text_len"])),
            buckets=header["buckets"],
            bucket=arrays["bucket"],
            size=arrays["size"],
            etag=arrays["etag"],
            etag_kind=arrays["etag_kind"],
            name_at=arrays["name_at"],
            first=_offsets(arrays["fields"]),
            key_len=arrays["key_len"],
            bucket_in_key=bool(header["bucket_in_key"]),
            irregular_keys=sparse("irregular_keys"),
            irregular_names=sparse("irregular_names"),
            other_etags=sparse("other_etags"),
            extras=sparse("extras"),
            unused=strings("unused") if header["listing"] else None,
            columns={k[7:]: v for k, v in arrays.items() if k.startswith("column.")},
            meta=header["meta"],
        )
    except (KeyError, ValueError, TypeError, zlib.error) as exc:  # a well-formed checksum over bad content
        raise IndexFileError(f"{where} is not a readable s5loader index ({exc})") from exc


def _unpack(layout: list[Any], raw: bytes) -> tuple[dict[str, np.ndarray], bytes]:
    """The arrays an index file's decompressed body ``raw`` holds, as its header's ``layout``
    (name, dtype, shape) lists them, and the key text (an empty array in its place)."""
    arrays: dict[str, np.ndarray] = {}
    at = 0
    text = b""
    for name, dtype, shape in layout:
        dt = np.dtype(dtype)
        count = int(np.prod(shape)) if shape else 1
        # copies, so that the decompressed buffer is freed and the text is held once
        arrays[name] = (
            np.frombuffer(raw, dtype=dt, count=count, offset=at).reshape(shape).copy()
            if name != "text"
            else np.empty(0, np.uint8)
        )
        if name == "text":
            text = raw[at : at + count]
        at += count * dt.itemsize
    return arrays, text


def index_bytes(index: SampleIndex) -> bytes:
    """The index in the saved format, made once per index (pickling and saving reuse it)."""
    if index._saved is None:
        index._saved = dumps(index)
    return index._saved


def _reduce(index: SampleIndex) -> tuple[Callable[[bytes], SampleIndex], tuple[bytes]]:
    return (loads, (index_bytes(index),))


# A pickled index (to DataLoader workers, to other ranks) travels in the saved form: compressed.
copyreg.pickle(SampleIndex, _reduce)


def save(index: SampleIndex, path: str) -> None:
    """Write the index file atomically (a temporary file renamed into place)."""
    data = index_bytes(index)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".s5loader-index-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def load(path: str) -> SampleIndex:
    """Read an index file.

    Raises:
        IndexFileError: the file cannot be read, or is not a usable index.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise IndexFileError(f"cannot read the index file {path!r}: {exc.strerror}") from exc
    return loads(data, repr(path))
