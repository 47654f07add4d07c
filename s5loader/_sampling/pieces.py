"""How a rank's part of a unit order is laid out (see :class:`~s5loader._sampling.order.Order`):
units end to end in equal parts, contiguous runs of a part, a streamed shard's growing
windows."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# shuffle="block": the samples of a rank's first window; later windows double up to the
# full window (the engine's first calls grow the same way)
FIRST_WINDOW = 32


def front_first(out: list[int], tags: list[int], g: torch.Generator) -> list[int]:
    """``out`` with the samples of its first sample's shard (the one a pass reads while it
    downloads, see _shards/stream.py) put, in the places they hold, into that shard's own order
    by windows of 32, 64, ... samples, each shuffled: the first batches wait for the front of
    the shard, not for samples at random in the whole of it."""
    if not out:
        return out
    places = [p for p, t in enumerate(tags) if t == tags[0]]
    arranged: list[int] = []
    for w in growing(sorted(out[p] for p in places), len(places)):
        arranged += [w[k] for k in torch.randperm(len(w), generator=g).tolist()]
    for p, i in zip(places, arranged, strict=True):
        out[p] = i
    return out


def end_to_end(
    units: list[list[int]], picks: Sequence[int], n: int, w: int, drop_last: bool
) -> tuple[list[int], list[int], int]:
    """The units in ``picks`` order laid end to end and padded by repetition (or cut with
    ``drop_last``) to ``w`` equal parts of ``n`` samples: the sequence, where each unit begins
    in it (the repeated head is a unit of its own), and the part length."""
    seq: list[int] = []
    edges: list[int] = []
    for u in picks:
        edges.append(len(seq))
        seq += units[u]
    per = part_len(n, w, drop_last)
    if per * w > len(seq) and seq:
        edges.append(len(seq))
        seq += (seq * math.ceil((per * w - len(seq)) / len(seq)))[: per * w - len(seq)]
    return seq, edges, per


def growing(piece: list[int], window: int) -> list[list[int]]:
    """``piece`` cut into runs of :data:`FIRST_WINDOW` samples, then twice as many each, while
    they are smaller than ``window``; the rest in one."""
    out, at, size = [], 0, FIRST_WINDOW
    while size < window and len(piece) - at > size:
        out.append(piece[at : at + size])
        at, size = at + size, 2 * size
    return [*out, piece[at:]]


def cut(pieces: list[list[int]], w: int, k: int) -> list[list[int]]:
    """The ``w``-th of ``k`` contiguous runs of the pieces laid end to end, cut where they meet."""
    total = sum(map(len, pieces))
    lo, hi = total * w // k, total * (w + 1) // k
    out, at = [], 0
    for p in pieces:
        a, b = max(lo, at), min(hi, at + len(p))
        if a < b:
            out.append(p[a - at : b - at])
        at += len(p)
    return out


def part_len(n: int, num_replicas: int, drop_last: bool) -> int:
    """Samples in each rank's part of ``n``: the tail dropped, or padded by repetition."""
    return n // num_replicas if drop_last else math.ceil(n / num_replicas)
