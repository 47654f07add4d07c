"""Which samples the epoch cache keeps, and how its bytes are shared: pure functions of the
known orders, the same on every local rank.

The order of every future epoch is known (it is seeded), so the cache keeps what the next epoch
needs first (Belady's choice, with the future known): :func:`keep_set` walks the next epoch's
order from its start, interleaved across the node's local ranks by position, and takes samples
while their bytes fit the cache. A later epoch therefore starts on cached samples, which it
consumes first, making room for the samples kept for the epoch after it before most of them are
read.

The local ranks share one cache folder without talking to each other: each rank admits only the
samples it reads, and counts them against a share of the cache (:func:`rank_capacity`) that
every rank computes alike, so the shares add up to the cache's size.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._util.dist import cache_node_ranks, nodes_alike
from .._util.dist import node_ranks as node_ranks  # the node's ranks share one cache
from .order import Order


@dataclass(frozen=True)
class KeepPlan:
    """The samples kept for one epoch: ``keep``, their bytes in all (``total``) and the bytes
    of them in each local rank's part (``per_rank``, in the order of the orders given)."""

    keep: frozenset[int]
    per_rank: tuple[int, ...]
    total: int


def keep_set(orders: Sequence[Sequence[int]], sizes: Sequence[int] | np.ndarray, capacity: int) -> KeepPlan:
    """The samples to keep for an epoch whose local ranks read ``orders`` (one each): position 0
    of every rank, then position 1 of every rank, ..., while the samples' ``sizes`` fit in
    ``capacity`` bytes; the walk stops at the first sample that does not fit, so what is kept
    is the start of the epoch. An index met again (padding) counts once, for the rank that
    reads it first."""
    keep: set[int] = set()
    per = [0] * len(orders)
    total = 0
    longest = max((len(o) for o in orders), default=0)
    for p in range(longest):
        for r, order in enumerate(orders):
            if p >= len(order):
                continue
            idx = int(order[p])
            if idx in keep:
                continue
            size = int(sizes[idx])
            if total + size > capacity:
                return KeepPlan(frozenset(keep), tuple(per), total)
            keep.add(idx)
            per[r] += size
            total += size
    return KeepPlan(frozenset(keep), tuple(per), total)


def rank_capacity(plan: KeepPlan, me: int, capacity: int) -> int:
    """The bytes local rank ``me`` may hold in the cache during the epoch ``plan`` keeps for:
    the kept samples it reads in that epoch (found in the cache at its start) plus an equal
    share of what the plan leaves free. The shares of all local ranks add up to at most
    ``capacity``, so the cache never holds more, whatever each rank admits."""
    ranks = max(1, len(plan.per_rank))
    return plan.per_rank[me] + max(0, capacity - plan.total) // ranks


class Admission:
    """One rank's bytes in the cache against its share (``capacity``).

    A sample is admitted only while it fits; a refused admission is only a future miss. The
    sampler's thread admits what it hands out to be kept while the engine's thread removes what
    was read: each change is made under a lock.
    """

    def __init__(self, capacity: int, held: int = 0) -> None:
        self.capacity = capacity
        self.held = held
        self._lock = threading.Lock()

    def admit(self, size: int) -> bool:
        """Count ``size`` more bytes if they fit; whether they did."""
        with self._lock:
            if self.held + size > self.capacity:
                return False
            self.held += size
            return True

    def remove(self, size: int) -> None:
        with self._lock:
            self.held = max(0, self.held - size)


def pin_to_nodes(order: Order, cached: bool) -> Order:
    """``order`` with :attr:`~.order.Order.pin` set where its samples (or tar shards) stay on
    their nodes across epochs: ``shuffle=True`` with an epoch cache (``cached``) on more than one
    node of equal ranks. Each node then reads the same share of the data set every epoch,
    shuffled anew within the node, so a node's cache of its share holds what its ranks read
    next; without the pin they read another random part each epoch, and a node's cache pays off
    for a fraction of it (local ranks / ranks). ``shuffle="block"`` keeps its order, and so do
    nodes of different numbers of ranks (SLURM's tasks per node say so), whose ranks could not
    agree on the shares; mpirun's variables give this node's count only: its nodes must run as
    many ranks each.

    Raises:
        ConfigError: see :func:`~s5loader._util.dist.cache_node_ranks`.
    """
    if not cached or order.shuffle is not True or order.num_replicas < 2:
        return order
    local = len(cache_node_ranks(order.rank, order.num_replicas))
    if order.num_replicas % local or order.num_replicas == local or not nodes_alike():
        return order  # uneven nodes would cut the shares differently: DistributedSampler's order
    return Order(
        order.shuffle,
        order.seed,
        order.num_replicas,
        order.rank,
        order.drop_last,
        (order.num_replicas // local, order.num_replicas),
    )
