"""How samples are ordered: a seeded permutation per epoch, split across ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Order:
    """How one pass over the data is ordered and split across ranks."""

    shuffle: bool
    seed: int
    num_replicas: int
    rank: int
    drop_last: bool

    def indices(self, n: int, epoch: int, start: int = 0) -> list[int]:
        """This rank's part of the epoch, from global position ``start`` on.

        The global order is one permutation of ``range(n)`` per ``(seed, epoch)``, the same on
        every rank. The positions from ``start`` on are dealt round-robin to the ranks after
        padding by repetition (or dropping the tail with ``drop_last``) so every rank gets
        the same count; with ``start=0`` this is exactly ``DistributedSampler``'s split.
        """
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            perm: list[int] = torch.randperm(n, generator=g).tolist()
        else:
            perm = list(range(n))
        rest = perm[start:]
        w = self.num_replicas
        if not rest:
            return []
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % w]
        elif len(rest) % w:
            pad = w - len(rest) % w
            rest += (rest * math.ceil(pad / len(rest)))[:pad]
        return rest[self.rank :: w]
