"""The byte budget of one staging pass: what is reserved for calls and held by consumers,
how releases come back (events from the pass's FIFO, or a folder check), and the guard that
turns a budget too small for the consumer's batch into an error instead of a hang."""

from __future__ import annotations

import logging
import selectors
import threading
import time
from collections.abc import Callable, Sized

from .._index.sample import Sample
from .._staging.release_events import ReleaseEvents
from .._util.uri import format_size
from ..exceptions import BudgetError
from .ready import Readiness

log = logging.getLogger(__name__)

# Without release events: how soon a blocked budget looks for releases again, at first and at
# most (the longest a consumer's release can wait to be seen after a long idle spell).
_POLL_MIN, _POLL_MAX = 0.005, 0.25
# A call the budget cuts short waits until this share of the budget is free (a low-water mark),
# while the consumer released something within the last _PATIENCE_S seconds.
_LOW_WATER = 0.25
_PATIENCE_S = 2.0


def check_sample_fits(sample: Sample, budget: int, fix: str = "raise the budget") -> None:
    """The one check that a sample fits the budget at all, for the sampler, the daemon and the
    engine.

    Raises:
        BudgetError: naming the sample, its first URIs, both sizes and ``fix``.
    """
    if sample.size > budget:
        raise BudgetError(
            f"sample {sample.key!r} ({', '.join(f.uri for f in sample.fields[:3])}) is "
            f"{format_size(sample.size)}, larger than the budget of {format_size(budget)}; {fix}"
        )


class Budget:
    """Bytes reserved for staged (or staging) samples, at most ``limit`` for new calls.

    ``held`` maps a sample index to the bytes it holds until released; ``handed_out`` the
    indices a consumer has (and will release). Changes happen under ``cond``, the engine's
    lock, which consumers take too.
    """

    def __init__(
        self,
        limit: int,
        cond: threading.Condition,
        is_released: Callable[[int], bool],
        events: ReleaseEvents | None,
    ) -> None:
        self.limit = limit
        self.cond = cond
        self.is_released = is_released
        self.events = events
        self.held: dict[int, int] = {}
        self.handed_out: dict[int, int] = {}
        self.reserved = 0
        self.blocked = False  # the next sample does not fit: staging waits for releases
        self.last_release = time.monotonic()
        self._last_poll = 0.0
        # Without release events, a blocked budget looks for releases often at first, then
        # less and less while none comes (a daemon's consumer may be away for hours).
        self.idle_interval = _POLL_MIN
        # Told the indices that consumers released, before their bytes come back (the epoch
        # cache keeps or deletes what readers handed back), in the engine's thread.
        self.on_release: Callable[[list[int]], None] | None = None
        self.onward: dict[int, tuple[int, int]] = {}  # see hand_on

    def listen(self, sel: selectors.BaseSelector, where: str) -> None:
        """Have the engine's selector wake on release events; on a file system without FIFOs
        (in ``where``), look for released samples instead."""
        events = self.events
        if events is None:
            return
        try:
            sel.register(events.open().fileno(), selectors.EVENT_READ, None)
        except OSError as exc:
            log.debug("no release FIFO in %s (%s); polling for released samples", where, exc)
            events.close()
            self.events = None

    def put_off(self, new: int, want: int, calls: Sized, ready: Readiness) -> bool:
        """Whether a call the budget cut short, to ``new`` of the ``want`` samples it could take,
        waits for releases instead of starting now (it then counts as blocked, so releases are
        looked for as when nothing fits).

        While another call is in flight, a call of less than half its samples waits. Otherwise,
        while less than a quarter of the budget is free, the call waits for the consumer to
        free that much (each s5cmd process costs a start and its bookkeeping: a slow consumer
        that frees one sample at a time would otherwise get one process per sample), unless
        nothing would free it: nothing held, a consumer waiting in :meth:`Stager.wait
        <s5loader._engine.stager.Stager.wait>` for a sample not staged, or no release for
        :data:`_PATIENCE_S` seconds (a consumer that needs more samples than it has before it
        frees any).
        """
        if len(calls):
            return new < max(1, want // 2)
        # a waiting consumer that holds nothing of its own (the prefetch daemon's delivery waits
        # ahead of the daemon's consumer, whose deliveries hold the budget: no reason to hurry)
        waiting = ready.consumer_waiting and not self.held_elsewhere()
        if not self.reserved or waiting or self.limit - self.reserved >= self.limit * _LOW_WATER:
            return False
        if time.monotonic() - self.last_release >= _PATIENCE_S:
            return False
        self.blocked = True
        return True

    def held_elsewhere(self) -> bool:
        """Whether a consumer with a protocol of its own holds any of the budget (negative keys:
        the prefetch daemon's deliveries)."""
        with self.cond:
            return any(k < 0 for k in self.handed_out)

    def check_fits(self, sample: Sample) -> None:
        """Raise :class:`BudgetError` for a sample that can never fit."""
        check_sample_fits(sample, self.limit)

    def reserve(self, idx: int, size: int) -> None:
        """Hold ``size`` bytes for sample ``idx`` until it is released (call under ``cond``)."""
        self.held[idx] = size
        self.reserved += size

    def hold_on_disk(self, idx: int, size: int) -> None:
        """Count ``size`` bytes already on disk for ``idx``, handed out, until released."""
        with self.cond:
            self.reserve(idx, size)
            self.handed_out[idx] = size

    def hand_out(self, idx: int) -> None:
        with self.cond:
            self.handed_out[idx] = self.held.get(idx, 0)

    def free(self, idx: int) -> None:
        """Give back what ``idx`` holds (call under ``cond``); a sample handed on (see
        :meth:`hand_on`) is held under its new key instead."""
        onward = self.onward.pop(idx, None)
        if onward is None:
            self.reserved -= self.held.pop(idx, 0)
            return
        key, size = onward
        self.reserved += size - self.held.pop(idx, 0)
        self.held[key] = self.handed_out[key] = size

    def hand_on(self, idx: int, key: int, size: int) -> None:
        """When ``idx`` is released, hold ``size`` bytes under ``key`` instead of freeing it: a
        consumer that moves a staged sample elsewhere and keeps it (the prefetch daemon's
        delivery), counted with no gap and no overlap; ``key`` is released as
        :attr:`is_released` says."""
        with self.cond:
            self.onward[idx] = (key, size)

    def add(self, extra: int) -> None:
        with self.cond:
            self.reserved += extra

    def poll(self) -> None:
        """Free what consumers released without an event (a stat per handed-out sample).

        Without release events: often while the budget blocks staging, rarely otherwise.
        With them, only a safety net for consumers that delete folders without announcing
        it: once a second, while blocked; and as often as without them for what nobody
        announces (negative keys: a prefetch daemon's deliveries, which its consumer deletes).
        """
        now = time.monotonic()
        if not self.handed_out:
            return
        due = now - self._last_poll >= (self.idle_interval if self.blocked else 0.05)
        if not due:
            return
        with self.cond:
            if self.events is None or (self.blocked and now - self._last_poll >= 1.0):
                candidates = list(self.handed_out)
            else:
                candidates = [k for k in self.handed_out if k < 0]
        if not candidates:
            return
        self._last_poll = now
        freed = []
        for idx in candidates:
            if self.is_released(idx):
                freed.append(idx)
        if freed:
            if self.on_release is not None:
                self.on_release(freed)
            with self.cond:
                for idx in freed:
                    self.handed_out.pop(idx, None)
                    self.free(idx)
            self.last_release = time.monotonic()
            self.idle_interval = _POLL_MIN
        elif self.blocked:
            self.idle_interval = min(self.idle_interval * 2, _POLL_MAX)

    def on_events(self) -> None:
        """Free the samples announced on the release FIFO."""
        assert self.events is not None
        # An index counts only while handed out and its folder is gone: an announcement that
        # comes after the safety net freed the sample cannot free a later copy of it.
        released = [idx for idx in self.events.read() if idx in self.handed_out and self.is_released(idx)]
        if self.events.freed:
            self.give_back(self.events.freed)
            self.events.freed = {}
        if released:
            if self.on_release is not None:
                self.on_release(released)
            with self.cond:
                for idx in released:
                    if self.handed_out.pop(idx, None) is not None:
                        self.free(idx)
            self.last_release = time.monotonic()

    def give_back(self, freed: dict[int, int]) -> None:
        """Count less for handed-out units whose readers freed part of them (a tar shard's
        samples read, see :meth:`StagingLayout.release_shard_sample
        <s5loader._staging.layout.StagingLayout.release_shard_sample>`): ``freed`` bytes per index."""
        with self.cond:
            for idx, n in freed.items():
                held = self.held.get(idx)
                if held is not None and idx in self.handed_out:
                    n = min(n, held)
                    self.held[idx] = held - n
                    self.handed_out[idx] = held - n
                    self.reserved -= n
        self.last_release = time.monotonic()

    def check_deadlock(self, consumer_waiting: float, limit: float) -> None:
        """A consumer waiting for a sample that cannot be staged because the budget is held by
        samples the consumer already has but never released: the budget is smaller than what
        the DataLoader holds at once (a batch, plus its prefetch)."""
        now = time.monotonic()
        if self.held_elsewhere():
            return  # what a consumer of its own holds (the daemon's deliveries): it frees them as it goes
        if now - consumer_waiting < limit or now - self.last_release < limit:
            return
        raise BudgetError(
            f"the budget of {format_size(self.limit)} is full with "
            f"{len(self.handed_out)} samples handed out but not read for {limit:g}s; it must "
            "hold at least one batch (plus the DataLoader's prefetch): raise the budget or "
            "lower batch_size"
        )
