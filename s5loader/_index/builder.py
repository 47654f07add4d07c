"""Grouping objects into a compact :class:`~s5loader._index.compact.SampleIndex` as they stream in.

Objects are added one at a time (from ``s5cmd ls`` output or manifest lines) into flat
buffers, never kept as Python objects. Listings come sorted by key, and for most data sets
that order is already the order of samples and fields; the builder checks it as objects
arrive and sorts only when it is not.
"""

from __future__ import annotations

import ctypes
import json
import logging
import operator
import re
from array import array
from typing import Any

import numpy as np

from ..exceptions import ConfigError
from .compact import _DATA, _ETAG_MD5, _ETAG_OTHER, ENC, SampleIndex, Sparse, Strings, etag_code
from .sample import check_group_by

log = logging.getLogger(__name__)

_LOWER_HEX = re.compile(r"[0-9a-f]{32}").fullmatch
_ALL_LOWER_HEX = re.compile(r"[0-9a-f]*").fullmatch


class SameObjectTwice(ConfigError):
    """An object was given twice (a sample would have the same field twice)."""

    def __init__(self, message: str, uri: str = "") -> None:
        super().__init__(message)
        self.uri = uri

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (self.__class__, (self.args[0], self.uri))


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
        self._text = bytearray()
        self._off = array("q", [0])
        self._bucket = array("H")
        self._size = array("q")
        self._etag = bytearray()
        self._kind = array("b")
        self._name_at = array("i")
        self._klen = array("i")
        self._new = bytearray()  # 1 where an object starts a sample (while the input is in order)
        self._odd_keys: dict[int, str] = {}
        self._odd_etags: dict[int, str] = {}
        # extra fields, by object: its number, its input order, its fields as JSON text
        self._extra_at = array("q")
        self._extra_order = array("q")
        self._extra_json: list[str] = []
        self._buckets: dict[str, int] = {}
        self._unused: list[str] | None = [] if listing else None
        self._skipped: list[str] = []
        self._n_skipped = 0
        self._prev: tuple[str, str, str] | None = None
        self._in_order = True
        self._last_bucket, self._last_id = "", 0
        self._put_bucket, self._put_off, self._put_size = self._bucket.append, self._off.append, self._size.append
        self._put_kind, self._put_name_at, self._put_klen = self._kind.append, self._name_at.append, self._klen.append

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
        group_by = self.group_by
        if group_by == "object":
            skey, at = key, _DATA
        elif group_by == "stem":
            head, _, base_name = key.rpartition("/")
            stem, dot, ext = base_name.partition(".")
            if not dot or not stem or not ext:
                return self._skip(uri, key)
            skey, at = (f"{head}/{stem}" if head else stem), len(key) - len(ext)
        else:
            base = self.base
            if base:
                rel = key[len(base) :] if key.startswith(base) else key
                folder, sep, name = rel.partition("/")
                if not sep or not name:
                    return self._skip(uri, key)
                skey = base + folder
            else:
                skey, sep, name = key.rpartition("/")
                if not sep:
                    return self._skip(uri, key)
            at = len(key) - len(name)
        j = len(self._size)
        if self._in_order:
            cur = (bucket, skey, key[at:] if at >= 0 else "data")
            prev = self._prev
            if prev is None or cur > prev:
                self._new.append(prev is None or cur[:2] != prev[:2])
            else:
                self._in_order = False  # out of order, or a field twice: sort and check
            self._prev = cur
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

    def _put_etag(self, j: int, etag: str) -> None:
        kind, raw = etag_code(etag)
        self._put_kind(kind)
        self._etag += raw
        if kind == _ETAG_OTHER:
            self._odd_etags[j] = etag

    def add_many(
        self, buckets: list[str], keys: list[str], sizes: list[int], etags: list[str], extras: list[str | None], order: int
    ) -> None:
        """Add objects as :meth:`add` would one by one (``extras`` as JSON text, the first object
        at ``order``), a column at a time where that gives the same: one sample per object
        (``group_by="object"``), one bucket, no folder keys."""
        n = len(keys)
        bucket = buckets[0] if n else ""
        one_bucket = n and buckets.count(bucket) == n
        if self.group_by != "object" or not one_bucket or "/\0" in "\0".join(keys) + "\0":
            for i in range(n):
                self.add(f"s3://{buckets[i]}/{keys[i]}", keys[i], sizes[i], etags[i], None, order + i, extras[i])
            return
        if self._in_order:
            prev = self._prev
            if (prev is not None and (bucket, keys[0], "data") <= prev) or not all(map(operator.lt, keys, keys[1:])):
                self._in_order = False  # out of order, or a key twice: build() sorts and checks
            else:
                self._new += b"\x01" * n
                self._prev = (bucket, keys[-1], "data")
        if bucket != self._last_bucket:
            self._last_id = self._buckets.setdefault(bucket, len(self._buckets))
            self._last_bucket = bucket
        j0 = len(self._size)
        self._bucket.extend(array("H", [self._last_id]) * n)
        chars = np.fromiter(map(len, keys), dtype=np.int64, count=n)
        joined = "".join(keys)
        encoded = joined.encode("utf-8", ENC)
        lens = chars if len(encoded) == len(joined) else np.array([len(k.encode("utf-8", ENC)) for k in keys], dtype=np.int64)
        text = self._text
        self._off.frombytes((np.cumsum(lens) + len(text)).tobytes())
        text += encoded
        self._size.extend(array("q", sizes))
        all_etags = "".join(etags)
        if len(all_etags) == 32 * n and _ALL_LOWER_HEX(all_etags):
            self._kind.extend(array("b", [_ETAG_MD5]) * n)
            self._etag += bytes.fromhex(all_etags)
        else:
            for i, etag in enumerate(etags):
                self._put_etag(j0 + i, etag)
        self._name_at.extend(array("i", [_DATA]) * n)
        self._klen.frombytes(chars.astype(np.int32).tobytes())
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

    def build(self, meta: dict[str, Any] | None = None) -> SampleIndex:
        """The index. The builder must not be used afterwards.

        Raises:
            ConfigError: a sample has the same field twice.
        """
        if self._n_skipped:
            why = {"stem": "no extension to name a field (expected NAME.FIELD)", "folder": "not inside a sub-folder"}
            log.warning(
                "group_by=%r left out %d object(s) of %s with %s, e.g. %s",
                self.group_by, self._n_skipped, self.source or "the source",
                why[self.group_by], ", ".join(self._skipped),
            )
        m = len(self._size)
        text = Strings(bytes(self._text), np.frombuffer(self._off, dtype=np.int64).copy())
        self._text = bytearray()
        bucket = np.frombuffer(self._bucket, dtype=np.uint16).copy()
        size = np.frombuffer(self._size, dtype=np.int64).copy()
        etag = np.frombuffer(bytes(self._etag), dtype=np.uint8).reshape(m, 16)
        kind = np.frombuffer(self._kind, dtype=np.int8).copy()
        name_at = np.frombuffer(self._name_at, dtype=np.int32).copy()
        klen = np.frombuffer(self._klen, dtype=np.int32).copy()
        new = np.frombuffer(bytes(self._new), dtype=np.uint8).astype(bool) if self._in_order else None
        bucket_names = sorted(self._buckets, key=self._buckets.__getitem__)
        odd_keys, odd_etags = self._odd_keys, self._odd_etags
        extra_at = np.frombuffer(self._extra_at, dtype=np.int64).copy()
        if not self._in_order:
            perm, new, ordered = self._sort(text, bucket_names, bucket, klen, name_at)
            inv = np.empty(m, dtype=np.int64)
            inv[perm] = np.arange(m, dtype=np.int64)
            text = Strings.of(ordered) if ordered is not None else text.take(perm)
            bucket, size, etag, kind, name_at, klen = (a[perm] for a in (bucket, size, etag, kind, name_at, klen))
            odd_keys = {int(inv[j]): v for j, v in odd_keys.items()}
            odd_etags = {int(inv[j]): v for j, v in odd_etags.items()}
            extra_at = inv[extra_at]
        assert new is not None
        first = np.concatenate([np.flatnonzero(new), [m]]).astype(np.int64) if m else np.zeros(1, dtype=np.int64)
        starts = first[:-1]
        sample_odd = {i: odd_keys[int(j)] for i, j in enumerate(starts.tolist()) if klen[j] < 0} if odd_keys else {}
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
            extras=_merge_extras(extra_at, np.frombuffer(self._extra_order, dtype=np.int64), self._extra_json, first),
            unused=Strings.of(self._unused) if self._unused is not None else None,
            meta={"source": self.source, "group_by": self.group_by, **(meta or {})},
        )
        _trim()
        return index

    def _sort(
        self, text: Strings, buckets: list[str], bucket: np.ndarray, klen: np.ndarray, name_at: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, list[str] | None]:
        """The order of (bucket, sample key, field name), where samples start in it, and where
        it is at hand, the keys in that order."""
        if self.group_by == "object" and len(buckets) == 1:
            # one object per sample and one bucket: the order of the keys, and each object
            # starts a sample unless a key is there twice (the general path says which)
            keys = list(text)
            perm = sorted(range(len(keys)), key=keys.__getitem__)
            ordered = list(map(keys.__getitem__, perm))
            if not any(map(operator.eq, ordered, ordered[1:])):
                return np.array(perm, dtype=np.int64), np.ones(len(perm), dtype=bool), ordered
        odd = self._odd_keys
        parts = zip(list(text), bucket.tolist(), klen.tolist(), name_at.tolist(), strict=True)
        # One string per object sorts like the (bucket, key, name) tuple as long as no part
        # holds a NUL character (which sorts below every other), and sorts faster.
        joined = b"\0" not in text.blob and not any("\0" in b for b in buckets)
        sort_keys: list[Any] = [
            (f"{buckets[b]}\0{okey[:k] if k >= 0 else odd[j]}\0{okey[at:] if at >= 0 else 'data'}" if joined else
             (buckets[b], okey[:k] if k >= 0 else odd[j], okey[at:] if at >= 0 else "data"))
            for j, (okey, b, k, at) in enumerate(parts)
        ]
        perm = sorted(range(len(sort_keys)), key=sort_keys.__getitem__)
        def parts_of(k: Any) -> tuple[str, str, str]:
            return tuple(k.split("\0")) if joined else k  # type: ignore[no-any-return]

        def group_of(k: Any) -> Any:
            return k.rpartition("\0")[0] if joined else k[:2]

        new = np.ones(len(perm), dtype=bool)
        prev = sort_keys[perm[0]] if perm else None
        prev_group = group_of(prev) if perm else None
        for n in range(1, len(perm)):
            cur = sort_keys[perm[n]]
            if cur == prev:
                b_, skey, name = parts_of(cur)
                dup = sorted(f"s3://{b_}/{text[j]}" for j in perm if sort_keys[j] == cur)
                message = f"sample {skey!r} has the field {name!r} twice ({', '.join(dup)}); use another group_by"
                raise SameObjectTwice(message, dup[0]) if len(set(dup)) == 1 else ConfigError(message)
            g = group_of(cur)
            new[n] = g != prev_group
            prev, prev_group = cur, g
        return np.array(perm, dtype=np.int64), new, None


def _trim() -> None:
    # The build's buffers grew by realloc on the C heap; hand what they left free back to the
    # system so that the index's own size is what stays resident (glibc only).
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


def _merge_extras(at: np.ndarray, order: np.ndarray, texts: list[str], first: np.ndarray) -> Sparse:
    """One JSON object per sample (``at``: where each object with extra fields now is): its
    objects' extra fields merged in input ``order``."""
    if not len(at):
        return Sparse.of({})
    if len(at) > 1 and not bool((np.diff(at) > 0).all()):
        o = np.argsort(at)
        at, order, texts = at[o], order[o], [texts[j] for j in o.tolist()]
    sample_of = np.searchsorted(first, at, side="right") - 1
    if len(sample_of) < 2 or bool((np.diff(sample_of) > 0).all()):
        # one object with extra fields per sample (a manifest's label): nothing to merge
        return Sparse(sample_of.astype(np.int64), Strings.of(texts))
    per: dict[int, list[tuple[int, str]]] = {}
    for s, n, text in zip(sample_of.tolist(), order.tolist(), texts, strict=True):
        per.setdefault(s, []).append((n, text))
    out = {}
    for s, items in per.items():
        if len(items) == 1:
            out[s] = items[0][1]
        else:
            merged: dict[str, Any] = {}
            for _, text in sorted(items):
                merged.update(json.loads(text))
            out[s] = json.dumps(merged)
    return Sparse.of(out)
