"""The daemon's sample sequence: every epoch's order, one after another, and the fingerprint
that tells whether a cache's progress belongs to the same index."""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import overload

from .._index.sample import Sample
from .._sampling.order import Order
from ..staging.epochcache import index_fingerprint

__all__ = ["EpochSamples", "index_fingerprint"]


class EpochSamples(Sequence[Sample]):
    """All epochs as one sequence: item ``seq`` is the sample delivered ``seq``-th.

    ``seq = epoch * n + position``; each epoch's order comes from :class:`Order`, computed
    when first needed (a few epochs are kept).
    """

    def __init__(
        self, samples: Sequence[Sample], order: Order, epochs: int,
        units: list[list[int]] | None = None, window: int = 1000,
    ) -> None:
        self._samples = samples
        self._order = order
        self._units = units  # with shuffle "block": the blocks, as the sampler's
        self._window = window
        self._n = len(samples)
        self._epochs = epochs
        self._perms: collections.OrderedDict[int, list[int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._n * self._epochs

    @overload
    def __getitem__(self, seq: int) -> Sample: ...

    @overload
    def __getitem__(self, seq: slice) -> Sequence[Sample]: ...

    def __getitem__(self, seq: int | slice) -> Sample | Sequence[Sample]:
        if isinstance(seq, slice):
            return [self[i] for i in range(*seq.indices(len(self)))]
        if not 0 <= seq < len(self):
            raise IndexError(seq)
        epoch, pos = divmod(seq, self._n)
        return self._samples[self._perm(epoch)[pos]]

    @property
    def samples(self) -> Sequence[Sample]:
        """The data set's samples (one epoch)."""
        return self._samples

    def order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s order: item ``pos`` is the index delivered at ``epoch * n + pos``."""
        return self._perm(epoch)

    def _perm(self, epoch: int) -> list[int]:
        with self._lock:
            perm = self._perms.get(epoch)
            if perm is None:
                perm = self._order.indices(self._n, epoch, units=self._units, window=self._window)
                self._perms[epoch] = perm
                while len(self._perms) > 3:
                    self._perms.popitem(last=False)
            return perm
