"""The epoch cache of one sampler across its passes: what each pass finds in the cache, which of
its samples its readers hand back, and which of those the cache keeps.

At the start of a pass (:meth:`CacheRun.begin_pass`) the keep-sets of this epoch and the next
are planned (:mod:`.cacheplan`), the cache folder is read once, stale entries are dropped and the
entries this rank will read become its hits (:class:`Hits`, the engine's ``kept`` set: a hit is
moved into the pass folder when the engine reaches it and marked staged without an s5cmd line).
The samples of the pass that the next epoch keeps are yielded with ``back`` set, so their readers
rename them into the pass's hand-back folder instead of deleting them; the engine, told of each
release (:meth:`CacheRun.on_release`, in its thread), admits them into the cache while they fit
this rank's share, and deletes the rest. In a pass whose tar shards are punched as their samples
are read (``shuffle=True`` over shards), a shard kept so is not punched: what its read samples
would give back is told to the engine all the same, so the order and the budget are those of a
run without a cache, and the shard counts against this rank's share from the moment the pass
first hands it out (:meth:`CacheRun.reserve`; one that does not fit then is punched and deleted
as any other). What readers hand back after a pass ended is collected before the next one
begins (:meth:`CacheRun.collect`).

So all bookkeeping happens in one process (the sampler's): the engine's thread and the
sampler's, whose shared count of the cache's bytes (:class:`~.cacheplan.Admission`) takes a
lock.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import shutil
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from .._index.sample import Sample
from .._staging.epochcache import EpochCache, index_fingerprint
from .._staging.layout import HANDED_BACK, StagingLayout
from .._util.dist import cache_node_ranks, rank_info
from ..dataset import S5Dataset
from .cacheplan import Admission, KeepPlan, keep_set, rank_capacity
from .units import units_of

log = logging.getLogger("s5loader.sampler")


class Hits(set[int]):
    """The engine's ``kept`` set for a pass: ``idx in hits`` moves a cached sample into the pass
    folder and answers whether it is there now (an entry that vanished or fails its check is a
    miss; a hit stays one until it is read)."""

    def __init__(self, run: CacheRun, candidates: set[int]) -> None:
        super().__init__()
        self.run = run
        self.candidates = candidates

    def has(self, idx: int) -> bool:
        """Whether ``idx`` may be a hit, without taking it."""
        return idx in self.candidates or idx in self.run.taken

    def keeps(self, unit: int) -> bool:
        """Whether ``unit`` of the pass goes back to the cache (see :meth:`CacheRun.reserve`)."""
        return self.run.reserve(unit)

    def __contains__(self, idx: object) -> bool:
        if not isinstance(idx, int):
            return False
        if idx in self.run.taken:
            return True  # asked again (a call the engine planned, then put off): still a hit
        if idx not in self.candidates:
            return False
        self.candidates.discard(idx)
        return self.run.take(idx)


class CacheRun:
    """A sampler's epoch cache of ``capacity`` bytes below ``root``.

    Args:
        samples: the data set's units (its samples, or one per tar shard), as the engine stages them.
        sizes: their sizes (bytes staged).
        cache: the cache folder.
        capacity: the cache's size for the node.
        orders: the full orders of an epoch of the node's local ranks, one list of samples per rank.
        me: this rank's place among them.
        verify: check a hit's MD5 ETag as well as its sizes.
        units_of: the unit of each sample of an order (a tar shard's sample: its shard);
            ``None``: each sample is its own. The cache keeps, hits and hands back units.
        cacheable: whether a unit can be kept at all (``None``: every one).
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        sizes: np.ndarray,
        cache: EpochCache,
        capacity: int,
        orders: Callable[[int], list[list[int]]],
        me: int,
        verify: bool,
        units_of: Callable[[Sequence[int]], list[int]] | None = None,
        cacheable: Callable[[int], bool] | None = None,
    ) -> None:
        self.units_of = units_of
        self.cacheable = cacheable
        self.samples = samples
        self.sizes = sizes
        self.cache = cache
        self.capacity = capacity
        self.orders = orders
        self.me = me
        self.verify = verify
        self.admission = Admission(capacity)
        self.back: frozenset[int] = frozenset()
        self.taken: set[int] = set()
        self.kept: dict[int, bool] = {}  # the units of the pass asked about: whether they go back
        self.reserving = False  # see begin_pass
        self.layout: StagingLayout | None = None
        self.strays: dict[int, str] = {}
        self.hits = 0  # in the current pass
        self.admitted = 0
        self._plans: dict[int, KeepPlan] = {}

    # -- between passes (the caller's thread) ------------------------------------------------
    def units(self, order: Sequence[int]) -> list[int]:
        """The units of ``order`` in the order they are first met."""
        if self.units_of is None:
            return list(order)
        return list(dict.fromkeys(self.units_of(order)))

    def unit_orders(self, epoch: int) -> list[list[int]]:
        return [self.units(o) for o in self.orders(epoch)]

    def plan(self, epoch: int, unit_orders: list[list[int]] | None = None) -> KeepPlan:
        """The keep-set for ``epoch`` (the start of its order, across the local ranks), from its
        ``unit_orders`` where the caller has them."""
        found = self._plans.get(epoch)
        if found is None:
            units = self.unit_orders(epoch) if unit_orders is None else unit_orders
            found = keep_set(units, self.sizes, self.capacity)
            self._plans = {e: p for e, p in self._plans.items() if e >= epoch - 1}
            self._plans[epoch] = found
        return found

    def collect(self, folder: str) -> None:
        """After the engine of the pass in ``folder`` stopped: put its hits that nobody read
        back into the cache (a pass broken off, or replaced), and admit (or delete) what readers
        handed back after the engine stopped listening."""
        layout = self.layout
        if layout is not None and layout.folder == folder:
            for idx in list(self.taken):
                self.taken.discard(idx)
                if not self._whole(idx):  # opened and punched: it is no longer the object it was
                    shutil.rmtree(layout.sample_dir(idx), ignore_errors=True)
                    self.admission.remove(int(self.sizes[idx]))
                elif not self.cache.admit(layout.sample_dir(idx), idx, missing_ok=True):
                    self.admission.remove(int(self.sizes[idx]))  # read meanwhile: its bytes left
        where = os.path.join(folder, HANDED_BACK)
        try:
            names = [int(n) for n in os.listdir(where) if n.isdigit()]
        except FileNotFoundError:
            return
        for idx in names:
            self._keep_or_drop(idx, os.path.join(where, str(idx)))

    def keep_staged(self, folder: str, ready: list[int]) -> None:
        """When the cache outlives this run: move the samples of the stopped pass in ``folder``
        that were staged (``ready``) and not read into the cache, while they fit."""
        layout = StagingLayout(folder)
        for idx in ready:
            path = layout.sample_dir(idx)
            if os.path.isdir(path) and self._whole(idx) and self.admission.admit(int(self.sizes[idx])):
                if not self.cache.admit(path, idx, missing_ok=True):
                    self.admission.remove(int(self.sizes[idx]))

    def begin_pass(
        self, epoch: int, order: list[int], folder: str, reserving: bool = False
    ) -> tuple[Hits, frozenset[int]]:
        """Prepare the pass of ``epoch`` that stages ``order`` (this rank's, maybe resumed part
        way) into ``folder``: the engine's hits, and the units whose readers hand them back.
        ``reserving``: the pass's tar shards are punched as their samples are read, so a unit
        kept for the next epoch counts against the cache from its first hand-out on
        (:meth:`reserve`); else from its hand-back."""
        self.cache.open()
        full = self.unit_orders(epoch)
        now, nxt = self.plan(epoch, full), self.plan(epoch + 1)
        rest = set(self.units(order))
        consumed = set(full[self.me]) - rest
        everyone = set().union(*full) if self.me == 0 else set()
        candidates: set[int] = set()
        held = 0
        # Samples another local rank's readers handed back after its engine stopped: that rank
        # admits them when its next pass begins, maybe after this one reached them.
        self.strays = _strays(self.cache.root, rest) if len(full) > 1 else {}
        for idx in set(self.cache.names()) | self.strays.keys():
            if idx in rest:
                candidates.add(idx)
            elif idx in consumed and idx in nxt.keep:
                pass  # kept for the next epoch before a restart: still this rank's
            elif idx in consumed or (self.me == 0 and idx not in everyone):
                self.cache.drop(idx)  # read already, or read by no rank this epoch
                continue
            else:
                continue  # another local rank's
            held += int(self.sizes[idx])
        self.admission = Admission(max(rank_capacity(now, self.me, self.capacity), 0), held)
        ok = self.cacheable
        self.back = frozenset(i for i in rest if i in nxt.keep and (ok is None or ok(i)))
        self.taken = set()
        self.kept = {}
        self.reserving = reserving
        self.layout = StagingLayout(folder)
        self.hits = 0
        self.admitted = 0
        return Hits(self, candidates), self.back

    def end_pass(self, epoch: int) -> None:
        log.info(
            "epoch %d: %d samples read from the epoch cache; %d kept for the next epoch, %d bytes held",
            epoch,
            self.hits,
            self.admitted,
            self.admission.held,
        )

    # -- while a pass runs (the engine's thread) ---------------------------------------------
    def take(self, idx: int) -> bool:
        assert self.layout is not None
        if self.cache.take(
            idx, self.layout.sample_dir(idx), self.samples[idx], self.verify, self.strays.get(idx)
        ):
            self.taken.add(idx)
            self.hits += 1
            return True
        self.admission.remove(int(self.sizes[idx]))  # counted at the start of the pass
        return False

    def _whole(self, unit: int) -> bool:
        """Whether ``unit`` of the current pass is as it was staged: in a pass that punches tar
        shards as they are read, one that was handed out and not kept may have holes."""
        return not self.reserving or self.kept.get(unit, True)

    def reserve(self, unit: int) -> bool:
        """Whether ``unit``, which the pass hands out now, goes back to the cache: the next
        epoch keeps it and, in a pass that counts its bytes from the first hand-out on (one whose
        tar shards are punched as they are read: see :meth:`begin_pass`), they fit this rank's
        share now (a hit is counted already). Else its bytes are counted once it is handed back
        (:meth:`_keep_or_drop`). Decided once per unit and pass; in the sampler's thread."""
        decided = self.kept.get(unit)
        if decided is None:
            decided = unit in self.back and (
                not self.reserving or unit in self.taken or self.admission.admit(int(self.sizes[unit]))
            )
            self.kept[unit] = decided
        return decided

    def on_release(self, released: list[int]) -> None:
        """Readers released ``released``: a hit's bytes left the cache, unless it goes back;
        what they handed back moves into the cache."""
        layout = self.layout
        for idx in released:
            hit = idx in self.taken
            self.taken.discard(idx)
            kept = self.kept.get(idx, False)
            if hit and not (kept and self.reserving):
                self.admission.remove(int(self.sizes[idx]))
            if kept and layout is not None:
                self._keep_or_drop(idx, layout.handed_back(idx))

    def _keep_or_drop(self, idx: int, folder: str) -> None:
        """Move the handed-back ``idx`` in ``folder`` into the cache (counted since it was
        handed out, see :meth:`reserve`, or now, while it fits), or delete it."""
        counted = self.reserving and self.kept.get(idx, False)
        size = int(self.sizes[idx])
        if os.path.isdir(folder):
            if counted or (not self.reserving and idx in self.back and self.admission.admit(size)):
                if self.cache.admit(folder, idx):
                    self.admitted += 1
                    return
                counted = True
            shutil.rmtree(folder, ignore_errors=True)
        if counted:
            self.kept[idx] = False
            self.admission.remove(size)

    @property
    def held(self) -> int:
        """Bytes this rank holds in the cache (or took out of it into a pass, not yet read, or
        reserved for a shard kept for the next epoch while it is read)."""
        return self.admission.held

    def close(self) -> None:
        self.cache.close()


def _strays(root: str, wanted: set[int]) -> dict[int, str]:
    """The hand-back folders of the staging passes below ``root`` (samplers' and iterable
    datasets' workers') that hold samples in ``wanted``."""
    found: dict[int, str] = {}
    for pattern in (("s5loader-*", "p*"), ("s5loader-*", "s5loader-*", "p*")):
        for folder in glob.glob(os.path.join(root, *pattern, HANDED_BACK)):
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            for n in names:
                if n.isdigit() and int(n) in wanted:
                    found[int(n)] = os.path.join(folder, n)
    return found


def cache_id(fingerprint: str, *job: object) -> str:
    """The name of the cache folder of an index (its ``fingerprint``) and a ``job``'s order
    settings and node: the same for every local rank of that job, and for a restarted job."""
    return hashlib.sha256(":".join(map(str, (fingerprint, *job))).encode()).hexdigest()[:16]


def new_cache_run(
    dataset: S5Dataset,
    cache: EpochCache,
    capacity: int,
    orders: Callable[[int], list[list[int]]],
    me: int,
    verify: bool,
) -> CacheRun:
    """A :class:`CacheRun` over ``dataset``'s units (samples, or tar shards: see
    :meth:`ObjectUnits.cache_units <s5loader._sampling.units.ObjectUnits.cache_units>`)."""
    of_order, cacheable = units_of(dataset).cache_units()
    return CacheRun(
        dataset.samples, dataset.samples.sizes(), cache, capacity, orders, me, verify, of_order, cacheable
    )


def weakly(method: Callable[[int], list[list[int]]]) -> Callable[[int], list[list[int]]]:
    """``method``, not keeping the object it is bound to alive (a plain function as it is)."""
    if not hasattr(method, "__self__"):
        return method
    ref = weakref.WeakMethod(method)

    def call(epoch: int) -> list[list[int]]:
        bound = ref()
        if bound is None:
            raise ReferenceError("the sampler of this epoch cache is gone")
        return bound(epoch)

    return call


def open_iterable_cache(
    dataset: S5Dataset,
    size: int,
    job: tuple[object, ...],
    num_replicas: int | None,
    rank: int | None,
    root: str,
    keep: bool,
) -> EpochCache | None:
    """The epoch cache folder of an iterable dataset with ``epoch_cache`` (``size``; None
    without), opened by the process that makes the dataset: its DataLoader workers use it while
    it lives (each a :meth:`~s5loader._staging.epochcache.EpochCache.sharer`), its ``close()``
    leaves it. ``job`` (the order's settings) and the node's ranks name the folder."""
    if not size:
        return None
    r, world = rank_info(num_replicas, rank)
    ranks = cache_node_ranks(r, world)
    fingerprint = index_fingerprint(dataset.samples)
    cache = EpochCache(
        root, cache_id(fingerprint, "iterable", *job, world, ranks[0], len(ranks)), fingerprint, keep
    )
    cache.open()
    return cache
