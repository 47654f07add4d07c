"""Cutting the order into calls: which positions the next call takes (:func:`pick_call`), and
when a call waits for releases instead of starting (:class:`Scheduler`).

The first calls are small (``first_call`` units, then twice, four times as many, ...) so that
the first samples are staged soon; later ones take ``samples_per_call``. A call never splits a
window (see :mod:`.stager`) while anything is staged, and a call the budget cuts to a sliver
waits for releases (:meth:`Budget.put_off <s5loader._engine.budget.Budget.put_off>`).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Container, Sequence, Sized
from dataclasses import dataclass

from .._index.compact import SampleIndex
from .._index.sample import DISK, Field, Sample
from .budget import Budget
from .ready import Readiness
from .retry import Retries
from .stats import Stats


@dataclass
class Pick:
    """The positions the next call takes, and where the order stands after it."""

    first: int  # the first position not yet staged (past the kept samples skipped)
    picked: list[int]  # the retried positions, then the new ones
    nxt: int  # the first position after the call
    end: int  # where the call would end with budget enough (see :func:`call_end`)
    cut: bool  # the budget (or a sample still held) cut the call short
    whole: bool  # the call ends at a window's start: its windows are whole


def call_end(first: int, spc: int, windows: Sequence[int], n: int) -> int:
    """Where a call that begins at ``first`` ends: after ``spc`` positions (of ``n``), or
    earlier at the start of the last window that begins within them; with no window start
    within them, at the next one, so that a call never ends inside a window (a window's
    samples are shuffled together: an end inside it would split its blocks)."""
    end = min(first + spc, n)
    if end >= n or not windows:
        return end
    k = bisect.bisect_right(windows, end) - 1
    if k >= 0 and windows[k] > first:
        return windows[k]
    return windows[k + 1] if k + 1 < len(windows) else n


def sample_sizes(samples: Sequence[Sample]) -> Callable[[int], int]:
    """Sample ``i``'s staged bytes (``samples[i].size``), read from the index without building
    the sample where the samples are an index without extra fields or a DISK column (the index's
    own sizes take the larger of a DISK value and the objects' bytes; a sample, the DISK value)."""
    if isinstance(samples, SampleIndex) and DISK not in samples.columns and not samples.extras:
        sizes = samples.sizes()
        return lambda i: int(sizes[i])
    return lambda i: samples[i].size


def field_of(samples: Sequence[Sample], i: int, j: int) -> Field:
    """Field ``j`` of sample ``i`` (``samples[i].fields[j]``), without building the sample
    where the samples are an index."""
    if isinstance(samples, SampleIndex):
        return samples.sample_field(i, j)
    return samples[i].fields[j]


def pick_call(
    order: Sequence[int],
    samples: Sequence[Sample],
    budget: Budget,
    first: int,
    spc: int,
    retried: Sequence[int],
    windows: Sequence[int],
    kept: Container[int] | None,
    mark: Callable[[int], None],
) -> Pick:
    """Take the positions from ``first`` that the next call stages after ``retried``: at most
    ``spc`` in all, within the budget, ending at a window's start where the budget cuts the
    call inside a window. Kept samples (``kept``) are marked ready with ``mark`` and skipped;
    ``budget.blocked`` tells whether the budget stopped the call before any new sample."""
    picked = list(retried)  # a retried sample still holds its budget
    size_of = sample_sizes(samples)
    in_call = {order[p] for p in picked}
    left = budget.limit - budget.reserved
    nxt, cut = first, False
    end = call_end(nxt, spc, windows, len(order))
    # a call grows to its window's end where call_end took it past spc (retries then count too)
    most = spc if end <= first + spc else len(retried) + end - first
    while nxt < end and len(picked) < most:
        idx = order[nxt]
        if kept is not None and idx in kept:
            mark(nxt)
            if len(picked) == len(retried):
                first = nxt + 1  # only kept samples so far: the unstaged part begins after them
            nxt += 1
            continue
        size = size_of(idx)
        if size > budget.limit:
            budget.check_fits(samples[idx])
        # An index still on disk from earlier in the order (padding can repeat one)
        # is staged again only once its first copy is released.
        if idx in budget.held or idx in in_call or size > left:
            cut = True
            break
        picked.append(nxt)
        in_call.add(idx)
        left -= size
        nxt += 1
    budget.blocked = cut and not picked
    whole = False
    if cut and windows:
        k = bisect.bisect_right(windows, nxt) - 1
        if k >= 0 and windows[k] > first:
            nxt, whole = windows[k], True  # what fits, less the part of a window
            picked = [p for p in picked if p < nxt]
    return Pick(first, picked, nxt, end, cut, whole)


class Scheduler:
    """Where the engine stands in the order (``next``: the first position no call took yet),
    and the positions of each next call: retries that are due first, then new positions, as
    many as the budget holds.

    Args:
        kept: indices already staged (kept from an earlier pass): marked ready, not fetched.
        windows: ascending window starts (the first 0); calls stage whole windows.
        first_call: units of the first call; each next call takes twice as many, up to
            ``samples_per_call``.
        first_workers: the most s5cmd workers of the first call (see :meth:`workers`).
    """

    def __init__(
        self,
        order: Sequence[int],
        samples: Sequence[Sample],
        budget: Budget,
        retries: Retries,
        ready: Readiness,
        stats: Stats,
        *,
        kept: Container[int] | None,
        windows: Sequence[int] | None,
        first_call: int,
        first_workers: int | None = None,
    ) -> None:
        self.order, self.samples, self.budget = order, samples, budget
        self.retries, self.ready, self.stats = retries, ready, stats
        self.kept = kept
        self.windows = list(windows or ())
        self.first_call = max(1, first_call)
        self.first_workers = first_workers
        self.next = 0

    def most_calls(self, calls_in_flight: int, running: int) -> int:
        """How many calls may run now: ``calls_in_flight``, but two until a call has ended, so
        that the first samples' call shares the link and the CPU with one more call, not with
        every call of the ramp."""
        ramp = self.stats.calls - running < 1
        return min(2, calls_in_flight) if ramp else calls_in_flight

    def workers(self, copies: int, numworkers: int, calls_in_flight: int) -> int | None:
        """The s5cmd workers of the next call (``None``: ``numworkers``, the s5cmd's own). The
        first call, with ``first_workers``, runs a worker per copy, so that the first batch
        waits for one round of requests, within the requests the calls may have in flight:
        at most ``numworkers`` x (``calls_in_flight`` - 1), beside the one more call the ramp
        runs, and at most ``first_workers``; never fewer than ``numworkers``."""
        if self.stats.calls or not self.first_workers:
            return None
        wide = min(copies, numworkers * (calls_in_flight - 1), self.first_workers)
        return max(numworkers, wide)

    def call_size(self, samples_per_call: int) -> int:
        """The most units the next call may take: ``first_call``, doubled per call started."""
        return min(samples_per_call, self.first_call << min(self.stats.calls, 20))

    def next_call(self, spc: int, calls: Sized) -> list[int] | None:
        """The positions of the next call (of at most ``spc`` units), their bytes reserved in
        the budget; ``None`` when no call should start now: nothing is left to
        take, nothing fits, or the call the budget allows is worth waiting on releases for
        (``calls``: those in flight)."""
        order, budget = self.order, self.budget
        while True:
            retried, before = self.retries.take_due(time.monotonic(), spc), self.next
            pick = pick_call(
                order, self.samples, budget, self.next, spc, retried, self.windows, self.kept, self.ready.mark
            )
            self.next, picked = pick.first, pick.picked
            if not picked:
                if before < self.next < len(order):
                    continue  # a call's worth of kept units (staged already): pick after them now
                return None
            if pick.cut and not retried and not pick.whole:
                if self.windows and budget.reserved:
                    return None  # wait for releases rather than split a window that the budget holds
                if budget.put_off(len(picked) - len(retried), pick.end - self.next, calls, self.ready):
                    return None  # wait for releases rather than start a sliver of a call
            if retried:
                self.retries.started(retried)
            size_of = sample_sizes(self.samples)
            with budget.cond:  # the engine's one lock
                for pos in picked[len(retried) :]:
                    budget.reserve(order[pos], size_of(order[pos]))
            self.next = pick.nxt
            self.stats.peak_reserved = max(self.stats.peak_reserved, budget.reserved)
            return picked
