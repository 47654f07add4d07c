"""The tar shards behind a dataset that ``S5Dataset.from_shards`` makes: a :class:`ShardSet`.

Sample ``i`` is sample ``j`` of shard ``s`` (shards in source order, samples in tar order).
Staged by :class:`~s5loader.S5Sampler`, a shard lies whole in the pass folder and a worker
reads a sample's members by offset from it (the member table the sampler wrote after checking
the shard), then drops the sample's claim on the shard; the last claim deletes the shard (see
:mod:`s5loader._staging.layout`). Without a staged copy the shard is fetched with one GET and
kept in memory (one per process) for the next samples.
"""

from __future__ import annotations

import bisect
import gzip
import logging
import os
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

import numpy as np

from .._index.sample import Field, Sample
from .._s3api.client import s3_client
from .._s3api.errors import boto3_error
from .._staging.holes import SampleSpans
from .._staging.layout import StagingLayout
from .._staging.reader import StagedIndex
from .._util.platform import HOLE_BLOCK
from .._util.uri import parse_s3_uri
from ..config import Access
from ..exceptions import EmptySourceError, ShardError
from . import tar as _tar
from .index import Shard

log = logging.getLogger(__name__)

# Samples of the member tables a worker keeps, least recently read dropped first (a member
# entry takes about half a kilobyte): enough for every shard open at once under a 2 GiB budget
# of 40 KB samples, since shuffle=True reads from all of them in turn and reading a shard's
# table again for each sample would be a large share of the reading; a worker keeps the tables
# of shards other workers finished until they age out.
_TABLE_SAMPLES = 50_000


class ShardSet(Sequence[Shard]):
    """The shards of a data set (in source order), each with its sample count, and how sample
    ``i`` is found and read: sample ``j`` of shard ``s``. An :class:`~s5loader.S5Dataset` made
    by :meth:`~s5loader.S5Dataset.from_shards` holds one as ``dataset.shards``; its
    :attr:`units` (one per shard, field ``tar``) are what :class:`~s5loader.S5Sampler` stages
    and budgets, and ``len(dataset)`` counts samples.

    Raises:
        EmptySourceError: the shards hold no sample.
    """

    def __init__(
        self,
        shards: Sequence[Shard],
        access: Access,
        source: str = "",
        index_uri: str = "",
        meta: dict[str, Any] | None = None,
    ) -> None:
        self._shards: list[Shard] = list(shards)
        self.access = access
        self.source = source
        self.index_uri = index_uri
        #: What the index says beyond the shard list: ``shuffled``, ``classes`` (see index_meta).
        self.meta: dict[str, Any] = dict(meta or {})
        first = [0]
        for s in self._shards:
            first.append(first[-1] + s.nsamples)
        if first[-1] == 0:
            raise EmptySourceError(f"the shards of {source} hold no sample (index {index_uri})")
        self._first = first
        self._tables: OrderedDict[tuple[str, int], _tar.Table] = OrderedDict()
        self._cached: tuple[int, bytes, list[_tar.TarSample]] | None = None
        self._warned_unstaged = False

    # -- the shards ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._shards)

    def __getitem__(self, i: int) -> Shard:  # type: ignore[override]
        return self._shards[i]

    def __iter__(self) -> Iterator[Shard]:
        return iter(self._shards)

    @property
    def units(self) -> list[Sample]:
        """One staging unit per shard: the shard object as the field ``tar``."""
        return [
            Sample(s.uri[5:].partition("/")[2], (Field("tar", s.uri, s.size, s.etag),)) for s in self._shards
        ]

    @property
    def disk(self) -> np.ndarray | None:
        """Per shard, what staging it takes on disk (:attr:`Shard.disk
        <s5loader._shards.index.Shard.disk>`) when a shard is compressed, else ``None``: the
        dataset gives it to its units as their :data:`~s5loader._index.sample.DISK` column,
        which the budget counts."""
        if not any(s.tarsize for s in self._shards):
            return None
        return np.array([s.disk for s in self._shards], dtype=np.int64)

    @property
    def samples(self) -> int:
        """Samples in all shards."""
        return self._first[-1]

    def locate(self, index: int) -> tuple[int, int]:
        """Sample ``index`` -> (shard number, sample number inside the shard)."""
        i = int(index)
        if not 0 <= i < self._first[-1]:
            raise IndexError(f"sample {i} out of range (0..{self._first[-1] - 1})")
        s = bisect.bisect_right(self._first, i) - 1
        return s, i - self._first[s]

    def shard_samples(self, shard: int) -> range:
        """The sample indices of one shard."""
        return range(self._first[shard], self._first[shard + 1])

    @property
    def shard_units(self) -> list[list[int]]:
        """The samples of each shard, for ``shuffle="block"`` (a shard is a block)."""
        return [list(self.shard_samples(s)) for s in range(len(self._shards))]

    def unit_of(self, index: int) -> int:
        """The staging unit of sample ``index``: its shard."""
        return self.locate(index)[0]

    def units_of(self, order: Sequence[int]) -> list[int]:
        """The shard of each sample of ``order`` (in range: see :meth:`locate`), at once."""
        if not len(order):
            return []
        return (np.searchsorted(self._first, np.asarray(order, dtype=np.int64), side="right") - 1).tolist()

    def describe(self) -> str:
        return f"{self.samples} samples in {len(self._shards)} shards"

    def freed_per_sample(self, shard: int, block: int = HOLE_BLOCK) -> int:
        """The bytes of ``shard`` that reading one of its samples gives back for certain, whatever
        its neighbours (see :meth:`StagingLayout.release_shard_sample
        <s5loader._staging.layout.StagingLayout.release_shard_sample>`): 90% of its samples'
        mean size less four blocks (the blocks it shares with samples not read yet stay); 0 for
        samples too small to free a block alone."""
        sh = self._shards[shard]
        mean = (sh.tarsize or sh.size) / max(1, sh.nsamples)
        return int(0.9 * max(0.0, mean - 4 * block))

    def spans(
        self,
        shard: int,
        table: _tar.Table | Sequence[_tar.TarSample],
        size: int,
        layout: StagingLayout | None = None,
    ) -> SampleSpans:
        """The spans of ``shard``'s samples staged as a file of ``size`` bytes whose member
        table (so far) is ``table``: what reading them gives back (see
        :mod:`s5loader._staging.holes`); with the pass's ``layout``, a table that may still grow
        (a shard read while it downloads) is read again from it when asked. Made once per table
        a reader loads (each read of a sample asks for it)."""
        if isinstance(table, _tar.Table) and table.spans is not None:
            spans: SampleSpans = table.spans
            spans.size = size
            return spans

        def grow() -> tuple[Callable[[int], int], int]:
            assert layout is not None
            self._tables.pop((layout.folder, shard), None)
            fresh = self._table(layout, shard)
            return (fresh.end, len(fresh)) if fresh is not None else (spans._end_of, spans.known)

        if isinstance(table, _tar.Table):
            end_of: Callable[[int], int] = table.end
        else:
            rows = table
            end_of = lambda k: max(m.offset + m.size for m in rows[k].members)  # noqa: E731
        spans = SampleSpans(
            end_of, len(table), self._shards[shard].nsamples, size, grow if layout is not None else None
        )
        if isinstance(table, _tar.Table):
            table.spans = spans
        return spans

    def check_members(self, shard: int, members: list[_tar.TarSample]) -> None:
        """Raise :class:`ShardError` when a shard disagrees with its index."""
        sh = self._shards[shard]
        if len(members) != sh.nsamples:
            extra = f"; its last sample is {members[-1].key!r}" if members else ""
            raise ShardError(
                f"{sh.uri} holds {len(members)} samples, the shard index {self.index_uri} says "
                f"{sh.nsamples}{extra}: rebuild the index with s5loader index-shards"
            )

    # -- reading a sample -----------------------------------------------------------------
    def read(
        self, index: int, units: Sequence[Sample], access: Access | None = None
    ) -> tuple[dict[str, Any], str]:
        """Sample ``index`` (``{"__key__": ..., FIELD: bytes}``) and its shard's URI: from the
        staged shard when ``index`` is a :class:`StagedIndex` of a pass that staged it, else
        from the shard fetched with one GET (kept in memory for the next samples). ``units`` are
        the data set's units (:attr:`units`, as its index holds them); ``access`` (default: the
        shards') reaches the store for a direct read."""
        s, j = self.locate(index)
        out = None
        if isinstance(index, StagedIndex):
            out = self._read_staged_member(
                StagingLayout(index.folder), s, j, index.keep, units, index.frees, index.back
            )
            if out is None and not self._warned_unstaged and os.path.isdir(index.folder):
                self._warned_unstaged = True
                log.warning(
                    "shard %s was not staged in %s; fetching it directly (further cases are not logged)",
                    self._shards[s].uri,
                    index.folder,
                )
        if out is None:
            out = self._fetch_member(s, j, access or self.access)
        return out, self._shards[s].uri

    def _table(self, layout: StagingLayout, shard: int) -> _tar.Table | None:
        key = (layout.folder, shard)
        table = self._tables.get(key)
        if table is not None:
            try:
                self._tables.move_to_end(key)
            except KeyError:  # dropped meanwhile by another thread of this process
                pass
            return table
        try:
            with open(layout.shard_table(shard), "rb") as fh:
                table = _tar.loads(fh.read())
        except FileNotFoundError:
            return None
        self._tables[key] = table
        kept = sum(map(len, self._tables.values()))
        while kept > _TABLE_SAMPLES and len(self._tables) > 1:
            kept -= len(self._tables.popitem(last=False)[1])
        return table

    def _read_staged_member(
        self,
        layout: StagingLayout,
        s: int,
        j: int,
        keep: bool,
        units: Sequence[Sample],
        frees: bool = False,
        back: bool = False,
    ) -> dict[str, Any] | None:
        table = self._table(layout, s)
        if table is not None and j >= len(table):  # a shard read while it downloads: look again
            self._tables.pop((layout.folder, s), None)
            table = self._table(layout, s)
        if table is None or j >= len(table):
            return None
        sample = table[j]
        if table.path is None:  # the staged file, named once per table a reader loads
            table.path = layout.path(s, units[s], 0)
        # a shard kept whole (keep_staged) or for the epoch cache (back) is never punched; one kept
        # for the cache tells the engine what its samples would give back all the same (the cache
        # counts those bytes, see CacheRun.reserve)
        fh = _open_staged(table.path, write=frees and not keep and not back)
        if fh is None:
            return None
        with fh:
            fields = _tar.read_sample(fh, sample)
            if not keep:
                counts = fh.writable() or (frees and back)
                spans = self.spans(s, table, os.fstat(fh.fileno()).st_size, layout) if counts else None
                if layout.release_shard_sample(s, j, fh.fileno(), spans, back):
                    self._tables.pop((layout.folder, s), None)
        return {"__key__": sample.key, **fields}

    def _fetch_member(self, s: int, j: int, access: Access) -> dict[str, Any]:
        if self._cached is None or self._cached[0] != s:
            sh = self._shards[s]
            u = parse_s3_uri(sh.uri)
            try:
                data = s3_client(access).get_object(Bucket=u.bucket, Key=u.key)["Body"].read()
            except Exception as exc:
                raise boto3_error(exc, sh.uri) from exc
            if _tar.is_gzip(sh.uri):
                try:
                    data = gzip.decompress(data)
                except (OSError, EOFError, zlib.error) as exc:
                    raise _tar.ShardError(
                        f"{sh.uri} is a gzip-compressed shard that does not decompress ({exc})"
                    ) from exc
            members = _tar.scan_bytes(data, sh.uri)
            self.check_members(s, members)
            self._cached = (s, data, members)
        _, data, members = self._cached
        sample = members[j]
        return {
            "__key__": sample.key,
            **{m.field: data[m.offset : m.offset + m.size] for m in sample.members},
        }

    def __getstate__(self) -> dict[str, Any]:
        # a worker keeps its own member tables and fetched shard
        return {**self.__dict__, "_tables": OrderedDict(), "_cached": None}


def _open_staged(path: str, write: bool) -> IO[bytes] | None:
    """A staged shard, open for writing too with ``write`` (to free samples once read, see
    :meth:`StagingLayout.release_shard_sample`) where this process may; None when it is gone."""
    try:
        return open(path, "r+b" if write else "rb", buffering=0)
    except PermissionError:
        return open(path, "rb", buffering=0) if write else None
    except FileNotFoundError:
        return None
