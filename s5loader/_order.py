"""How samples are ordered: a seeded permutation per epoch, split across ranks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Order:
    """How one pass over the data is ordered and split across ranks."""

    shuffle: bool | str  # True, False or "block"
    seed: int
    num_replicas: int
    rank: int
    drop_last: bool

    def indices(
        self, n: int, epoch: int, start: int = 0, units: list[list[int]] | None = None, window: int = 1000
    ) -> list[int]:
        """This rank's part of the epoch, from position ``start`` on.

        With ``shuffle`` True or False the global order is one permutation of ``range(n)``
        per ``(seed, epoch)`` (or the identity), the same on every rank; ``start`` is a
        position in it. The positions from ``start`` on are dealt round-robin to the ranks
        after padding by repetition (or dropping the tail with ``drop_last``), so every rank
        gets the same count; with ``start=0`` this is exactly ``DistributedSampler``'s split.

        With ``shuffle="block"`` the ``units`` (blocks of samples that share a key prefix)
        are permuted, gathered into windows of whole units of at most ``window`` samples, and
        the samples of each window are shuffled; each rank takes a contiguous slice (see
        :meth:`block_order`). A call that stages a whole window fetches each of its blocks
        with one request; ``start`` counts samples of this rank's slice.
        """
        if self.shuffle == "block":
            return self._block_indices(n, epoch, start, units or [[i] for i in range(n)], window)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            perm: list[int] = torch.randperm(n, generator=g).tolist()
        else:
            perm = list(range(n))
        return self._deal(perm[start:])

    def _deal(self, rest: list[int]) -> list[int]:
        w = self.num_replicas
        if not rest:
            return []
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % w]
        elif len(rest) % w:
            pad = w - len(rest) % w
            rest += (rest * math.ceil(pad / len(rest)))[:pad]
        return rest[self.rank :: w]

    def _block_indices(self, n: int, epoch: int, start: int, units: list[list[int]], window: int) -> list[int]:
        return self.block_order(n, epoch, start, units, window)[0]

    def block_order(
        self, n: int, epoch: int, start: int, units: list[list[int]], window: int
    ) -> tuple[list[int], list[int]]:
        """The ``shuffle="block"`` order of this rank from ``start`` on, and where its windows
        begin (positions in the returned list, ascending, the first 0).

        The units are permuted, then gathered in that order into windows of whole units
        holding at most ``window`` samples (a larger unit is a window of its own), and the
        samples of each window are shuffled. A window is therefore exactly the samples of
        its units: fetching a window fetches each of its units whole. The global sequence is
        padded by repetition (or cut with ``drop_last``) to equal parts, and rank ``r`` takes
        the ``r``-th contiguous part; ``start`` counts samples of that part.
        """
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        window = max(1, window)
        seq: list[int] = []
        starts: list[int] = []
        w0 = 0  # where the window being filled began
        for u in torch.randperm(len(units), generator=g).tolist():
            if len(seq) > w0 and len(seq) - w0 + len(units[u]) > window:
                starts.append(w0)
                w0 = len(seq)
            seq += units[u]
        if seq:
            starts.append(w0)
        for a, b in zip(starts, [*starts[1:], len(seq)], strict=True):
            chunk = seq[a:b]
            seq[a:b] = [chunk[k] for k in torch.randperm(len(chunk), generator=g).tolist()]
        w = self.num_replicas
        per = n // w if self.drop_last else math.ceil(n / w)
        if per * w > len(seq) and seq:
            starts.append(len(seq))  # the repeated tail is a window of its own
            seq += (seq * math.ceil((per * w - len(seq)) / len(seq)))[: per * w - len(seq)]
        lo, hi = self.rank * per + start, (self.rank + 1) * per
        mine = seq[lo:hi]
        bounds = [0] if mine else []
        bounds += [s - lo for s in starts if lo < s < hi]
        return mine, bounds


@dataclass(frozen=True)
class ShuffleQuality:
    """How well an order mixes the data set (see :func:`shuffle_quality`)."""

    span: int
    units_per_span: float  # mean distinct units among ``span`` consecutive samples
    displacement: float  # mean |position in the order - position in key order| / samples


def shuffle_quality(order: Sequence[int], unit_of: Sequence[int], span: int = 256) -> ShuffleQuality:
    """Measure an order's mixing: from how many units (blocks) a batch-sized run draws, and how
    far samples move from their key order.

    Args:
        order: sample indices in the order they are read (a permutation of part of
            ``range(len(unit_of))``).
        unit_of: per sample index, the unit (block) it belongs to.
        span: the run length, e.g. a batch: the order is cut into runs of ``span``
            consecutive samples (the whole order if shorter) and the distinct units of
            each full run are averaged.

    Returns:
        ``units_per_span``: about ``span`` for a full per-sample shuffle of many small
        units, about ``span / unit size`` without shuffle; ``displacement``: about 1/3 for a
        full shuffle, 0 without.
    """
    if span < 1:
        raise ValueError(f"span must be >= 1, got {span}")
    if not order:
        return ShuffleQuality(span, 0.0, 0.0)
    runs = [order[a : a + span] for a in range(0, len(order) - span + 1, span)] or [order]
    units = sum(len({unit_of[i] for i in run}) for run in runs) / len(runs)
    n = len(unit_of)
    scale = n / len(order)  # a rank's part spreads over the whole data set
    moved = sum(abs(pos * scale - i) for pos, i in enumerate(order)) / (len(order) * n)
    return ShuffleQuality(span, units, moved)
