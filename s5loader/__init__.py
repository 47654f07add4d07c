"""s5loader: feed PyTorch from S3 at the speed of the store, through a small local disk.

``S5Sampler`` stages samples ahead with the s5cmd binary into a bounded staging directory;
``S5Dataset`` reads what was staged and deletes it. ``S5IterableDataset`` streams an
``S5Dataset`` without a sampler, the same number of samples on every rank. ``Staging`` is the
object both (and ``s5loader prefetch``) adapt; a plain generator over it is a loader too.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._util.uri import parse_size
from .config import Access, StagingOptions
from .consume import consume  # here, not lazily: the function's name is its module's too
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

if TYPE_CHECKING:
    from . import checkpoint, dcp, fetch
    from ._s5cmd import find_s5cmd
    from ._sampling.staging import Staging
    from .dataset import S5Dataset
    from .iterable import S5IterableDataset
    from .metrics import Metrics, log_metrics
    from .packing import PackResult, pack
    from .prefetch import Prefetcher
    from .progress import Progress
    from .sampler import S5Sampler

# The names that need torch (or s5cmd's plumbing) come from their modules when first asked for:
# ``import s5loader`` and the command line start in a fraction of the time, so the ``s5loader``
# command takes its signals (and answers ``prefetch --status``) before torch is loaded.
_LAZY = {
    "checkpoint": ("checkpoint", None),
    "dcp": ("dcp", None),
    "fetch": ("fetch", None),
    "S5Dataset": ("dataset", "S5Dataset"),
    "S5IterableDataset": ("iterable", "S5IterableDataset"),
    "Metrics": ("metrics", "Metrics"),
    "log_metrics": ("metrics", "log_metrics"),
    "PackResult": ("packing", "PackResult"),
    "pack": ("packing", "pack"),
    "Prefetcher": ("prefetch", "Prefetcher"),
    "Progress": ("progress", "Progress"),
    "find_s5cmd": ("_s5cmd", "find_s5cmd"),
    "S5Sampler": ("sampler", "S5Sampler"),
    "Staging": ("_sampling.staging", "Staging"),
}

__version__ = "0.1.0"

__all__ = [
    "S5Dataset",
    "S5IterableDataset",
    "S5Sampler",
    "Staging",
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
    found = _LAZY.get(name)
    if found is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f".{found[0]}", __name__)
    value = module if found[1] is None else getattr(module, found[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
