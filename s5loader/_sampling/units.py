"""What a data set stages, as the set-up, the engine and the pass loop ask it: its units.

A data set of raw objects stages samples (each its objects, or a block's by one wildcard line);
a data set of tar shards stages whole shards and opens each for the readers. Everything that
differs between the two is asked of one object, never checked by hand:

* :func:`units_of` gives the data set's kind (:class:`ObjectUnits` or :class:`ShardUnits`): the
  checks of the options against it, the order's window (a block order's window, or the shards
  a shard order keeps open), the block size and s5cmd's workers of its runs, whether a batch
  must fit the budget, and how an iterable's workers split a rank's part;
* its ``open_pass`` gives the units of one pass (:class:`ObjectPass` or
  :class:`~s5loader._shards.shardpass.ShardPass`), so the pass loop
  (:meth:`StagingPasses.run <s5loader._sampling.passes.StagingPasses.run>`) has one path: which
  order the engine stages, with which options, what it must not fetch, where calls may be cut,
  how big the first call is, and whether the sample at a position can be yielded.
"""

from __future__ import annotations

from .._shards.holding import Freeing
from .._util.platform import HOLE_BLOCK, punches_holes
from ..dataset import S5Dataset
from .objunits import Lifted, ObjectPass, ObjectUnits, PassUnits
from .shardunits import SHARD_WORKERS, ShardUnits

__all__ = [
    "SHARD_WORKERS",
    "Lifted",
    "ObjectPass",
    "ObjectUnits",
    "PassUnits",
    "ShardUnits",
    "can_free",
    "freeing_cost",
    "units_of",
]


def units_of(dataset: S5Dataset) -> ObjectUnits:
    """The kind of units ``dataset`` stages: :class:`ShardUnits` over tar shards, else
    :class:`ObjectUnits`."""
    return ShardUnits(dataset) if dataset.shards is not None else ObjectUnits(dataset)


def can_free(dataset: S5Dataset, root: str, keep: bool = False) -> bool:
    """Whether readers of ``dataset`` staged below ``root`` give a sample's bytes back as they read
    it: over tar shards, without ``keep_staged`` (``keep``), which keeps shards whole, on a file
    system that punches holes (a shard the epoch cache keeps counts its read samples against the
    cache instead)."""
    return units_of(dataset).frees_on_read(True) and not keep and punches_holes(root, HOLE_BLOCK)


def freeing_cost(
    dataset: S5Dataset, shuffle: bool | str, budget: int, root: str, keep: bool = False
) -> Freeing | None:
    """What an order of ``dataset`` staged within ``budget`` below ``root`` counts what its
    samples give back with (see :meth:`ShardUnits.order_cost`), or None where it counts nothing:
    a ``shuffle`` other than True, a data set that fits the budget, readers that give nothing
    back (:func:`can_free`)."""
    units = units_of(dataset)
    if not units.frees_on_read(shuffle, budget) or not can_free(dataset, root, keep):
        return None
    return units.order_cost(budget)
