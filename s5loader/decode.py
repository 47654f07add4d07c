"""Decoding sample fields by extension, in the WebDataset habit, without ever running code
from the data: nothing is unpickled (``.pickle``, ``.pyd`` stay bytes) and ``.pth`` / ``.pt``
go through ``torch.load(weights_only=True)``.

``decode(sample)`` takes a sample dict (``{"__key__": ..., "jpg": b"...", "cls": b"3"}``) and
returns a new dict with each field decoded by the last part of its name:

=====================================  ===========================================
``cls``, ``index``, ``cls2``           int when the text parses as one, else str
``txt``, ``text``                      str (UTF-8)
``json``                               the parsed object
``npy``                                numpy array (``allow_pickle=False``)
``pth``, ``pt``                        ``torch.load(..., weights_only=True)``
``jpg jpeg png webp gif bmp tif        a PIL image when Pillow is installed (else the bytes,
tiff ppm pgm``                         with one warning)
anything else                          unchanged bytes
=====================================  ===========================================

Use it as ``S5Dataset.from_shards(..., decode=True)`` / ``from_prefix(..., decode=True)``,
or as (part of) a ``transform``.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from .exceptions import DecodeError

log = logging.getLogger(__name__)

IMAGES = frozenset({"jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff", "ppm", "pgm"})
_warned_pillow = False


def _int_or_str(data: bytes) -> int | str:
    text = data.decode("utf-8")
    try:
        return int(text.strip())
    except ValueError:
        return text


def _text(data: bytes) -> str:
    return data.decode("utf-8")


def _json(data: bytes) -> Any:
    return json.loads(data)


def _npy(data: bytes) -> Any:
    import numpy as np

    return np.load(io.BytesIO(data), allow_pickle=False)


def _torch(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def _image(data: bytes) -> Any:
    global _warned_pillow
    try:
        from PIL import Image
    except ImportError:
        if not _warned_pillow:
            _warned_pillow = True
            log.warning("Pillow is not installed: image fields stay bytes (pip install pillow)")
        return data
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


DECODERS: dict[str, Callable[[bytes], Any]] = {
    "cls": _int_or_str,
    "cls2": _int_or_str,
    "index": _int_or_str,
    "txt": _text,
    "text": _text,
    "json": _json,
    "npy": _npy,
    "pth": _torch,
    "pt": _torch,
    **{ext: _image for ext in IMAGES},
}


def decode_field(name: str, data: Any) -> Any:
    """Decode one field by the last part of its name (``seg.png`` -> ``png``); anything not
    bytes, or of an unknown kind, is returned as it is."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return data
    fn = DECODERS.get(name.rsplit(".", 1)[-1].lower())
    return data if fn is None else fn(bytes(data))


def decode(sample: dict[str, Any], where: str | Mapping[str, str] = "") -> dict[str, Any]:
    """A copy of ``sample`` with every field decoded by its extension (see the module doc);
    keys starting with ``__`` (``__key__``) are kept as they are.

    Args:
        where: where the sample came from, for messages: a shard's URI, or each field's
            object URI by field name.

    Raises:
        DecodeError: a field's bytes are not what its extension says (names the field, the
            sample's key and ``where``).
    """
    out = {}
    for k, v in sample.items():
        if k.startswith("__"):
            out[k] = v
            continue
        try:
            out[k] = decode_field(k, v)
        except Exception as exc:
            src = where.get(k, "") if isinstance(where, Mapping) else where
            raise DecodeError(
                f"{src + ': ' if src else ''}field {k!r} of sample {sample.get('__key__')!r} cannot be "
                f"decoded as .{k.rsplit('.', 1)[-1].lower()} ({type(exc).__name__}: {exc})"
            ) from exc
    return out
