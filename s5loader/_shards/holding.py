"""What the shards an order keeps staged hold, counted in advance from the order alone, before
any shard is fetched: the order's side of what readers give back (see
:mod:`s5loader._staging.holes`).

A *visit* (a shard staged for some of its samples, see :mod:`.passes`) holds its staged bytes
(:attr:`Shard.disk <s5loader._shards.index.Shard.disk>`) less what its done samples give back,
a sample being done once read, or from the start when the visit does not need it. Sample
sizes are unknown until the shard is read, so each counts its shard's mean: the tar less a
tar's end (:data:`TAR_END`), over its samples. A run of done samples gives back that many
samples' bytes less a block at each end that is not the shard's start or end (the block it
shares with a sample not done stays), and the tar's end with the run that reaches it. Readers
free at least that much when a shard's samples are alike in size; the order keeps a largest
shard's bytes of the budget aside for the rest (see :meth:`Order.shard_order
<s5loader._sampling.order.Order.shard_order>`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .._util.platform import HOLE_BLOCK
from .index import Shard
from .shardset import ShardSet

TAR_END = 10240  # two zero blocks, and the padding to a record that tar writers add: at most this


def run_credit(visit: Shape, a: int, b: int, block: int) -> float:
    """What a run ``[a, b)`` of done samples of a shard of ``visit``'s shape gives back (see the
    module docstring)."""
    count, per, tail = visit.count, visit.per_sample, visit.tail
    edges = (a > 0) + (b < count)
    return max(0.0, (b - a) * per + (tail if b == count else 0.0) - block * edges)


@dataclass
class Shape:
    """A shard as :class:`Holding` counts it."""

    count: int
    per_sample: float
    tail: float  # the tar's end, given back with the run that reaches it
    disk: int

    @classmethod
    def of(cls, shard: Shard) -> Shape:
        tar = shard.tarsize or shard.size
        n = max(1, shard.nsamples)
        per = max(tar - TAR_END, tar / 2) / n
        return cls(n, per, tar - per * n, shard.disk)


@dataclass
class _Visit:
    shape: Shape
    credit: float = 0.0
    starts: dict[int, int] = field(default_factory=dict)  # done runs [a, b): a -> b
    ends: dict[int, int] = field(default_factory=dict)  # b -> a


class Holding:
    """The bytes the open visits of an order hold (:attr:`held`) as its samples are done.

    Args:
        shards: the data set's shards.
        block: the block readers free whole (:data:`HOLE_BLOCK`).
    """

    def __init__(self, shards: ShardSet, block: int = HOLE_BLOCK) -> None:
        self.shards = shards
        self.block = block
        self.held = 0.0
        self._visits: dict[int, _Visit] = {}
        self._shapes: dict[int, Shape] = {}

    def open(self, key: int, shard: int, needed: Iterable[int] | None = None) -> None:
        """Visit ``key`` of ``shard`` is staged: it holds the shard's bytes, less what the
        samples it does not need give back (every sample but those in ``needed``; ``None``: it
        needs all of them, or frees none of the others)."""
        shape = self._shapes.get(shard)
        if shape is None:
            shape = self._shapes[shard] = Shape.of(self.shards[shard])
        v = _Visit(shape)
        self._visits[key] = v
        self.held += shape.disk
        if needed is not None:
            k = 0
            for j in sorted(set(needed)):
                if j > k:
                    self._add_run(v, k, j)
                k = j + 1
            if k < shape.count:
                self._add_run(v, k, shape.count)

    def done(self, key: int, j: int) -> None:
        """Sample ``j`` (of its shard) of visit ``key`` was read; it was not done before."""
        v = self._visits[key]
        shape, starts, ends = v.shape, v.starts, v.ends
        a, b = j, j + 1
        before = 0.0  # what the runs it joins gave back
        left = ends.pop(j, None)
        if left is not None:
            del starts[left]
            before += run_credit(shape, left, j, self.block)
            a = left
        right = starts.pop(b, None)
        if right is not None:
            del ends[right]
            before += run_credit(shape, b, right, self.block)
            b = right
        starts[a] = b
        ends[b] = a
        credit = run_credit(shape, a, b, self.block) - before
        v.credit += credit
        self.held -= credit

    def close(self, key: int) -> None:
        """Visit ``key`` is over: its shard is deleted."""
        v = self._visits.pop(key)
        self.held -= v.shape.disk - v.credit

    def holds(self, key: int) -> float:
        v = self._visits[key]
        return v.shape.disk - v.credit

    def _add_run(self, v: _Visit, a: int, b: int) -> None:
        v.starts[a] = b
        v.ends[b] = a
        credit = run_credit(v.shape, a, b, self.block)
        v.credit += credit
        self.held -= credit


class Freeing:
    """What a shard order that counts what its samples give back needs to know: where sample
    ``i`` lies, what each shard takes staged, and ``room``, the most bytes its open shards may
    hold (``None``: its ``window`` of the largest shards)."""

    def __init__(self, shards: ShardSet, room: int | None = None) -> None:
        self.shards = shards
        self.room = room
        self.largest = max(sh.disk for sh in shards)

    def locate(self, index: int) -> tuple[int, int]:
        return self.shards.locate(index)

    def disk(self, shard: int) -> int:
        return self.shards[shard].disk

    def holding(self) -> Holding:
        return Holding(self.shards)

    def shape(self, shard: int) -> Shape:
        return Shape.of(self.shards[shard])
