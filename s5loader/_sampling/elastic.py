"""An epoch of a per-rank order (tar shards; ``shuffle="block"``) resumed mid-way on another
number of ranks.

In such an order each rank reads a part of its own (runs of whole shards, or of blocks), so a
position in one rank's part says nothing of another's; but under DDP the ranks move in lockstep,
so every rank had handed out the same count ``c`` of its part when the state was taken. What
the epoch has left is then known from the order alone: each old rank's part after its first
``c`` positions. The rest is laid end to end (old rank 0's rest first) and cut into equal
contiguous parts for the new ranks, padded by repetition from its start (or cut, with
``drop_last``) as the first cut was, so a shard stays with one new rank where it can, and every
sample the epoch had left comes once (padding aside). A state taken during such a rest records
the chain of ``(ranks, position)`` it came through, so it resumes again, on any number of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ..exceptions import StateError

Chain = list[tuple[int, int]]  # (ranks, position each had reached in its part), oldest first


def split(seq: Sequence[int], parts: int, drop_last: bool) -> list[list[int]]:
    """``seq`` cut into ``parts`` equal contiguous parts: padded by repetition from its start, or
    with ``drop_last`` its tail cut off, as a sampler's first cut among ranks is."""
    if not seq:
        return [[] for _ in range(parts)]
    per = len(seq) // parts if drop_last else math.ceil(len(seq) / parts)
    padded = list(seq)
    while len(padded) < per * parts:
        padded += seq[: per * parts - len(padded)]
    return [padded[k * per : (k + 1) * per] for k in range(parts)]


def rest_of_epoch(
    part_of: Callable[[int, int], list[int]], chain: Chain, world: int, rank: int, drop_last: bool
) -> list[int]:
    """Rank ``rank`` of ``world``'s part of what the epoch has left after ``chain``.

    Args:
        part_of: ``(ranks, rank) -> that rank's whole part`` of the epoch's first order.
        chain: ``(ranks, position)`` pairs: the epoch ran on that many ranks until each had
            handed out ``position`` samples of its part (of the first order, then of the rest).

    Raises:
        StateError: a position past its part's end.
    """
    first_world, first_at = chain[0]
    parts = [part_of(first_world, r) for r in range(first_world)]
    rest = _after(parts, first_at)
    for ranks, at in chain[1:]:
        rest = _after(split(rest, ranks, drop_last), at)
    return split(rest, world, drop_last)[rank]


def _after(parts: list[list[int]], at: int) -> list[int]:
    if any(at > len(p) for p in parts):
        raise StateError(
            f"the state's position {at} is past its ranks' parts ({min(map(len, parts))} samples)"
        )
    return [i for p in parts for i in p[at:]]


def check_chain(raw: object) -> Chain:
    """The ``elastic`` field of a state: a list of ``[ranks, position]`` pairs of ints.

    Raises:
        StateError: anything else.
    """
    chain: Chain = []
    for p in raw if isinstance(raw, list) else [None]:
        if not (isinstance(p, (list, tuple)) and len(p) == 2 and all(type(x) is int for x in p)):
            raise StateError(f"state['elastic'] must be a list of [ranks, position] pairs, got {raw!r}")
        ranks, at = p
        if ranks < 1 or at < 0:
            raise StateError(f"state['elastic'] must be a list of [ranks, position] pairs, got {raw!r}")
        chain.append((ranks, at))
    return chain
