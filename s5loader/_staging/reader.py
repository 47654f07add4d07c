"""How :class:`~s5loader.S5Dataset` reads a sample's fields: from the files a staging pass
staged (then released), after waiting for a sample handed out before it was staged, or
directly from S3."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Any

from .._index.sample import Sample
from .._s3api.client import s3_client
from .._s3api.errors import boto3_error
from .._util.uri import parse_s3_uri
from ..config import Access
from .layout import StagingLayout
from .words import announce, ask

log = logging.getLogger("s5loader.dataset")


class StagedIndex(int):
    """A sample index as :class:`~s5loader.S5Sampler` yields it: the int, plus the folder of
    the staging pass that staged the sample and whether reading it keeps the files.

    The index carries its folder through the DataLoader's index queue to the workers, so one
    dataset can serve several samplers (a training and an evaluation loader), and a worker
    that reads a sample of a pass that was replaced (``persistent_workers`` after a
    ``break``) reads that pass's files, never the next pass's.

    The folder travels only while the index stays a ``StagedIndex``: code between the sampler
    and the dataset that makes a plain int of it (``int(i)``) leaves the dataset no folder to
    read, so it fetches the sample directly and the staged files stay unreleased. The dataset
    of a sampler reports such a read (a warning, :attr:`Stats.plain_indices
    <s5loader._engine.stats.Stats.plain_indices>`; see :mod:`s5loader._staging.plainindex`).
    """

    folder: str
    keep: bool
    back: bool
    frees: bool  # a tar shard's sample: free its bytes once read (see ShardSet.read)
    early: bool  # handed out before it was staged: the reader waits for it (see words.ask)

    def __new__(
        cls,
        value: int,
        folder: str,
        keep: bool = False,
        back: bool = False,
        frees: bool = False,
        early: bool = False,
    ) -> StagedIndex:
        self = super().__new__(cls, value)
        self.folder = folder
        self.keep = keep
        self.back = back
        self.frees = frees
        self.early = early
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (StagedIndex, (int(self), self.folder, self.keep, self.back, self.frees, self.early))


def read_staged(
    layout: StagingLayout, index: int, sample: Sample, keep: bool, back: bool = False
) -> list[bytes] | None:
    """The fields of sample ``index`` from its staged files, which are released unless
    ``keep`` (handed back for the epoch cache with ``back``); None when none is staged (a file
    missing after the first is an error)."""
    paths = layout.paths(index, sample)
    data = []
    try:
        for p in paths:
            with open(p, "rb") as fh:
                data.append(fh.read())
    except FileNotFoundError:
        if not data:
            return None
        raise
    if back and not keep:
        layout.hand_back(index, paths)
    elif not keep:
        layout.release(index, paths)
    return data


def fetch_fields(client: Any, sample: Sample) -> list[bytes]:
    """The fields of ``sample``, each with one GET through the boto3 ``client``."""
    out = []
    for f in sample.fields:
        u = parse_s3_uri(f.uri)
        try:
            out.append(client.get_object(Bucket=u.bucket, Key=u.key)["Body"].read())
        except Exception as exc:
            raise boto3_error(exc, f.uri) from exc
    return out


def announce_early(indices: Sequence[int]) -> None:
    """Ask at once for the sampler's words on the samples of ``indices`` (a DataLoader batch)
    that were handed out before they were staged, one request per pass folder, so that reading
    them in this order waits for each without a question per sample (see
    :func:`~s5loader._staging.words.announce`)."""
    by_folder: dict[str, list[int]] = {}
    for i in indices:
        if isinstance(i, StagedIndex) and i.early:
            by_folder.setdefault(i.folder, []).append(int(i))
    for folder, early in by_folder.items():
        announce(folder, early)


class ObjectReader:
    """How an :class:`~s5loader.S5Dataset` of raw objects reads its samples (the counterpart of
    :class:`~s5loader._shards.shardset.ShardSet` for tar shards): a sample is its own staging
    unit, read from the files a pass staged (then released), else fetched with one GET per
    field."""

    disk = None  # a staged sample takes its objects' bytes

    def __init__(self, count: int) -> None:
        self.samples = count
        self._warned_unstaged = False

    def read(
        self, index: int, units: Sequence[Sample], access: Access
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Sample ``index`` of ``units`` as ``{"__key__": ..., FIELD: bytes, extra...}`` and
        where each field came from (fetched through ``access`` when not staged)."""
        sample = units[index]
        data = None
        if isinstance(index, StagedIndex):
            folder = index.folder
            layout = StagingLayout(folder)
            # A sample handed to a DataLoader before it was staged: wait for it (the engine's
            # error, or a pass closed first, is raised). Where the pass is gone (its folder
            # removed by someone else), what is staged of it is read (and so released), and a
            # sample not all there is fetched directly.
            if not index.early or ask(folder, int(index)):
                data = read_staged(layout, int(index), sample, keep=index.keep, back=index.back)
            else:
                with contextlib.suppress(FileNotFoundError):
                    data = read_staged(layout, int(index), sample, keep=index.keep, back=index.back)
            # A pass whose folder is gone was replaced: whoever asked will not use the sample
            # (a worker of a loader that was shut down), so that is no staging fault to report.
            if data is None and not index.early and not self._warned_unstaged and os.path.isdir(folder):
                self._warned_unstaged = True
                log.warning(
                    "sample %d (%s) was not staged in %s; fetching it directly (further "
                    "cases are not logged)",
                    index,
                    sample.key,
                    folder,
                )
        if data is None:
            data = fetch_fields(s3_client(access), sample)
        out: dict[str, Any] = {"__key__": sample.key}
        for f, value in zip(sample.fields, data, strict=True):
            out[f.name] = value
        if sample.extra:
            for k, v in sample.extra.items():
                out.setdefault(k, v)
        return out, {f.name: f.uri for f in sample.fields}

    def unit_of(self, index: int) -> int:
        """The staging unit of sample ``index``: the sample itself."""
        return int(index)

    def describe(self) -> str:
        return f"{self.samples} samples"
