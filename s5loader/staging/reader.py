"""How :class:`~s5loader.S5Dataset` reads a sample's fields: from the files a staging pass
staged (then released), or directly from S3."""

from __future__ import annotations

from typing import Any

from .._index.sample import Sample
from .._s3api.errors import boto3_error
from .._util.uri import parse_s3_uri
from .layout import StagingLayout


class StagedIndex(int):
    """A sample index as :class:`~s5loader.S5Sampler` yields it: the int, plus the folder of
    the staging pass that staged the sample and whether reading it keeps the files.

    The index carries its folder through the DataLoader's index queue to the workers, so one
    dataset can serve several samplers (a training and an evaluation loader), and a worker
    that reads a sample of a pass that was replaced (``persistent_workers`` after a
    ``break``) reads that pass's files, never the next pass's.
    """

    folder: str
    keep: bool
    back: bool
    frees: bool  # a tar shard's sample: free its bytes once read (see ShardSet.read)

    def __new__(cls, value: int, folder: str, keep: bool = False, back: bool = False, frees: bool = False) -> StagedIndex:
        self = super().__new__(cls, value)
        self.folder = folder
        self.keep = keep
        self.back = back
        self.frees = frees
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (StagedIndex, (int(self), self.folder, self.keep, self.back, self.frees))


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
