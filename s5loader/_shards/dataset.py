"""The map-style dataset over tar shards that ``S5Dataset.from_shards`` returns.

Sample ``i`` is sample ``j`` of shard ``s`` (shards in source order, samples in tar order).
Staged by :class:`~s5loader.S5Sampler`, a shard lies whole in the pass folder and a worker
reads a sample's members by offset from it (the member table the sampler wrote after checking
the shard), then drops the sample's claim on the shard; the last claim deletes the shard (see
:mod:`s5loader.staging.layout`). Without a staged copy the shard is fetched with one GET and
kept in memory (one per process) for the next samples.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from .._index.listing import Field, Sample, boto3_error, make_boto3_client
from .._util.uri import parse_s3_uri
from ..config import Access
from ..dataset import S5Dataset, StagedIndex, Transform
from ..exceptions import EmptySourceError, ShardError
from ..staging.layout import StagingLayout
from . import tar as _tar
from .index import Shard

log = logging.getLogger(__name__)

_TABLES = 16  # member tables a worker keeps (the shards it reads from at once)


class ShardDataset(S5Dataset):
    """Samples of WebDataset tar shards; build one with :meth:`S5Dataset.from_shards`.

    :attr:`samples` is the shard index (one entry per shard, field ``tar``), which is what
    :class:`~s5loader.S5Sampler` stages and budgets; ``len(dataset)`` counts samples.
    """

    def __init__(
        self,
        shards: Sequence[Shard],
        *,
        endpoint_url: str | None = None,
        transform: Transform | None = None,
        decode: bool = False,
        source: str = "",
        index_uri: str = "",
        access: Access | None = None,
    ) -> None:
        units = [Sample(s.uri[5:].partition("/")[2], (Field("tar", s.uri, s.size, s.etag),)) for s in shards]
        super().__init__(
            units, endpoint_url=endpoint_url, transform=transform, decode=decode, source=source, access=access
        )
        self.shards: Sequence[Shard] = list(shards)
        self.index_uri = index_uri
        first = [0]
        for s in self.shards:
            first.append(first[-1] + s.nsamples)
        if first[-1] == 0:
            raise EmptySourceError(f"the shards of {source} hold no sample (index {index_uri})")
        self._first = first
        self._tables: OrderedDict[tuple[str, int], list[_tar.TarSample]] = OrderedDict()
        self._cached: tuple[int, bytes, list[_tar.TarSample]] | None = None

    def __len__(self) -> int:
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
        return [list(self.shard_samples(s)) for s in range(len(self.shards))]

    def check_members(self, shard: int, members: list[_tar.TarSample]) -> None:
        """Raise :class:`ShardError` when a shard disagrees with its index."""
        sh = self.shards[shard]
        if len(members) != sh.nsamples:
            extra = f"; its last sample is {members[-1].key!r}" if members else ""
            raise ShardError(
                f"{sh.uri} holds {len(members)} samples, the shard index {self.index_uri} says "
                f"{sh.nsamples}{extra}: rebuild the index with s5loader index-shards"
            )

    def __getitem__(self, index: int) -> Any:
        s, j = self.locate(index)
        out = None
        if isinstance(index, StagedIndex):
            out = self._read_staged_member(StagingLayout(index.folder), s, j, index.keep)
            if out is None and not self._warned_unstaged and os.path.isdir(index.folder):
                self._warned_unstaged = True
                log.warning(
                    "shard %s was not staged in %s; fetching it directly (further cases are not logged)",
                    self.shards[s].uri, index.folder,
                )
        if out is None:
            out = self._fetch_member(s, j)
        return self._finish(out, self.shards[s].uri)

    def _table(self, layout: StagingLayout, shard: int) -> list[_tar.TarSample] | None:
        key = (layout.folder, shard)
        table = self._tables.get(key)
        if table is None:
            try:
                with open(layout.shard_table(shard), "rb") as fh:
                    table = _tar.loads(fh.read())
            except FileNotFoundError:
                return None
            self._tables[key] = table
            while len(self._tables) > _TABLES:
                self._tables.popitem(last=False)
        return table

    def _read_staged_member(self, layout: StagingLayout, s: int, j: int, keep: bool) -> dict[str, Any] | None:
        table = self._table(layout, s)
        if table is None:
            return None
        sample = table[j]
        try:
            fh = open(layout.path(s, self._samples[s], 0), "rb")
        except FileNotFoundError:
            return None
        with fh:
            fields = _tar.read_sample(fh, sample)
        if not keep:
            if layout.release_shard_sample(s, j):
                self._tables.pop((layout.folder, s), None)
        return {"__key__": sample.key, **fields}

    def _fetch_member(self, s: int, j: int) -> dict[str, Any]:
        if self._cached is None or self._cached[0] != s:
            sh = self.shards[s]
            if self._client is None or self._client_pid != os.getpid():
                self._client = make_boto3_client(self.access)
                self._client_pid = os.getpid()
            u = parse_s3_uri(sh.uri)
            try:
                data = self._client.get_object(Bucket=u.bucket, Key=u.key)["Body"].read()
            except Exception as exc:
                raise boto3_error(exc, sh.uri) from exc
            members = _tar.scan_bytes(data, sh.uri)
            self.check_members(s, members)
            self._cached = (s, data, members)
        _, data, members = self._cached
        sample = members[j]
        return {"__key__": sample.key, **{m.field: data[m.offset : m.offset + m.size] for m in sample.members}}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_tables"] = OrderedDict()
        state["_cached"] = None
        return state

    def __repr__(self) -> str:
        return f"S5Dataset({self.source!r}, {len(self)} samples in {len(self.shards)} shards)"
