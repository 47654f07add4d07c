"""Putting the builder's objects in (bucket, sample key, field name) order, and finding an
object or a field given twice.

Listings come sorted by key, and for most data sets that order is already the order of samples
and fields: :class:`InputOrder` checks it as objects arrive and marks where samples start, so
that :func:`sort_objects` runs only when the input is out of order.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator
from itertools import pairwise, repeat, starmap
from typing import Any

import numpy as np

from ..exceptions import ConfigError
from .compact import Strings, _view


class SameObjectTwice(ConfigError):
    """An object was given twice (a sample would have the same field twice)."""

    def __init__(self, message: str, uri: str = "") -> None:
        super().__init__(message)
        self.uri = uri

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (self.__class__, (self.args[0], self.uri))


class InputOrder:
    """Whether the objects added so far rise in (bucket, sample key, field name) and, while they
    do, where samples start (``new``: 1 for an object that starts one)."""

    def __init__(self) -> None:
        self.in_order = True
        self.new = bytearray()
        self._prev: tuple[str, str, str] | None = None

    def note(self, cur: tuple[str, str, str]) -> None:
        """One more object, as (bucket, sample key, field name)."""
        prev = self._prev
        if prev is None or cur > prev:
            self.new.append(prev is None or cur[:2] != prev[:2])
        else:
            self.in_order = False  # out of order, or a field twice: sort and check
        self._prev = cur

    def note_column(
        self, buckets: list[str] | None, bucket: str, keys: list[str], skeys: list[str], ats: list[int] | None
    ) -> None:
        """:meth:`note` over a column of objects (``buckets`` ``None``: all in ``bucket``; ``ats``
        ``None``: one object per sample, the field ``data``)."""
        n = len(keys)
        names: list[Any] = (
            ["data"] * n if ats is None else list(map(operator.getitem, keys, map(slice, ats, repeat(None))))
        )
        cur: list[Any] = (
            keys
            if buckets is None and ats is None
            else list(zip(buckets or [bucket] * n, skeys, names, strict=True))
        )
        prev, first = self._prev, ((buckets or [bucket])[0], skeys[0], names[0])
        if (prev is not None and first <= prev) or not all(map(operator.lt, cur, cur[1:])):
            self.in_order = False  # out of order, or an object twice: the build sorts and checks
            return
        self.new.append(prev is None or first[:2] != prev[:2])
        if ats is None:  # rising keys: every object is a sample
            self.new += b"\x01" * (n - 1)
        else:
            samples: list[Any] = skeys if buckets is None else list(zip(buckets, skeys, strict=True))
            self.new += bytes(map(operator.ne, samples[1:], samples))
        self._prev = ((buckets or [bucket])[-1], skeys[-1], names[-1])


def sort_objects(
    group_by: str,
    odd: dict[int, str],
    text: Strings,
    buckets: list[str],
    bucket: np.ndarray,
    klen: np.ndarray,
    name_at: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The order of (bucket, sample key, field name), where samples start in it, and the keys
    in that order (``odd``: the sample keys that are no prefix of their object's key).

    Raises:
        SameObjectTwice: an object is there twice.
        ConfigError: a sample would have the same field twice.
    """
    keys = list(text)
    n = len(keys)
    if group_by == "object" and len(buckets) == 1:
        # one object per sample and one bucket: the order of the keys, and each object
        # starts a sample unless a key is there twice (the general path says which)
        perm = sorted(range(n), key=keys.__getitem__)
        ordered = list(map(keys.__getitem__, perm))
        if not any(map(operator.eq, ordered, ordered[1:])):
            return np.array(perm, dtype=np.int64), np.ones(n, dtype=bool), ordered
    skeys: Iterable[str] = map(
        operator.getitem, keys, map(slice, _view(klen))
    )  # memoryviews: no list of ints
    if odd:
        skeys = [odd.get(j, skey) for j, skey in enumerate(skeys)]
    # One string per object sorts like the (bucket, key, name) tuple as long as no part
    # holds a NUL character (which sorts below every other), and sorts faster.
    joined = b"\0" not in text.blob and not any("\0" in b for b in buckets)
    parts = zip(map(buckets.__getitem__, _view(bucket)), skeys, keys, _view(name_at), strict=True)
    sort_keys: list[Any] = (
        [f"{b}\0{s}\0{k[at:] if at >= 0 else 'data'}" for b, s, k, at in parts]
        if joined
        else [((b, s), k[at:] if at >= 0 else "data") for b, s, k, at in parts]
    )
    perm = sorted(range(n), key=sort_keys.__getitem__)
    ordered = list(map(sort_keys.__getitem__, perm))
    if any(map(operator.eq, ordered, ordered[1:])):
        _refuse_twice(joined, keys, perm, sort_keys, ordered)
    order = np.array(perm, dtype=np.int64)
    del perm, sort_keys
    # a sample starts where (bucket, sample key), the sort key up to its last part, changes
    if joined:
        head = np.array([len(b) + 1 for b in buckets], dtype=np.int64)[bucket] + klen
        for j, skey in odd.items():
            head[j] = len(buckets[int(bucket[j])]) + 1 + len(skey)
        groups: Iterator[Any] = map(operator.getitem, ordered, map(slice, _view(head[order])))
    else:
        groups = map(operator.itemgetter(0), ordered)
    new = np.ones(n, dtype=bool)
    new[1:] = np.fromiter(starmap(operator.ne, pairwise(groups)), dtype=bool, count=max(n - 1, 0))
    del ordered
    return order, new, list(map(keys.__getitem__, _view(order)))


def apply_order(
    perm: np.ndarray, columns: list[np.ndarray], by_object: list[dict[int, str]], at: np.ndarray
) -> tuple[list[np.ndarray], list[dict[int, str]], np.ndarray]:
    """``columns`` (one row per object), the maps keyed by object number ``by_object`` and the
    object numbers ``at``, once the objects are in ``perm``'s order."""
    inv = np.empty(len(perm), dtype=np.int64)
    inv[perm] = np.arange(len(perm), dtype=np.int64)
    return [a[perm] for a in columns], [{int(inv[j]): v for j, v in d.items()} for d in by_object], inv[at]


def _refuse_twice(
    joined: bool, keys: list[str], perm: list[int], sort_keys: list[Any], ordered: list[Any]
) -> None:
    """Raise for the first sort key ``ordered`` holds twice, naming the objects behind it.

    Raises:
        SameObjectTwice: one object is there twice.
        ConfigError: two objects would be the same field of a sample.
    """
    cur = next(a for a, b in pairwise(ordered) if a == b)
    b_, skey, name = cur.split("\0") if joined else (*cur[0], cur[1])
    dup = sorted(f"s3://{b_}/{keys[j]}" for j in perm if sort_keys[j] == cur)
    message = f"sample {skey!r} has the field {name!r} twice ({', '.join(dup)}); use another group_by"
    raise SameObjectTwice(message, dup[0]) if len(set(dup)) == 1 else ConfigError(message)
