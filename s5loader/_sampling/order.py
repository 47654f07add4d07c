"""How samples are ordered: a seeded permutation per epoch, split across ranks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .._shards.holding import Freeing
from ..exceptions import ConfigError
from .mixing import draw_open, split_by_shard
from .pieces import FIRST_WINDOW, cut, end_to_end, front_first, growing, part_len

SHUFFLES = (True, False, "block")


def check_shuffle(value: object, name: str = "shuffle", error: type[ValueError] = ConfigError) -> bool | str:
    """The one check of a ``shuffle`` value (the sampler's, the iterable's, the daemon's, a
    saved state's): ``True``, ``False`` or ``"block"``; returns it as a bool or ``"block"``.

    Raises:
        ConfigError (or ``error``): any other value, named by ``name``.
    """
    if value is None or value not in SHUFFLES:
        raise error(f"{name} must be True, False or 'block', got {value!r}")
    return "block" if value == "block" else bool(value)


def check_seed(value: object) -> int:
    """The one check of a ``seed``: an int (not a bool).

    Raises:
        ConfigError: anything else.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"seed must be an int, got {value!r}")
    return value


@dataclass(frozen=True)
class Order:
    """How one pass over the data is ordered and split across ranks: the orders a data set's
    units choose from (see :meth:`ObjectUnits.plan <s5loader._sampling.units.ObjectUnits.plan>`):
    a permutation of samples (:meth:`indices`), a block order (:meth:`block_order`) or a unit
    order that keeps units whole (:meth:`shard_order`)."""

    shuffle: bool | str  # True, False or "block"
    seed: int
    num_replicas: int
    rank: int
    drop_last: bool
    # (nodes, ranks): a shuffle=True order whose samples (or tar shards) stay on their node across
    # epochs (see pinned_order and _pinned_pieces); None: not pinned
    pin: tuple[int, int] | None = None

    def indices(
        self, n: int, epoch: int, start: int = 0, units: list[list[int]] | None = None, window: int = 1000
    ) -> list[int]:
        """This rank's part of the epoch, from position ``start`` on.

        With ``shuffle`` True or False the global order is one permutation of ``range(n)``
        per ``(seed, epoch)`` (or the identity), the same on every rank; ``start`` is a
        position in it. The positions from ``start`` on are dealt round-robin to the ranks
        after padding by repetition (or dropping the tail with ``drop_last``), so every rank
        gets the same count; with ``start=0`` this is exactly ``DistributedSampler``'s split.

        With ``pin`` (``shuffle=True``, an epoch cache on several nodes) the global order is
        :func:`pinned_order`'s: dealt as above, each node's ranks read the same share of the data
        set every epoch, shuffled anew within the node.

        With ``shuffle="block"`` the ``units`` (blocks of samples that share a key prefix)
        are permuted, gathered into windows of whole units of at most ``window`` samples, and
        the samples of each window are shuffled; each rank takes a contiguous slice (see
        :meth:`block_order`). A call that stages a whole window fetches each of its blocks
        with one request; ``start`` counts samples of this rank's slice.
        """
        if self.shuffle == "block":
            return self._block_indices(n, epoch, start, units or [[i] for i in range(n)], window)
        if self.shuffle and self.pin is not None:
            return self._deal(pinned_order(n, self.seed, epoch, *self.pin, self.drop_last)[start:])
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

    def _block_indices(
        self, n: int, epoch: int, start: int, units: list[list[int]], window: int
    ) -> list[int]:
        return self.block_order(n, epoch, start, units, window)[0]

    def block_order(
        self,
        n: int,
        epoch: int,
        start: int,
        units: list[list[int]],
        window: int,
        run: tuple[int, int] = (0, 1),
        front_first: bool = False,
    ) -> tuple[list[int], list[int]]:
        """The ``shuffle="block"`` order of this rank from ``start`` on, and where its windows
        begin (positions in the returned list, ascending, the first 0).

        The units are permuted and laid end to end, the sequence is padded by repetition
        (or cut with ``drop_last``) to equal parts, and rank ``r`` takes the ``r``-th
        contiguous part. Each part is cut into windows of whole units (a unit cut by a
        part's edge counts as whole) holding at most ``window`` samples (a larger unit is a
        window of its own), and the samples of each window are shuffled. A window is
        therefore exactly the samples of its units: staging a window whole fetches each of
        its units whole. A part's first windows grow from :data:`FIRST_WINDOW` samples,
        doubling, as the engine's first calls do, so the first batch waits for a small
        window only. ``start`` counts samples of this rank's part.

        ``run=(w, k)``: the ``w``-th of ``k`` contiguous runs of the rank's part, cut before
        the windows (an iterable dataset's worker), so that no window, and no unit but one
        cut by a run's edge, is shared by two runs; ``start`` counts samples of the run.

        ``front_first`` (tar shards): the first unit of a part (or run) larger than the first
        window is cut into growing windows in its own order (32 samples, then 64, ... while
        under ``window``), as the shard is read while it downloads: the first batch waits for
        its first samples, not for one at random in the whole shard.
        """
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        window = max(1, window)
        w = self.num_replicas
        seq, edges, per = end_to_end(
            units, torch.randperm(len(units), generator=g).tolist(), n, w, self.drop_last
        )
        # Each rank (and run) shuffles the parts before its own too, so that the random stream
        # that shuffles a part is the same on every rank.
        for r in range(w):
            lo, hi = r * per, (r + 1) * per
            pieces = _cut_at(seq, edges, lo, hi)
            for j in range(run[1]):
                mine = cut(pieces, j, run[1]) if run[1] > 1 else pieces
                if front_first and mine:
                    # a tar shard larger than the first window is read in its own order in windows
                    # that grow as the first windows do: the first samples of the shard streamed
                    # first (see _shards/stream.py) are its first bytes, so the first batch does
                    # not wait for a random sample deep in a 100 MB shard
                    mine = [*growing(mine[0], window), *mine[1:]]
                part, starts = self._windows(mine, window, g)
                if (r, j) == (self.rank, run[0]):
                    out = part[start:]
                    return out, ([0] if out else []) + [s - start for s in starts if s > start]
        return [], []

    def _windows(
        self, pieces: list[list[int]], window: int, g: torch.Generator
    ) -> tuple[list[int], list[int]]:
        """``pieces`` (whole units) laid end to end in windows that grow from
        :data:`FIRST_WINDOW` samples to ``window``, each shuffled; and where they begin."""
        part: list[int] = []
        wins: list[int] = []
        limit = min(FIRST_WINDOW, window)
        for piece in pieces:
            if wins and len(part) - wins[-1] + len(piece) > limit:
                self._shuffle(part, wins[-1], g)
                limit = min(2 * limit, window)
                wins.append(len(part))
            elif not wins:
                wins.append(0)
            part += piece
        if wins:
            self._shuffle(part, wins[-1], g)
        return part, wins

    def shard_order(
        self,
        n: int,
        epoch: int,
        start: int,
        units: list[list[int]],
        open_units: int,
        run: tuple[int, int] = (0, 1),
        cost: Freeing | None = None,
    ) -> list[int]:
        """This rank's order over tar shards (``units``: each shard's sample indices) from
        ``start`` on, for ``shuffle`` True or False.

        The shards are laid end to end (permuted per ``(seed, epoch)`` when ``shuffle``), the
        sequence is padded by repetition (or cut with ``drop_last``) to equal parts, and rank
        ``r`` takes the ``r``-th contiguous part, so a shard is fetched by one rank only (one
        cut by a part's edge, by the two ranks that share it). With ``shuffle`` the rank keeps
        ``open_units`` shards open at once, each next sample drawn from one of them at random
        (a shard's samples in a random order), and a drained shard is replaced by the rank's
        next one: samples mix across shards from the first on, and a shard is staged once per
        epoch. ``start`` counts samples of this rank's part.

        ``run=(w, k)``: the ``w``-th of ``k`` contiguous runs of the rank's part (cut before
        mixing: an iterable dataset's worker), ordered as above; ``start`` counts its samples.

        ``cost``: where the samples read give their bytes back (see
        :meth:`StagingLayout.release_shard_sample
        <s5loader._staging.layout.StagingLayout.release_shard_sample>`), the budget is used as a
        shuffle buffer instead (see :mod:`s5loader._sampling.mixing`): shards open as soon as
        what the open ones still hold leaves room for the next within ``cost.room`` bytes (the
        budget less a largest shard; ``None``: ``open_units`` largest shards), each next sample
        comes from an open shard weighted by its unread samples, and a shard's samples are read
        from both of its ends.
        """
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        pieces = self._rank_pieces(n, units, g if self.shuffle else None)
        if run[1] > 1:
            pieces = cut(pieces, *run)
        if not self.shuffle:
            return [i for piece in pieces for i in piece][start:]
        if cost is not None:
            room = cost.room if cost.room is not None else max(1, open_units) * cost.largest
            rng = np.random.default_rng([self.seed & (2**64 - 1), epoch, self.rank, *run])
            return draw_open(split_by_shard(pieces, cost), room, cost, rng)[start:]
        out, tags = _draw_from_open(pieces, open_units, g)
        return front_first(out, tags, g)[start:]

    def _rank_pieces(self, n: int, units: list[list[int]], g: torch.Generator | None) -> list[list[int]]:
        """The units (permuted with ``g``) laid end to end, padded or cut to equal parts: this
        rank's part, cut where units meet. With :attr:`pin`, see :meth:`_pinned_pieces`."""
        if g is not None and self.pin is not None and self.pin[1] == self.num_replicas:
            return self._pinned_pieces(n, units, g)
        picks = torch.randperm(len(units), generator=g).tolist() if g is not None else range(len(units))
        seq, edges, per = end_to_end(units, picks, n, self.num_replicas, self.drop_last)
        lo, hi = self.rank * per, (self.rank + 1) * per
        return _cut_at(seq, edges, lo, hi)

    def _pinned_pieces(self, n: int, units: list[list[int]], g: torch.Generator) -> list[list[int]]:
        """This rank's part of a shard order whose shards stay on their nodes (see
        :func:`pinned_order`): the units permuted by the seed alone, laid end to end and padded
        as :meth:`_rank_pieces` lays them, cut into a contiguous share per node; each epoch
        permutes the pieces of the node's share anew (with ``g``) and cuts them into the node's
        ranks' parts. A unit cut by a node's or a rank's edge is read by both sides, as one cut
        by a rank's edge is without the pin."""
        nodes, ranks = self.pin or (1, self.num_replicas)
        local = ranks // nodes
        base = np.random.default_rng([self.seed & (2**64 - 1), 0x9E3779B9]).permutation(len(units)).tolist()
        seq, edges, per = end_to_end(units, base, n, ranks, self.drop_last)
        node, me = divmod(self.rank, local)
        share = _cut_at(seq, edges, node * local * per, (node + 1) * local * per)
        mixed = [share[k] for k in torch.randperm(len(share), generator=g).tolist()]
        seq2 = [i for piece in mixed for i in piece]
        edges2 = list(np.cumsum([0, *map(len, mixed)])[:-1])
        return _cut_at(seq2, edges2, me * per, (me + 1) * per)

    @staticmethod
    def _shuffle(seq: list[int], a: int, g: torch.Generator) -> None:
        chunk = seq[a:]
        seq[a:] = [chunk[k] for k in torch.randperm(len(chunk), generator=g).tolist()]


def _cut_at(seq: list[int], edges: list[int], lo: int, hi: int) -> list[list[int]]:
    """``seq[lo:hi]`` cut where units begin (``edges``)."""
    bounds = [lo, *(int(e) for e in edges if lo < e < hi), hi] if hi > lo else []
    return [seq[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _draw_from_open(
    pieces: list[list[int]], open_units: int, g: torch.Generator
) -> tuple[list[int], list[int]]:
    """The samples of ``pieces`` (each a shard's run of samples) drawn from ``open_units``
    pieces open at once: each next sample from an open piece chosen uniformly, a piece's
    samples in a random order, a drained piece replaced by the next; with the piece each
    sample came from."""
    pieces = [[p[j] for j in torch.randperm(len(p), generator=g).tolist()] for p in pieces if p]
    draws = torch.rand(sum(map(len, pieces)), generator=g).tolist()
    pool: list[list[int]] = []  # open shards: [piece number, samples taken]
    queued = 0
    while len(pool) < max(1, open_units) and queued < len(pieces):
        pool.append([queued, 0])
        queued += 1
    out = []
    tags = []
    for x in draws:
        at = min(int(x * len(pool)), len(pool) - 1)
        slot = pool[at]
        piece = pieces[slot[0]]
        out.append(piece[slot[1]])
        tags.append(slot[0])
        slot[1] += 1
        if slot[1] == len(piece):  # drained: the next shard takes its place
            if queued < len(pieces):
                pool[at] = [queued, 0]
                queued += 1
            else:
                pool[at] = pool[-1]
                pool.pop()
    return out, tags


@dataclass(frozen=True)
class ShuffleQuality:
    """How well an order mixes the data set (see :func:`shuffle_quality`)."""

    span: int
    units_per_span: float  # mean distinct units among ``span`` consecutive samples (a batch)
    displacement: float  # mean |position in the order - position in key order| / samples
    first_units: int = 0  # distinct units among the first ``span`` samples (the first batch)
    units_per_64: float = 0.0  # mean distinct units among 64 consecutive samples


def shuffle_quality(order: Sequence[int], unit_of: Sequence[int], span: int = 256) -> ShuffleQuality:
    """Measure an order's mixing: from how many units (blocks, or tar shards) a batch-sized run
    draws, and how far samples move from their key order. Computed from the order alone:
    nothing is fetched.

    Args:
        order: sample indices in the order they are read (a permutation of part of
            ``range(len(unit_of))``).
        unit_of: per sample index, the unit (block, shard) it belongs to.
        span: the run length, e.g. a batch: the order is cut into runs of ``span``
            consecutive samples (the whole order if shorter) and the distinct units of
            each full run are averaged.

    Returns:
        ``units_per_span``: about ``span`` for a full per-sample shuffle of many small
        units, about ``span / unit size`` without shuffle; ``first_units``: the distinct
        units of the first run (the first batch); ``units_per_64``: ``units_per_span`` for
        runs of 64 (over class-sorted shards, the distinct classes per 64 samples);
        ``displacement``: about 1/3 for a full shuffle, 0 without.
    """
    if span < 1:
        raise ValueError(f"span must be >= 1, got {span}")
    if not order:
        return ShuffleQuality(span, 0.0, 0.0)
    n = len(unit_of)
    scale = n / len(order)  # a rank's part spreads over the whole data set
    moved = sum(abs(pos * scale - i) for pos, i in enumerate(order)) / (len(order) * n)
    first = len({unit_of[i] for i in order[:span]})
    return ShuffleQuality(span, _per_run(order, unit_of, span), moved, first, _per_run(order, unit_of, 64))


def _per_run(order: Sequence[int], unit_of: Sequence[int], span: int) -> float:
    runs = [order[a : a + span] for a in range(0, len(order) - span + 1, span)] or [order]
    return sum(len({unit_of[i] for i in run}) for run in runs) / len(runs)


# shuffle="block": the most samples a window holds, and the windows the budget holds (see block_window)
WINDOW_CAP, WINDOWS_IN_BUDGET = 8192, 3


def pinned_order(n: int, seed: int, epoch: int, nodes: int, ranks: int, drop_last: bool) -> list[int]:
    """The global order of ``epoch`` of ``n`` samples that keeps each node's samples on it: one
    permutation of the seed alone, padded by repetition (or cut, ``drop_last``) to ``ranks``
    equal parts as ``DistributedSampler`` pads, is cut into ``nodes`` contiguous shares, node
    ``k`` holding ranks ``k * ranks / nodes`` onward (launchers place consecutive ranks on a
    node); each epoch shuffles every share anew (``seed + epoch``) and lays the shares out so
    that dealing the order round-robin to the ranks gives each rank its part of its node's share
    (``order[r::ranks]``). A node's epoch cache of its share then holds what its ranks read in
    every epoch. With ``nodes`` of 1 it is a permutation of each epoch (another than
    ``DistributedSampler``'s)."""
    local = ranks // nodes
    per = part_len(n, ranks, drop_last)
    base = np.random.default_rng([seed & (2**64 - 1), 0x9E3779B9]).permutation(n)
    if per * ranks > n:
        base = np.resize(base, per * ranks)  # padded by repeating it from its start
    shares = base[: per * ranks].reshape(nodes, local * per)
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    mixed = np.stack([share[torch.randperm(len(share), generator=g).numpy()] for share in shares])
    # position j * ranks + k * local + l is sample j * local + l of node k's share
    out: list[int] = mixed.reshape(nodes, per, local).transpose(1, 0, 2).reshape(-1).tolist()
    return out


def open_shards(budget: int, largest: int, total: int, count: int) -> int:
    """How many shards a shard order keeps open at once: all ``count`` when their ``total``
    fits ``budget``, else as many of the ``largest`` as fit beside one more being staged."""
    if total <= budget:
        return max(1, count)
    return max(1, budget // max(1, largest) - 1)


def block_window(budget: int, mean_sample_size: float) -> int:
    """How many samples a ``shuffle="block"`` window holds: as many as :data:`WINDOWS_IN_BUDGET`
    (3) windows of average samples fit in ``budget`` (one being read, two being staged), at most
    :data:`WINDOW_CAP`. A call stages whole windows, so a window the budget cannot hold would be
    cut into calls that split its blocks; a smaller budget gives smaller windows. The window does
    not follow ``calls_in_flight``: where windows are as large as calls, the budget holds three of
    them and the calls beyond wait for releases, so more calls in flight never make an order mix
    less."""
    fits = int(budget // (WINDOWS_IN_BUDGET * max(1.0, mean_sample_size)))
    return max(1, min(WINDOW_CAP, fits))
