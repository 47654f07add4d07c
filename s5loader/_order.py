"""How samples are ordered: a seeded permutation per epoch, split across ranks."""

from __future__ import annotations

import math
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
        are permuted, samples are shuffled within windows of ``window`` consecutive samples,
        and each rank takes a contiguous slice, so the samples of a block stay together and
        are fetched with one request; ``start`` counts samples of this rank's slice.
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
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        seq = [i for u in torch.randperm(len(units), generator=g).tolist() for i in units[u]]
        for w0 in range(0, len(seq), window):
            chunk = seq[w0 : w0 + window]
            seq[w0 : w0 + window] = [chunk[k] for k in torch.randperm(len(chunk), generator=g).tolist()]
        w = self.num_replicas
        per = n // w if self.drop_last else math.ceil(n / w)
        if per * w > len(seq) and seq:
            seq += (seq * math.ceil((per * w - len(seq)) / len(seq)))[: per * w - len(seq)]
        return seq[self.rank * per : (self.rank + 1) * per][start:]
