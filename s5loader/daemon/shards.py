"""``s5loader prefetch --shards``: the daemon over tar shards.

Deliveries are samples, as for objects; the engine stages shards. Each epoch takes the
shards in order (a seeded permutation with ``--shuffle``) and the samples of a shard in tar
order, so a shard's samples are consecutive deliveries: one *visit* of the shard. When a
visit's shard is staged, the daemon checks it once and writes each sample out of it into a
folder (its fields named by extension, read by offset: a member name never becomes a path),
which is renamed into the cache as for objects; the shard is deleted after its last sample.

The budget counts a shard while it is staged and each delivered sample until the consumer
deletes it; the engine stages a new shard only within the budget less the largest shard, the
room its samples take while the shard is unpacked, so the cache never holds more than the
budget (which must hold two of the largest shard).
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import replace
from typing import overload

from .._index.sample import Field, Sample
from .._sampling.order import Order
from .._sampling.units import SHARD_WORKERS
from .._shards import tar as _tar
from .._util.uri import format_size
from ..config import StagingOptions
from ..dataset import S5Dataset
from ..exceptions import BudgetError, S5LoaderError
from ..staging.layout import field_names
from .epochs import index_fingerprint

log = logging.getLogger(__name__)

UNPACK_DIR = ".u"


class ShardDeliveries(Sequence[Sample]):
    """All epochs' deliveries over shards: item ``seq`` is the shard that holds delivery ``seq``;
    :attr:`visits` is what the engine stages (item ``v``: the shard of visit ``v``)."""

    def __init__(self, dataset: S5Dataset, order: Order, epochs: int) -> None:
        assert dataset.shards is not None, "deliveries over shards need a dataset of shards"
        self.dataset = dataset
        self.shards = dataset.shards
        self.visit_shard: list[int] = []
        self.first = [0]
        for epoch in range(epochs):
            for s in order.indices(len(self.shards), epoch):
                n = self.shards[s].nsamples
                if n:
                    self.visit_shard.append(s)
                    self.first.append(self.first[-1] + n)
        self.visits = _Visits(self)

    def __len__(self) -> int:
        return self.first[-1]

    @overload
    def __getitem__(self, seq: int) -> Sample: ...

    @overload
    def __getitem__(self, seq: slice) -> Sequence[Sample]: ...

    def __getitem__(self, seq: int | slice) -> Sample | Sequence[Sample]:
        if isinstance(seq, slice):
            return [self[i] for i in range(*seq.indices(len(self)))]
        return self.dataset.samples[self.visit_shard[self.visit_of(seq)]]

    def visit_of(self, seq: int) -> int:
        if not 0 <= seq < len(self):
            raise IndexError(seq)
        return bisect.bisect_right(self.first, seq) - 1

    def fingerprint(self) -> str:
        counts = ",".join(str(s.nsamples) for s in self.shards)
        return hashlib.sha256(f"{index_fingerprint(self.dataset.samples)}\n{counts}".encode()).hexdigest()

    def engine_options(self, options: StagingOptions, budget: int) -> StagingOptions:
        """The engine's options over shards: the budget less the largest shard (see
        :meth:`check_budget`), ``samples_per_call`` in shards, at most
        :data:`~s5loader._sampling.units.SHARD_WORKERS` shards of a call at once."""
        per_shard = max(1.0, len(self) / max(1, len(self.visits)))
        return replace(
            options, budget=self.check_budget(budget),
            samples_per_call=max(1, round(options.samples_per_call / per_shard)),
            s5cmd_workers=min(options.s5cmd_workers, SHARD_WORKERS),
        )

    def check_budget(self, budget: int) -> int:
        """The engine's limit: the budget less the largest shard (its unpacked samples).

        Raises:
            BudgetError: the budget does not hold two of the largest shard.
        """
        # a shard staged (its tar beside it, when compressed) and the samples unpacked from it
        big = max(self.shards, key=lambda s: s.disk + (s.tarsize or s.size))
        unpacked = big.tarsize or big.size
        if big.disk + unpacked > budget:
            raise BudgetError(
                f"--budget {format_size(budget)} is too small for the shard {big.uri} "
                f"({format_size(big.size)}{', ' + format_size(big.tarsize) + ' decompressed' if big.tarsize else ''}): "
                f"a shard and its unpacked samples are in the cache at once, so the budget must "
                f"hold {format_size(big.disk + unpacked)} (twice the largest shard"
                f"{', its tar counted twice' if big.tarsize else ''}); raise --budget"
            )
        return budget - unpacked


class _Visits(Sequence[Sample]):
    def __init__(self, deliveries: ShardDeliveries) -> None:
        self._d = deliveries

    def __len__(self) -> int:
        return len(self._d.visit_shard)

    @overload
    def __getitem__(self, v: int) -> Sample: ...

    @overload
    def __getitem__(self, v: slice) -> Sequence[Sample]: ...

    def __getitem__(self, v: int | slice) -> Sample | Sequence[Sample]:
        if isinstance(v, slice):
            return [self[i] for i in range(*v.indices(len(self)))]
        return self._d.dataset.samples[self._d.visit_shard[v]]


class Unpacker:
    """Checks a staged shard once, writes its samples out as folders, deletes it after."""

    def __init__(self, deliveries: ShardDeliveries, staging: str, on_error: str) -> None:
        self.d = deliveries
        self.staging = staging
        self.on_error = on_error
        self.visit = -1
        self._members: list[_tar.TarSample] | None = None

    def shard_path(self, v: int) -> str:
        shard = self.d.visits[v]
        return f"{self.staging}/{v}/{field_names(shard)[0]}"

    def open(self, v: int) -> bool:
        """Check visit ``v``'s staged shard; False when it is skipped (``on_error="skip"``)."""
        if v == self.visit:
            return self._members is not None
        self.visit, self._members = v, None
        s = self.d.visit_shard[v]
        uri = self.d.shards[s].uri
        try:
            if _tar.is_gzip(uri):
                _tar.gunzip_file(self.shard_path(v), uri)
            members = _tar.scan_file(self.shard_path(v), uri)
            self.d.shards.check_members(s, members)
        except S5LoaderError as exc:
            self.drop(v)
            if self.on_error != "skip":
                raise
            log.warning("skipping the samples of %s: %s", uri, exc)
            return False
        self._members = members
        return True

    def unpack(self, seq: int) -> tuple[str, str, int]:
        """Write delivery ``seq`` (of the open visit) into a folder of its own: (folder, key, bytes)."""
        v = self.d.visit_of(seq)
        assert v == self.visit and self._members is not None
        sample = self._members[seq - self.d.first[v]]
        folder = f"{self.staging}/{UNPACK_DIR}/{seq}"
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        names = field_names(Sample(sample.key, tuple(Field(m.field, "", m.size, "") for m in sample.members)))
        with open(self.shard_path(v), "rb") as src:
            for m, name in zip(sample.members, names, strict=True):
                src.seek(m.offset)
                with open(f"{folder}/{name}", "wb") as out:
                    left = m.size
                    while left:
                        chunk = src.read(min(left, 1 << 20))
                        if not chunk:
                            raise S5LoaderError(f"{self.d[seq].fields[0].uri}: member of {sample.key!r} ends early")
                        out.write(chunk)
                        left -= len(chunk)
        if seq == self.d.first[v + 1] - 1:
            self.drop(v)
        return folder, sample.key, sum(m.size for m in sample.members)

    def drop(self, v: int) -> None:
        shutil.rmtree(f"{self.staging}/{v}", ignore_errors=True)
