"""What the engine reports (:class:`Stats`); what it is told is the one
:class:`~s5loader.config.StagingOptions` object the sampler and the daemon build, checked once
there."""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..exceptions import S5LoaderError

__all__ = ["Stats"]


@dataclass
class Stats:
    """What one pass of the engine did.

    ``samples`` and ``staged_units`` count the units the pass stages: samples over raw objects,
    tar shard visits over shards (``staged_samples`` is their old, deprecated name)."""

    samples: int = 0
    staged_units: int = 0
    staged_bytes: int = 0
    calls: int = 0
    retries: int = 0
    stalls: int = 0
    skipped: list[str] = field(default_factory=list)
    skip_errors: dict[str, S5LoaderError] = field(default_factory=dict)  # skipped URI -> why
    wait_s: float = 0.0
    first_wait_s: float = 0.0
    peak_reserved: int = 0
    # S3 requests the pass asked for, by kind (GET, HEAD, LIST): see count_requests
    requests: Counter[str] = field(default_factory=Counter)
    # samples of the pass that reached the dataset as plain ints, not the StagedIndex handed out
    # (fetched again; see s5loader/_staging/plainindex.py)
    plain_indices: int = 0

    @property
    def staged_samples(self) -> int:
        """Deprecated (removed in the next release): :attr:`staged_units`."""
        warnings.warn(
            "Stats.staged_samples is deprecated: it counts what was staged, which over tar shards is shards; "
            "use Stats.staged_units",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.staged_units

    def count_requests(self, requests: Mapping[str, int]) -> None:
        """Add S3 requests asked of s5cmd or boto3 to :attr:`requests` (from any thread)."""
        with _COUNTING:
            self.requests.update(requests)


_COUNTING = threading.Lock()  # the engine's thread and a shard's streaming thread both count
