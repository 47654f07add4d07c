"""What ``s5loader prefetch`` is asked to do: :class:`PrefetchOptions`, checked once, whose
staging options are the sampler's."""

from __future__ import annotations

from dataclasses import dataclass

from .._index.sample import GROUP_BY
from .._sampling.order import check_shuffle
from ..config import Access, StagingOptions
from ..exceptions import ConfigError


@dataclass(frozen=True)
class PrefetchOptions:
    """What ``s5loader prefetch`` was asked to do (its command-line options).

    The staging options (``budget``, ``samples_per_call``, ``calls_in_flight``,
    ``s5cmd_workers``, ``block_size``, ``stall_timeout``, ``retries``, ``on_error``,
    ``verify``, ``epoch_cache``) have the names, defaults and checks of :class:`~s5loader.S5Sampler`'s:
    :meth:`stager_options` is the one :class:`~s5loader.StagingOptions` object, and
    ``shuffle`` takes ``True``, ``False`` or ``"block"`` as the sampler's does. ``access``
    (with ``endpoint_url`` folded in) says how the store is reached.
    """

    source: str
    cache: str
    budget: int
    group_by: str = "stem"
    shuffle: bool | str = False
    seed: int = 0
    epochs: int = 1
    endpoint_url: str | None = None
    samples_per_call: int = 1000
    calls_in_flight: int = 2
    s5cmd_workers: int = 256
    block_size: int = 64
    on_error: str = "raise"
    stall_timeout: float = 60.0
    retries: int = 3
    verify: bool = False
    fresh: bool = False
    json_log: str | None = None
    progress: bool | None = None  # None: a bar when stderr is a terminal
    access: Access | None = None
    shards: bool = False  # the source names tar shards (see .shards)
    index: str | None = None  # their wids shard index; default: wids.json beside them
    epoch_cache: int = 0  # bytes kept from one epoch for the next (see .epochcache)

    def __post_init__(self) -> None:
        if self.group_by not in GROUP_BY:
            raise ConfigError(f"group_by must be one of {', '.join(GROUP_BY)}; got {self.group_by!r}")
        if self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1, got {self.epochs}")
        check_shuffle(self.shuffle)
        object.__setattr__(self, "access", Access.coerce(self.access, self.endpoint_url))
        self.stager_options()  # checks the staging options as the sampler's are checked
        if self.epoch_cache and self.shards:
            raise ConfigError("--epoch-cache is not supported over tar shards (--shards) yet")

    @property
    def store(self) -> Access:
        """How the store is reached (``access`` with ``endpoint_url`` folded in)."""
        assert self.access is not None
        return self.access

    def stager_options(self) -> StagingOptions:
        return StagingOptions(
            budget=self.budget,
            samples_per_call=self.samples_per_call,
            calls_in_flight=self.calls_in_flight,
            s5cmd_workers=self.s5cmd_workers,
            block_size=self.block_size,
            stall_timeout=self.stall_timeout,
            retries=self.retries,
            on_error=self.on_error,
            verify=self.verify,
            epoch_cache=self.epoch_cache,
        )
