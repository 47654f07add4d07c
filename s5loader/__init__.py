"""s5loader: feed PyTorch from S3 at the speed of the store, through a small local disk.

``S5Sampler`` stages samples ahead with the s5cmd binary into a bounded staging directory;
``S5Dataset`` reads what was staged and deletes it. ``S5IterableDataset`` streams an
``S5Dataset`` without a sampler, the same number of samples on every rank.
"""

from __future__ import annotations

from . import checkpoint, fetch
from ._util.uri import parse_size
from .config import Access, StagingOptions
from .consume import consume
from .dataset import S5Dataset
from .exceptions import (
    AccessDeniedError,
    BudgetError,
    ChecksumError,
    ConfigError,
    DaemonError,
    DecodeError,
    EmptySourceError,
    EndpointError,
    FetchError,
    IndexFileError,
    IndexShareError,
    ManifestError,
    NoSuchBucketError,
    ObjectNotFoundError,
    PlatformError,
    S3URIError,
    S5cmdNotFoundError,
    S5LoaderError,
    ShardError,
    ShardIndexError,
    StagingSpaceError,
    StallError,
    StateError,
    UnsafeArchiveError,
)
from .iterable import S5IterableDataset
from .metrics import Metrics, log_metrics
from .packing import PackResult, pack
from .prefetch import Prefetcher
from .progress import Progress
from .s5cmd import find_s5cmd
from .sampler import S5Sampler

__version__ = "0.1.0"

__all__ = [
    "S5Dataset",
    "S5IterableDataset",
    "S5Sampler",
    "Access",
    "StagingOptions",
    "checkpoint",
    "dcp",
    "fetch",
    "pack",
    "PackResult",
    "consume",
    "Metrics",
    "log_metrics",
    "Prefetcher",
    "Progress",
    "parse_size",
    "find_s5cmd",
    "S5LoaderError",
    "ShardError",
    "DecodeError",
    "ShardIndexError",
    "AccessDeniedError",
    "BudgetError",
    "ChecksumError",
    "ConfigError",
    "DaemonError",
    "EmptySourceError",
    "EndpointError",
    "FetchError",
    "IndexFileError",
    "IndexShareError",
    "ManifestError",
    "NoSuchBucketError",
    "ObjectNotFoundError",
    "PlatformError",
    "S3URIError",
    "S5cmdNotFoundError",
    "StagingSpaceError",
    "StallError",
    "StateError",
    "UnsafeArchiveError",
]


def __getattr__(name: str) -> object:
    # s5loader.dcp imports torch.distributed.checkpoint: only when it is asked for.
    if name == "dcp":
        import importlib

        return importlib.import_module(".dcp", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
