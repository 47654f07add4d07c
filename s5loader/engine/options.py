"""What the engine is told (:class:`StagerOptions`, the one
:class:`~s5loader.config.StagingOptions` object) and what it reports (:class:`Stats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ON_ERROR, StagingOptions
from ..exceptions import S5LoaderError

# The engine runs on the options object the sampler and the daemon build; checked once there.
StagerOptions = StagingOptions

__all__ = ["ON_ERROR", "StagerOptions", "Stats"]


@dataclass
class Stats:
    """What one pass of the engine did."""

    samples: int = 0
    staged_samples: int = 0
    staged_bytes: int = 0
    calls: int = 0
    retries: int = 0
    stalls: int = 0
    skipped: list[str] = field(default_factory=list)
    skip_errors: dict[str, S5LoaderError] = field(default_factory=dict)  # skipped URI -> why
    wait_s: float = 0.0
    first_wait_s: float = 0.0
    peak_reserved: int = 0
