"""The compact sample index: every sample, field, key, size and ETag in a few flat arrays and
one string table, so that memory grows by tens of bytes per object above the key text, and a
forked DataLoader worker reading it does not copy it page by page (a NumPy array or a
``bytes`` object is one Python object: touching it changes one reference count, not one per
element).

Layout (``m`` fields in index order, sample by sample; ``n`` samples):

- ``text`` / ``text_off`` (m + 1): the UTF-8 object key of every field, concatenated.
- ``bucket`` (m, uint16) into ``buckets``; ``size`` (m, int64).
- ``etag`` (m x 16 bytes) where the ETag is a plain lowercase MD5 hex digest; others (multipart
  ``...-N``, empty) are marked in ``etag_kind`` and kept in a sparse string table.
- ``name_at`` (m, int32): the field name is the object key from this character on (the
  grouping makes it a suffix); -1 means ``data``; -2 an irregular name in a sparse table.
- ``first`` (n + 1, int64): sample ``i`` has fields ``first[i]`` to ``first[i+1] - 1``.
- ``key_len`` (n, int32): the sample key is its first field's object key up to this many
  characters (after ``bucket/`` when the index spans several buckets); -1 means irregular.
- sparse tables (sample or field number -> string): irregular keys and names, other ETags,
  and each sample's extra fields as one JSON object, only where a sample has some.
- ``unused``: keys a listing returned that no sample uses (folder markers, objects the
  grouping left out), so that blocks know everything under a prefix.

A per-sample column (a label, say) is one more array of length ``n`` in :attr:`columns`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from .sample import DISK, Field, Sample

_ETAG_NONE, _ETAG_MD5, _ETAG_OTHER = 0, 1, 2
_DATA, _IRREGULAR = -1, -2
ENC = "surrogatepass"  # keys are str; lone surrogates from JSON escapes still round-trip


class Strings(Sequence[str]):
    """Strings in one UTF-8 blob with offsets: two Python objects however many strings."""

    def __init__(self, blob: bytes, off: np.ndarray) -> None:
        self.blob = blob
        self.off = off
        self._off = np.ascontiguousarray(off, dtype=np.int64).data  # a memoryview: plain ints, fast

    @classmethod
    def of(cls, items: Sequence[str]) -> Strings:
        joined = "".join(items)
        if joined.isascii():  # a byte per character
            off = np.zeros(len(items) + 1, dtype=np.int64)
            np.cumsum(np.fromiter(map(len, items), dtype=np.int64, count=len(items)), out=off[1:])
            return cls(joined.encode("ascii"), off)
        parts = [s.encode("utf-8", ENC) for s in items]
        off = np.zeros(len(parts) + 1, dtype=np.int64)
        if parts:
            np.cumsum(np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts)), out=off[1:])
        return cls(b"".join(parts), off)

    def __len__(self) -> int:
        return len(self.off) - 1

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        off = self._off
        return self.blob[off[i] : off[i + 1]].decode("utf-8", ENC)

    def __iter__(self) -> Iterator[str]:
        blob, off = self.blob, self.off.tolist()
        if blob.isascii():  # a character per byte: decode once, then slice
            text = blob.decode("ascii")
            return map(text.__getitem__, map(slice, off, off[1:]))
        return (blob[a:b].decode("utf-8", ENC) for a, b in zip(off, off[1:], strict=False))


class Sparse:
    """A string for a few of the numbers ``0..N-1`` (sorted ``at``, ``strings`` alike)."""

    def __init__(self, at: np.ndarray, strings: Strings) -> None:
        self.at = at
        self.strings = strings

    @classmethod
    def of(cls, items: dict[int, str]) -> Sparse:
        keys = sorted(items)
        return cls(np.array(keys, dtype=np.int64), Strings.of([items[k] for k in keys]))

    def get(self, i: int) -> str | None:
        if not len(self.at):
            return None
        j = int(np.searchsorted(self.at, i))
        return self.strings[j] if j < len(self.at) and self.at[j] == i else None

    def __len__(self) -> int:
        return len(self.at)


class Listing(Sequence[str]):
    """The keys of two string tables, one after the other."""

    def __init__(self, used: Strings, unused: Strings) -> None:
        self.used = used
        self.unused = unused

    def __len__(self) -> int:
        return len(self.used) + len(self.unused)

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        n = len(self.used)
        return self.used[i] if i < n else self.unused[i - n]

    def __iter__(self) -> Iterator[str]:
        yield from self.used
        yield from self.unused


class SampleIndex(Sequence[Sample]):
    """The samples of a data set, held compactly; ``index[i]`` builds a :class:`Sample`.

    Build one with :class:`~s5loader._index.builder.IndexBuilder` or :meth:`from_samples`; save and
    load it with :mod:`s5loader._index.saved`.
    """

    def __init__(
        self,
        *,
        text: Strings,
        buckets: list[str],
        bucket: np.ndarray,
        size: np.ndarray,
        etag: np.ndarray,
        etag_kind: np.ndarray,
        name_at: np.ndarray,
        first: np.ndarray,
        key_len: np.ndarray,
        bucket_in_key: bool,
        irregular_keys: Sparse,
        irregular_names: Sparse,
        other_etags: Sparse,
        extras: Sparse,
        unused: Strings | None = None,
        columns: dict[str, np.ndarray] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.text = text
        self.buckets = list(buckets)
        self.bucket = bucket
        self.size = size
        self.etag = etag
        self.etag_kind = etag_kind
        self.name_at = name_at
        self.first = first
        self.key_len = key_len
        self.bucket_in_key = bucket_in_key
        self.irregular_keys = irregular_keys
        self.irregular_names = irregular_names
        self.other_etags = other_etags
        self.extras = extras
        self.unused = unused
        self.columns = columns or {}
        self.meta = dict(meta or {})
        self._sizes: np.ndarray | None = None
        self._saved: bytes | None = None  # the serialized form, made once (pickling, saving)
        # memoryviews give plain Python ints item by item, several times faster than NumPy
        # scalars; like the arrays they are single objects for a forked worker to touch
        self._first, self._size, self._bucket = _view(first), _view(size), _view(bucket)
        self._kind, self._name_at, self._key_len = _view(etag_kind), _view(name_at), _view(key_len)
        self._etag = _view(etag.reshape(-1))

    # -- the Sequence[Sample] view ---------------------------------------------------------
    def __len__(self) -> int:
        return len(self.first) - 1

    @overload
    def __getitem__(self, i: int) -> Sample: ...

    @overload
    def __getitem__(self, i: slice) -> list[Sample]: ...

    def __getitem__(self, i: int | slice) -> Sample | list[Sample]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        a, b = self._first[i], self._first[i + 1]
        fields = tuple(self.field(j) for j in range(a, b))
        return Sample(self.key(i), fields, self.extra(i))

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]

    def object_key(self, j: int) -> str:
        """The object key of field number ``j`` (fields counted over the whole index)."""
        return self.text[j]

    def field_name(self, j: int) -> str:
        """The name of field number ``j`` (fields counted over the whole index)."""
        at = self._name_at[j]
        if at >= 0:
            return self.text[j][at:]
        if at == _DATA:
            return "data"
        return self.irregular_names.get(j) or ""

    def field(self, j: int) -> Field:
        okey = self.text[j]
        at = self._name_at[j]
        if at >= 0:
            name = okey[at:]
        elif at == _DATA:
            name = "data"
        else:
            name = self.irregular_names.get(j) or ""
        kind = self._kind[j]
        if kind == _ETAG_MD5:
            etag = self._etag[16 * j : 16 * j + 16].hex()
        elif kind == _ETAG_OTHER:
            etag = self.other_etags.get(j) or ""
        else:
            etag = ""
        return Field(name, f"s3://{self.buckets[self._bucket[j]]}/{okey}", self._size[j], etag)

    def sample_field(self, i: int, j: int) -> Field:
        """Field ``j`` of sample ``i`` (``self[i].fields[j]``, the sample not built)."""
        return self.field(self._first[i] + j)

    def key(self, i: int) -> str:
        """The key of sample ``i``."""
        klen = self._key_len[i]
        if klen < 0:
            return self.irregular_keys.get(i) or ""
        j = self._first[i]
        okey = self.text[j][:klen]
        return f"{self.buckets[self._bucket[j]]}/{okey}" if self.bucket_in_key else okey

    def extra(self, i: int) -> dict[str, Any] | None:
        """The extra fields a manifest gave sample ``i``, or ``None``."""
        found = self.extras.get(i)
        extra = json.loads(found) if found is not None else None
        if self.columns:
            extra = extra or {}
            for name, column in self.columns.items():
                extra[name] = column[i].item()
        return extra

    def extras_at(self) -> list[int]:
        """The samples a manifest gave extra fields."""
        return [int(i) for i in self.extras.at]

    def set_column(self, name: str, values: np.ndarray) -> None:
        """Give every sample one more value, returned among its extra fields."""
        if len(values) != len(self):
            raise ValueError(f"column {name!r} has {len(values)} values for {len(self)} samples")
        self.columns[name] = values
        self._saved = None
        self._sizes = None  # a DISK column changes them

    # -- vectorised helpers ----------------------------------------------------------------
    def sizes(self) -> np.ndarray:
        """Bytes per sample (int64, computed once)."""
        if self._sizes is None:
            sizes = np.zeros(len(self), dtype=np.int64)
            counts = np.diff(self.first)
            has = counts > 0
            if len(self.size) and has.any():
                sizes[has] = np.add.reduceat(self.size, self.first[:-1][has])
            disk = self.columns.get(DISK)
            if disk is not None:  # units that take more disk than their objects (see DISK)
                sizes = np.maximum(sizes, disk.astype(np.int64))
            self._sizes = sizes
        return self._sizes

    @property
    def total_bytes(self) -> int:
        """Bytes of all samples staged (:meth:`sizes` summed)."""
        return int(self.sizes().sum())

    def largest(self) -> int:
        """The number of the largest sample."""
        return int(np.argmax(self.sizes()))

    def field_counts(self) -> np.ndarray:
        return np.diff(self.first)

    @property
    def listing(self) -> Listing | None:
        """Every key the listing returned (those of the samples' fields and the unused ones),
        or ``None`` when the index was not built from a listing."""
        return None if self.unused is None else Listing(self.text, self.unused)

    # -- building from plain samples ---------------------------------------------------------
    @classmethod
    def from_samples(cls, samples: Sequence[Sample], meta: dict[str, Any] | None = None) -> SampleIndex:
        """An index of the given samples, in the given order."""
        if isinstance(samples, SampleIndex):
            return samples
        buckets: dict[str, int] = {}
        okeys: list[str] = []
        bucket, size, kinds, name_at, first, key_len = [], [], [], [], [0], []
        etag = bytearray()
        keys_odd: dict[int, str] = {}
        names_odd: dict[int, str] = {}
        etags_odd: dict[int, str] = {}
        extras: dict[int, str] = {}
        for i, s in enumerate(samples):
            for f in s.fields:
                b, _, okey = f.uri[5:].partition("/")
                j = len(okeys)
                okeys.append(okey)
                bucket.append(buckets.setdefault(b, len(buckets)))
                size.append(f.size)
                kind, raw = etag_code(f.etag)
                kinds.append(kind)
                etag += raw
                if kind == _ETAG_OTHER:
                    etags_odd[j] = f.etag
                if okey.endswith(f.name) and f.name:
                    name_at.append(len(okey) - len(f.name))
                else:
                    name_at.append(_IRREGULAR)
                    names_odd[j] = f.name
            if s.fields and okeys[first[-1]].startswith(s.key):
                key_len.append(len(s.key))
            else:
                key_len.append(-1)
                keys_odd[i] = s.key
            first.append(len(okeys))
            if s.extra:
                extras[i] = json.dumps(s.extra)
        return cls(
            text=Strings.of(okeys),
            buckets=list(buckets),
            bucket=np.array(bucket, dtype=np.uint16),
            size=np.array(size, dtype=np.int64),
            etag=np.frombuffer(bytes(etag), dtype=np.uint8).reshape(-1, 16),
            etag_kind=np.array(kinds, dtype=np.int8),
            name_at=np.array(name_at, dtype=np.int32),
            first=np.array(first, dtype=np.int64),
            key_len=np.array(key_len, dtype=np.int32),
            bucket_in_key=False,
            irregular_keys=Sparse.of(keys_odd),
            irregular_names=Sparse.of(names_odd),
            other_etags=Sparse.of(etags_odd),
            extras=Sparse.of(extras),
            meta=meta,
        )

    # Pickling and saving: the saved form (s5loader._index.saved), made once per index, which
    # that module registers with copyreg.

    def __repr__(self) -> str:
        return f"SampleIndex({len(self)} samples, {len(self.size)} objects)"


def _view(a: np.ndarray) -> memoryview:
    return np.ascontiguousarray(a).data


_ZERO16 = bytes(16)


def etag_code(etag: str) -> tuple[int, bytes]:
    """How an ETag is kept: ``(kind, 16 bytes)``."""
    if len(etag) == 32:
        try:
            raw = bytes.fromhex(etag)
        except ValueError:
            return _ETAG_OTHER, _ZERO16
        if raw.hex() == etag:
            return _ETAG_MD5, raw
        return _ETAG_OTHER, _ZERO16
    return (_ETAG_OTHER, _ZERO16) if etag else (_ETAG_NONE, _ZERO16)
