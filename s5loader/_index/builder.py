"""Grouping objects into a compact :class:`~s5loader._index.compact.SampleIndex` as they stream in.

Objects are added one at a time (``s5cmd ls`` output, manifest lines) or a column at a time
(chunks of manifest lines) into flat buffers, never kept as Python objects. The order check and
the sort, where the input needs one, are in :mod:`.sorting`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import operator
import re
from array import array
from itertools import repeat
from typing import Any

import numpy as np

from .compact import _DATA, _ETAG_MD5, _ETAG_OTHER, ENC, SampleIndex, Sparse, Strings, etag_code
from .sample import check_group_by
from .sorting import InputOrder, apply_order, sort_objects

log = logging.getLogger(__name__)

_LOWER_HEX = re.compile(r"[0-9a-f]{32}").fullmatch


class IndexBuilder:
    """Groups objects into samples, sorted by sample key then field name.

    Args:
        group_by: ``stem`` (``0001.jpg`` + ``0001.cls``), ``folder`` (one sub-folder per
            sample) or ``object`` (one object per sample, field ``data``).
        base: the listed key prefix; ``folder`` samples are its sub-folders. Empty for
            object lists, where a sample is the folder an object lies in.
        source: what is indexed, for messages.
        listing: keep the keys no sample uses, so that blocks can be planned (listings).
    """

    def __init__(self, group_by: str, base: str = "", source: str = "", listing: bool = False) -> None:
        self.group_by = check_group_by(group_by)
        self.base = base
        self.source = source
        self._text, self._off, self._bucket, self._size = bytearray(), array("q", [0]), array("H"), array("q")
        self._etag, self._kind, self._name_at, self._klen = bytearray(), array("b"), array("i"), array("i")
        self._order = InputOrder()
        self._odd_keys: dict[int, str] = {}
        self._odd_etags: dict[int, str] = {}
        # extra fields, by object: its number, its input order, its fields as JSON text
        self._extra_at, self._extra_order, self._extra_json = array("q"), array("q"), list[str]()
        self._buckets: dict[str, int] = {}
        self._unused: list[str] | None = [] if listing else None
        self._skipped: list[str] = []
        self._n_skipped = 0
        self._last_bucket, self._last_id = "", 0
        self._put_bucket, self._put_off, self._put_size = (
            self._bucket.append,
            self._off.append,
            self._size.append,
        )
        self._put_kind, self._put_name_at, self._put_klen = (
            self._kind.append,
            self._name_at.append,
            self._klen.append,
        )

    def __len__(self) -> int:
        return len(self._size)

    def add(
        self,
        uri: str,
        key: str,
        size: int,
        etag: str,
        extra: dict[str, Any] | None = None,
        order: int = -1,
        extra_json: str | None = None,
    ) -> None:
        """Add one object; ``extra`` fields (or ``extra_json``, the text ``json.dumps(extra)``
        gives) merge into its sample's (in ``order``, else in the order objects were added)."""
        if key.endswith("/") and size == 0:
            if self._unused is not None:
                self._unused.append(key)  # a "directory marker", not data
            return
        slash = uri.find("/", 5)
        bucket = uri[5:slash] if slash >= 0 else uri[5:]
        found = self._sample_of(key)
        if found is None:
            return self._skip(uri, key)
        skey, at = found
        j = len(self._size)
        if self._order.in_order:
            self._order.note((bucket, skey, key[at:] if at >= 0 else "data"))
        if bucket != self._last_bucket:
            self._last_id = self._buckets.setdefault(bucket, len(self._buckets))
            self._last_bucket = bucket
        self._put_bucket(self._last_id)
        text = self._text
        text += key.encode("utf-8", ENC)
        self._put_off(len(text))
        self._put_size(size)
        if len(etag) == 32 and _LOWER_HEX(etag):
            self._put_kind(_ETAG_MD5)
            self._etag += bytes.fromhex(etag)
        else:
            self._put_etag(j, etag)
        self._put_name_at(at)
        if at == _DATA or key.startswith(skey):
            self._put_klen(len(skey))
        else:
            self._put_klen(-1)
            self._odd_keys[j] = skey
        if extra or extra_json:
            self._extra_at.append(j)
            self._extra_order.append(order if order >= 0 else j)
            self._extra_json.append(json.dumps(extra) if extra else extra_json)  # type: ignore[arg-type]

    def _sample_of(self, key: str) -> tuple[str, int] | None:
        """The sample key of ``key`` and where its field name starts in it (``_DATA``: the
        field ``data``), or ``None`` where the grouping leaves the object out."""
        if self.group_by == "object":
            return key, _DATA
        if self.group_by == "stem":
            head, _, base_name = key.rpartition("/")
            stem, dot, ext = base_name.partition(".")
            if not dot or not stem or not ext:
                return None
            return (f"{head}/{stem}" if head else stem), len(key) - len(ext)
        base = self.base
        if base:
            rel = key[len(base) :] if key.startswith(base) else key
            folder, sep, name = rel.partition("/")
            if not sep or not name:
                return None
            skey = base + folder
        else:
            skey, sep, name = key.rpartition("/")
            if not sep:
                return None
        return skey, len(key) - len(name)

    def _put_etag(self, j: int, etag: str) -> None:
        kind, raw = etag_code(etag)
        self._put_kind(kind)
        self._etag += raw
        if kind == _ETAG_OTHER:
            self._odd_etags[j] = etag

    def add_many(
        self,
        buckets: list[str],
        keys: list[str],
        sizes: list[int],
        etags: list[str],
        extras: list[str | None],
        order: int,
    ) -> None:
        """Add objects as :meth:`add` would one by one (``extras`` as JSON text, the first object
        at ``order``), a column at a time: the grouping, the order check, the arrays."""
        n = len(keys)
        wrapped = "\0" + "\0".join(keys) + "\0"
        simple = (
            n
            and not self.base
            and "/\0" not in wrapped
            and not (self.group_by == "stem" and "\0/" in wrapped)
        )
        grouped = _group_keys(self.group_by, keys) if simple else None
        if grouped is None:
            # a base prefix, a folder key, a key "/NAME.EXT" (whose stem is no prefix of it) or
            # one the grouping leaves out: one at a time
            for i in range(n):
                self.add(
                    f"s3://{buckets[i]}/{keys[i]}", keys[i], sizes[i], etags[i], None, order + i, extras[i]
                )
            return
        skeys, ats = grouped
        one_bucket = buckets.count(buckets[0]) == n
        if self._order.in_order:
            self._order.note_column(None if one_bucket else buckets, buckets[0], keys, skeys, ats)
        ids = self._buckets
        for b in dict.fromkeys(buckets):
            ids.setdefault(b, len(ids))
        self._last_bucket, self._last_id = buckets[-1], ids[buckets[-1]]
        self._bucket.extend(
            array("H", [self._last_id]) * n if one_bucket else array("H", map(ids.__getitem__, buckets))
        )
        j0 = len(self._size)
        self._put_columns(keys, sizes, etags, ats)
        self._put_extras(j0, extras, order)

    def _put_columns(
        self, keys: list[str], sizes: list[int], etags: list[str], ats: list[int] | None
    ) -> None:
        """:meth:`add_many`'s arrays: the keys' text, the sizes, the ETags and where each sample
        key and field name lies in its key (``ats`` as :func:`_group_keys` gives them)."""
        n, j0 = len(keys), len(self._size)
        chars = np.fromiter(map(len, keys), dtype=np.int64, count=n)
        joined = "".join(keys)
        encoded = joined.encode("utf-8", ENC)
        lens = (
            chars
            if len(encoded) == len(joined)
            else np.array([len(k.encode("utf-8", ENC)) for k in keys], dtype=np.int64)
        )
        text = self._text
        self._off.frombytes((np.cumsum(lens) + len(text)).tobytes())
        text += encoded
        self._size.extend(array("q", sizes))
        raw = _md5_digests(etags)
        if raw is not None:
            self._kind.extend(array("b", [_ETAG_MD5]) * n)
            self._etag += raw
        else:
            for i, etag in enumerate(etags):
                self._put_etag(j0 + i, etag)
        if ats is None:  # one object per sample: the field is "data", the sample key the key
            self._name_at.extend(array("i", [_DATA]) * n)
            self._klen.frombytes(chars.astype(np.int32).tobytes())
        else:  # the sample key ends one character (the dot or the slash) before the field name
            self._name_at.extend(array("i", ats))
            self._klen.frombytes((np.array(ats, dtype=np.int32) - 1).tobytes())

    def _put_extras(self, j0: int, extras: list[str | None], order: int) -> None:
        """:meth:`add_many`'s extra fields (JSON text or ``None``), the first object at ``j0``
        and in input ``order``."""
        n = len(extras)
        if None not in extras:
            self._extra_at.extend(range(j0, j0 + n))
            self._extra_order.extend(range(order, order + n))
            self._extra_json += extras  # type: ignore[arg-type]
        elif any(extras):
            for i, extra in enumerate(extras):
                if extra:
                    self._extra_at.append(j0 + i)
                    self._extra_order.append(order + i)
                    self._extra_json.append(extra)

    def _skip(self, uri: str, key: str) -> None:
        self._n_skipped += 1
        if len(self._skipped) < 3:
            self._skipped.append(uri)
        if self._unused is not None:
            self._unused.append(key)

    def _warn_skipped(self) -> None:
        """Log, once per build, how many objects the grouping left out, naming a few."""
        if not self._n_skipped:
            return
        why = {
            "stem": "no extension to name a field (expected NAME.FIELD)",
            "folder": "not inside a sub-folder",
        }
        log.warning(
            "group_by=%r left out %d object(s) of %s with %s, e.g. %s",
            self.group_by,
            self._n_skipped,
            self.source or "the source",
            why[self.group_by],
            ", ".join(self._skipped),
        )

    def build(self, meta: dict[str, Any] | None = None) -> SampleIndex:
        """The index. The builder must not be used afterwards.

        Raises:
            ConfigError: a sample has the same field twice.
        """
        self._warn_skipped()
        m = len(self._size)
        text = Strings(bytes(self._text), np.frombuffer(self._off, dtype=np.int64).copy())
        self._text = bytearray()
        bucket = np.frombuffer(self._bucket, dtype=np.uint16).copy()
        size = np.frombuffer(self._size, dtype=np.int64).copy()
        etag = np.frombuffer(bytes(self._etag), dtype=np.uint8).reshape(m, 16)
        kind = np.frombuffer(self._kind, dtype=np.int8).copy()
        name_at = np.frombuffer(self._name_at, dtype=np.int32).copy()
        klen = np.frombuffer(self._klen, dtype=np.int32).copy()
        in_order = self._order.in_order
        new = np.frombuffer(bytes(self._order.new), dtype=np.uint8).astype(bool) if in_order else None
        bucket_names = sorted(self._buckets, key=self._buckets.__getitem__)
        odd_keys, odd_etags = self._odd_keys, self._odd_etags
        extra_at = np.frombuffer(self._extra_at, dtype=np.int64).copy()
        if not in_order:
            perm, new, ordered = sort_objects(
                self.group_by, odd_keys, text, bucket_names, bucket, klen, name_at
            )
            text = Strings.of(ordered)  # here, once the sort's garbage is gone: a lower peak
            (bucket, size, etag, kind, name_at, klen), (odd_keys, odd_etags), extra_at = apply_order(
                perm, [bucket, size, etag, kind, name_at, klen], [odd_keys, odd_etags], extra_at
            )
        assert new is not None
        first = (
            np.concatenate([np.flatnonzero(new), [m]]).astype(np.int64) if m else np.zeros(1, dtype=np.int64)
        )
        starts = first[:-1]
        sample_odd = (
            {i: odd_keys[int(j)] for i, j in enumerate(starts.tolist()) if klen[j] < 0} if odd_keys else {}
        )
        index = SampleIndex(
            text=text,
            buckets=bucket_names,
            bucket=bucket,
            size=size,
            etag=np.ascontiguousarray(etag),
            etag_kind=kind,
            name_at=name_at,
            first=first,
            key_len=klen[starts].copy(),
            bucket_in_key=len(bucket_names) > 1,
            irregular_keys=Sparse.of(sample_odd),
            irregular_names=Sparse.of({}),
            other_etags=Sparse.of(odd_etags),
            extras=_merge_extras(
                extra_at, np.frombuffer(self._extra_order, dtype=np.int64), self._extra_json, first
            ),
            unused=Strings.of(self._unused) if self._unused is not None else None,
            meta={"source": self.source, "group_by": self.group_by, **(meta or {})},
        )
        _trim()
        return index


def _trim() -> None:
    # The build's buffers grew by realloc on the C heap; hand what they left free back to the
    # system so that the index's own size is what stays resident (glibc only).
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL(None).malloc_trim(0)


def _group_keys(group_by: str, keys: list[str]) -> tuple[list[str], list[int] | None] | None:
    """Each key's sample key and where its field name starts (``None``: one object per sample,
    the field ``data``), as :meth:`IndexBuilder.add` groups keys with no base prefix, none ending
    in a slash and (for stems) none of the form ``/NAME.EXT``; ``None`` if it leaves one out."""
    if group_by == "object":
        return keys, None
    if group_by == "stem":  # NAME.FIELD: the field name starts after the base name's first dot
        starts = [k.rfind("/") + 1 for k in keys]
        ends = list(map(str.find, keys, repeat("."), starts))
        ats = [e + 1 for e in ends]
        if not all(map(operator.gt, ends, starts)) or not all(map(operator.lt, ats, map(len, keys))):
            return None
    else:  # FOLDER/NAME: the field name starts after the last slash
        ends = list(map(str.rfind, keys, repeat("/")))
        if min(ends) < 0:
            return None
        ats = [e + 1 for e in ends]
    return list(map(operator.getitem, keys, map(slice, ends))), ats


def _md5_digests(etags: list[str]) -> bytes | None:
    """The 16-byte digests of ``etags`` where every one is a plain lowercase MD5 hex digest."""
    joined = "".join(etags)
    # 32 characters each on average and none shorter: 32 each
    if not etags or len(joined) != 32 * len(etags) or min(map(len, etags)) != 32:
        return None
    try:
        raw = bytes.fromhex(joined)
    except ValueError:
        return None
    return raw if raw.hex() == joined else None


def _merge_extras(at: np.ndarray, order: np.ndarray, texts: list[str], first: np.ndarray) -> Sparse:
    """One JSON object per sample (``at``: where each object with extra fields now is): its
    objects' extra fields merged in input ``order``. The texts are what ``json.dumps`` writes,
    so a sample whose objects all carry the same text (a label on each line) keeps it."""
    if not len(at):
        return Sparse.of({})
    if len(at) > 1 and not bool((np.diff(at) > 0).all()):
        o = np.argsort(at)
        at, order, texts = at[o], order[o], [texts[j] for j in o.tolist()]
    sample_of = np.searchsorted(first, at, side="right") - 1
    step = np.diff(sample_of) > 0
    if bool(step.all()):  # one object with extra fields per sample: nothing to merge
        return Sparse(sample_of.astype(np.int64), Strings.of(texts))
    starts = np.flatnonzero(np.concatenate([[True], step]))
    ends = np.append(starts[1:], len(texts)).tolist()
    out = list(map(texts.__getitem__, starts.tolist()))
    same = np.fromiter(map(operator.eq, texts[1:], texts), dtype=bool, count=len(texts) - 1)
    mixed = np.searchsorted(starts, np.flatnonzero(~same & ~step) + 1, side="right") - 1
    for r in np.unique(mixed).tolist():
        merged: dict[str, Any] = {}
        a, b = int(starts[r]), ends[r]
        for _, text in sorted(zip(order[a:b].tolist(), texts[a:b], strict=True)):
            merged.update(json.loads(text))
        out[r] = json.dumps(merged)
    return Sparse(sample_of[starts].astype(np.int64), Strings.of(out))
