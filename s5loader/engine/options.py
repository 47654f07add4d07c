"""What the engine is told (:class:`StagerOptions`) and what it reports (:class:`Stats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..exceptions import ConfigError, S5LoaderError

ON_ERROR = ("raise", "skip")


@dataclass(frozen=True)
class StagerOptions:
    """How the engine stages. Checked on creation; messages say what to change."""

    budget: int
    samples_per_call: int = 1000
    buffers: int = 2
    stall_timeout: float = 60.0
    retries: int = 3
    retry_backoff: float = 0.5
    on_error: str = "raise"
    verify: bool = False

    def __post_init__(self) -> None:
        def positive_int(name: str, value: Any) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")

        positive_int("samples_per_call", self.samples_per_call)
        positive_int("buffers", self.buffers)
        positive_int("budget", self.budget)
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"retries must be an int >= 0, got {self.retries!r}")
        if not self.stall_timeout > 0:
            raise ConfigError(f"stall_timeout must be a positive number of seconds, got {self.stall_timeout!r}")
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"on_error must be one of {', '.join(ON_ERROR)}; got {self.on_error!r}")


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
