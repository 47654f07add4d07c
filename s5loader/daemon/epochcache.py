"""The daemon's epoch cache (``--epoch-cache SIZE``): samples of one epoch kept for the next,
so a later epoch reads them from local disk instead of S3.

As the sampler's (see :mod:`s5loader._sampling.cacheplan`): the samples kept while epoch ``e``
is delivered are the start of epoch ``e+1``'s order, as many as fit ``SIZE``. The consumer
deletes what it read, so the daemon keeps a sample when it delivers it: its files are
hard-linked into the cache (no copy) before the folder is renamed into place. When the engine
reaches a kept sample in the next epoch, the entry is renamed into the staging folder and marked
staged without an s5cmd line; it is delivered as any staged sample. Its bytes count against
``SIZE`` until the consumer deletes it. The engine runs ahead of delivery (by the budget), so
it may reach a kept sample before the daemon delivered it in the epoch before: it then waits
there for that delivery instead of fetching the sample again.

The cache lives in ``CACHE/.epoch-cache/``, survives a restart of the daemon (a restarted
daemon keeps the entries the current and the next epoch need), and is removed once the last
epoch is delivered, or by ``--fresh``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence

import numpy as np

from .._index.sample import Sample
from .._sampling.cacheplan import Admission, keep_set
from ..engine.budget import Budget
from ..staging.epochcache import EpochCache
from ..staging.layout import StagingLayout
from .epochs import EpochSamples
from .options import PrefetchOptions
from .protocol import EPOCH_DIR


class _Hits(set[int]):
    """The engine's ``kept`` set: ``seq in hits`` takes a cached sample for delivery ``seq``."""

    def __init__(self, take: Callable[[int], bool]) -> None:
        super().__init__()
        self.take = take

    def __contains__(self, seq: object) -> bool:
        return isinstance(seq, int) and self.take(seq)


class DaemonEpochCache:
    """The epoch cache of a daemon whose cache directory is ``cache``.

    Args:
        cache: the daemon's cache directory.
        view: every epoch's samples, in delivery order.
        capacity: the cache's size in bytes.
        fingerprint: the index's fingerprint (entries of another index never count).
        staging: the engine's staging folder (a hit is moved there).
        verify: check a hit's MD5 ETag as well as its sizes.
    """

    def __init__(
        self, cache: str, view: EpochSamples, capacity: int, fingerprint: str, staging: str, verify: bool
    ) -> None:
        self.cache = EpochCache(os.path.join(cache, EPOCH_DIR), "daemon", fingerprint, keep=True)
        self.view = view
        self.samples = view.samples
        self.sizes = self.samples.sizes()  # type: ignore[attr-defined]
        self.n = len(self.samples)
        self.capacity = capacity
        self.verify = verify
        self.layout = StagingLayout(staging)
        self.admission = Admission(capacity)
        self.taken: dict[int, int] = {}  # seq -> bytes: hits not yet deleted by the consumer
        self.held_hits: dict[int, int] = {}  # seq -> bytes: hits delivered, held in the staging budget
        self.held_hit_bytes = 0  # their sum (read by the daemon's thread while the engine's changes them)
        self.hits: dict[int, int] = {}  # epoch -> samples delivered from the cache
        self.fetched: dict[int, int] = {}  # epoch -> bytes delivered that came from S3
        self._keep: dict[int, frozenset[int]] = {}
        self._inverse: dict[int, np.ndarray] = {}
        self.budget: Budget | None = None
        self.waiting: dict[int, int] = {}  # seq the engine waits at -> the delivery it waits for
        self.next = 0  # the next delivery

    def keep(self, epoch: int) -> frozenset[int]:
        """The samples kept for ``epoch``: the start of its order, while they fit."""
        found = self._keep.get(epoch)
        if found is None:
            found = keep_set([self.view.order(epoch)], self.sizes, self.capacity).keep
            self._keep = {e: k for e, k in self._keep.items() if e >= epoch - 1}
            self._keep[epoch] = found
        return found

    def open(self, delivered: int) -> _Hits:
        """Open the folder for a daemon that delivered ``delivered`` samples so far: keep the
        entries the current and the next epoch need, drop the rest. Returns the engine's
        ``kept`` set."""
        self.cache.open()
        epoch = delivered // max(1, self.n)
        wanted = self.keep(epoch) | self.keep(epoch + 1)
        held = 0
        for idx in self.cache.names():
            if idx in wanted:
                held += int(self.sizes[idx])
            else:
                self.cache.drop(idx)
        self.admission = Admission(self.capacity, held)
        self.next = delivered
        return _Hits(self._take)

    def _where(self, seq: int) -> tuple[int, int]:
        epoch, pos = divmod(seq, self.n)
        return epoch, self.view.order(epoch)[pos]

    def attach(self, budget: Budget) -> Callable[[list[int]], None]:
        """Work with the engine's ``budget``; returns its release hook."""
        self.budget = budget
        return self.on_release

    def _take(self, seq: int) -> bool:
        if seq in self.taken:
            return True  # asked again (a call the engine planned, then put off): still a hit
        epoch, idx = self._where(seq)
        if epoch == 0 or idx not in self.keep(epoch):
            return False
        dest = self.layout.sample_dir(seq)
        if not self.cache.take(idx, dest, self.samples[idx], self.verify):
            # delivered (and kept) since the look: the entry is there now
            if not self._wait_for(seq, epoch, idx) or not self.cache.take(idx, dest, self.samples[idx], self.verify):
                return False
        self.taken[seq] = int(self.sizes[idx])  # counted until the consumer deletes it
        return True

    def _wait_for(self, seq: int, epoch: int, idx: int) -> bool:
        """The engine reached kept sample ``idx`` of ``epoch`` (at ``seq``) and found no entry:
        if the daemon has not delivered it in the epoch before, which keeps it, hold the engine
        there (a mark in the budget that frees nothing) until that delivery, rather than fetch
        it again, and return False. True when that delivery has passed (a delivery keeps the
        sample before it passes, so the entry is there if it was kept: look again)."""
        before = (epoch - 1) * self.n + self._position(epoch - 1, idx)
        if self.budget is None:
            return before < self.next
        with self.budget.cond:
            if before < self.next:
                return True
            self.budget.held.setdefault(seq, 0)
            self.waiting[seq] = before
        return False

    def _position(self, epoch: int, idx: int) -> int:
        inv = self._inverse.get(epoch)
        if inv is None:
            inv = np.argsort(np.asarray(self.view.order(epoch), dtype=np.int64), kind="stable")
            self._inverse = {epoch: inv}
        return int(inv[idx])

    def delivering(self, seq: int, folder: str) -> int:
        """Sample ``seq`` (staged in ``folder``) is about to be delivered: keep it when the
        next epoch keeps it and it fits. Returns the bytes of a hit that leaves the cache with
        this delivery (the staging budget holds them until the consumer deletes it), else 0."""
        epoch, idx = self._where(seq)
        size = int(self.sizes[idx])
        keep = idx in self.keep(epoch + 1) and not os.path.isdir(self.cache.entry(idx))
        if seq in self.taken:
            self.hits[epoch] = self.hits.get(epoch, 0) + 1
            if not (keep and self.cache.link(folder, idx, self.samples[idx])):
                # a delivered hit counts as any delivered sample, in the staging budget: its
                # room in the cache is free for the next epoch's samples at once
                self.admission.remove(self.taken.pop(seq))
                self.passed(seq)
                self.held_hits[seq] = size
                self.held_hit_bytes += size
                return size
            del self.taken[seq]  # its bytes, counted already, are the entry's now (the same blocks)
        else:
            self.fetched[epoch] = self.fetched.get(epoch, 0) + size
            if keep and self.admission.admit(size) and not self.cache.link(folder, idx, self.samples[idx]):
                self.admission.remove(size)
        self.passed(seq)
        return 0

    def passed(self, seq: int) -> None:
        """Delivery ``seq`` is done (or skipped): the engine may go on past samples that
        waited for it."""
        if self.budget is None:
            self.next = seq + 1
            return
        with self.budget.cond:  # with _wait_for's look and mark: no wait is left behind
            self.next = seq + 1
            for later, before in list(self.waiting.items()):
                if before <= seq:
                    del self.waiting[later]
                    if self.budget.held.get(later) == 0:
                        del self.budget.held[later]

    def on_release(self, released: list[int]) -> None:
        """The consumer deleted ``released``: a hit's bytes left the cache (the engine's thread)."""
        for seq in released:
            self.held_hit_bytes -= self.held_hits.pop(seq, 0)
            size = self.taken.pop(seq, None)
            if size is not None:
                self.admission.remove(size)

    def figures(self, delivered: int) -> dict[str, int]:
        """The figures of the epoch being delivered, for the JSON log."""
        epoch = max(0, delivered - 1) // max(1, self.n)
        return {
            "epoch_cache_hits": self.hits.get(epoch, 0),
            "epoch_cache_bytes": self.admission.held,
            "epoch_fetched_bytes": self.fetched.get(epoch, 0),
            "epoch_hit_bytes": self.held_hit_bytes,
        }

    def close(self, done: bool) -> None:
        """Leave the folder; remove it, ``.epoch-cache/`` with it, once every epoch was
        delivered (``done``)."""
        self.cache.keep = not done
        self.cache.close()
        if done:
            with contextlib.suppress(OSError):  # not empty: another daemon's entries (it will remove them)
                os.rmdir(self.cache.root)


def epoch_cache_room(opts: PrefetchOptions, samples: Sequence[Sample]) -> int:
    """The bytes the epoch cache may take beside the budget: none for one epoch, and never
    more than the data set."""
    return min(opts.epoch_cache, sum(s.size for s in samples)) if opts.epochs > 1 else 0


def open_epoch_cache(
    opts: PrefetchOptions, cache: str, view: Sequence[Sample], fingerprint: str, staging: str
) -> DaemonEpochCache | None:
    """The daemon's epoch cache, with ``--epoch-cache`` over raw objects for more than one epoch."""
    if not opts.epoch_cache or opts.epochs < 2 or not isinstance(view, EpochSamples):
        return None
    return DaemonEpochCache(cache, view, opts.epoch_cache, fingerprint, staging, opts.verify)
