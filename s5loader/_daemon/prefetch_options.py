"""What ``s5loader prefetch`` is asked to do: :class:`PrefetchOptions`, checked once, whose
staging options are the one :class:`~s5loader.StagingOptions` every front end takes."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .._index.sample import GROUP_BY
from .._sampling.order import check_shuffle
from ..config import Access, StagingOptions
from ..exceptions import ConfigError
from .flags import NOT_DAEMON


@dataclass(frozen=True)
class PrefetchOptions:
    """What ``s5loader prefetch`` was asked to do (its command-line options).

    ``staging`` holds the staging options (``budget``: most bytes in the cache;
    ``samples_per_call``, ``calls_in_flight``, ``s5cmd_workers``, ``block_size``,
    ``stall_timeout``, ``retries``, ``retry_backoff``, ``on_error``, ``verify``,
    ``epoch_cache``), the one :class:`~s5loader.StagingOptions` object of every front end;
    :meth:`of` takes them as keyword arguments. ``shuffle`` takes ``True``, ``False`` or
    ``"block"`` as the sampler's does. ``access`` (with ``endpoint_url`` folded in) says how the
    store is reached.
    """

    source: str
    cache: str
    staging: StagingOptions
    group_by: str = "stem"
    shuffle: bool | str = False
    seed: int = 0
    epochs: int = 1
    endpoint_url: str | None = None
    fresh: bool = False
    json_log: str | None = None
    progress: bool | None = None  # None: a bar when stderr is a terminal
    access: Access | None = None
    shards: bool = False  # the source names tar shards
    index: str | None = None  # their wids shard index; default: wids.json beside them

    @classmethod
    def of(cls, source: str, cache: str, budget: int | str, **options: Any) -> PrefetchOptions:
        """The options with the staging ones given by name beside the daemon's own
        (``PrefetchOptions.of(src, cache, "2GiB", shuffle=True, samples_per_call=100)``)."""
        own = {f.name for f in fields(cls)}
        mine = {k: v for k, v in options.items() if k in own}
        staging = {k: v for k, v in options.items() if k not in own}
        return cls(
            source,
            cache,
            StagingOptions.merge(None, {"budget": budget, **staging}, "s5loader prefetch"),
            **mine,
        )

    def __post_init__(self) -> None:
        if self.group_by not in GROUP_BY:
            raise ConfigError(f"group_by must be one of {', '.join(GROUP_BY)}; got {self.group_by!r}")
        if self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1, got {self.epochs}")
        if not isinstance(self.staging, StagingOptions):
            raise ConfigError(
                f"staging must be an s5loader.StagingOptions, got {type(self.staging).__name__}"
            )
        given = [
            name for name in NOT_DAEMON if getattr(self.staging, name) != getattr(StagingOptions(), name)
        ]
        if given:
            raise ConfigError(
                f"{', '.join(given)}: not options of s5loader prefetch, which stages inside its cache"
            )
        check_shuffle(self.shuffle)
        object.__setattr__(self, "access", Access.coerce(self.access, self.endpoint_url))

    @property
    def store(self) -> Access:
        """How the store is reached (``access`` with ``endpoint_url`` folded in)."""
        assert self.access is not None
        return self.access

    @property
    def budget(self) -> int:
        return self.staging.budget
