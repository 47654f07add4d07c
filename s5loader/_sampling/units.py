"""What one pass stages, as the engine and the pass loop ask it: the units of a pass.

A pass over raw objects stages samples (each its objects, or a block's by one wildcard line);
a pass over tar shards stages shard visits and opens each shard for the readers
(:class:`~s5loader._shards.passes.ShardPass`). Both answer the same questions, so the pass
loop (:meth:`StagingPasses.run <s5loader._sampling.passes.StagingPasses.run>`) has one path:
which order the engine stages, with which options, what it must not fetch, where calls may be
cut, how big the first call is, and whether the sample at a position can be yielded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .._shards.passes import ShardPass
from ..config import StagingOptions
from ..dataset import S5Dataset
from ..engine import Stager


class PassUnits(Protocol):
    """The units of one pass (see the module docstring)."""

    @property
    def engine_order(self) -> Sequence[int]:
        """What the engine stages, in order."""
        ...

    @property
    def first_call(self) -> int:
        """Units in the engine's first call (then twice, four times as many...)."""
        ...

    def engine_options(self, options: StagingOptions) -> StagingOptions: ...

    def engine_kept(self, hits: set[int] | None) -> set[int] | None: ...

    def engine_windows(self, windows: list[int] | None) -> list[int] | None: ...

    def start(self, stager: Stager, options: StagingOptions) -> None: ...

    def take(self, pos: int, stager: Stager) -> bool: ...

    def finish(self, stager: Stager) -> None: ...

    def close(self) -> None: ...

    def stop(self) -> None: ...


class ObjectPass:
    """A pass over raw objects: the engine stages the order itself, a sample is yielded once
    its files are staged (a consumer then holds it until it releases it)."""

    first_call = 32

    def __init__(self, order: Sequence[int], keep: bool) -> None:
        self.engine_order = order
        self.keep = keep

    def engine_options(self, options: StagingOptions) -> StagingOptions:
        return options

    def engine_kept(self, hits: set[int] | None) -> set[int] | None:
        return hits  # an epoch cache's hits: staged already, not fetched

    def engine_windows(self, windows: list[int] | None) -> list[int] | None:
        return windows

    def start(self, stager: Stager, options: StagingOptions) -> None:
        pass

    def take(self, pos: int, stager: Stager) -> bool:
        if not stager.wait(pos):
            return False  # skipped
        if not self.keep:
            stager.yielded(self.engine_order[pos])
        return True

    def finish(self, stager: Stager) -> None:
        pass

    def close(self) -> None:
        pass

    def stop(self) -> None:
        pass


def open_pass(
    dataset: S5Dataset, order: Sequence[int], folder: str, keep: bool, options: StagingOptions,
    shuffle: bool | str | None,
) -> PassUnits:
    """The units of a pass of ``order`` staged into ``folder`` (``shuffle``: the order's, for
    the budget check; ``None``: no check, for command files written without a run).

    Raises:
        BudgetError: over shards, the order needs more shards at once than the budget holds.
    """
    if dataset.shards is None:
        return ObjectPass(order, keep)
    shards = ShardPass(dataset, order, folder, keep, options.on_error)
    if shuffle is not None:
        shards.check_budget(options.budget, shuffle)
    return shards
