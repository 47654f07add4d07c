"""Live figures of a staging pass (:class:`Metrics`), cheap enough to read every training step.

The engine's thread keeps plain counters where events happen (a call starts, an object lands,
a sample is retried or skipped) and a small ring of (time, bytes, samples) points for the
rates; a reader in another thread takes a snapshot of them with one clock read and no lock.
Each figure is read once, so a snapshot can be a few events apart between figures (a sample
counted as fetched a moment before it counts as ready), never torn within one.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Any

#: Seconds the rates (MB/s, samples/s) are measured over.
RATE_WINDOW_S = 5.0
_POINT_EVERY_S = 0.25  # at most one ring point per quarter second
_POINTS = 64  # 16 s of points: more than the window


@dataclass(frozen=True)
class Metrics:
    """A snapshot of a staging pass, from :meth:`S5Sampler.metrics <s5loader.S5Sampler.metrics>`
    (the prefetch daemon's ``--json-log`` writes the same fields).

    Attributes:
        epoch: the epoch of the pass.
        position: samples of the pass handed to the loader so far (skipped ones included).
        samples: samples in the pass.
        staged_bytes: bytes counted against the budget now: staged and not yet released,
            or reserved for the calls in flight.
        budget: the byte budget.
        ready_ahead: samples staged and not yet handed to the loader.
        calls_in_flight: ``s5cmd run`` processes running.
        objects_in_flight: objects of those calls not yet staged (s5cmd sends up to
            ``numworkers`` requests of them at once).
        mb_s: megabytes (10^6 bytes) staged per second over the last few seconds.
        samples_s: samples staged per second over the last few seconds.
        waited_s: seconds the loader waited for staging in this pass (starvation, the wait
            for the first sample included; a wait under way counts up to now).
        retries: sample retries so far in the pass.
        skips: samples skipped (``on_error="skip"``) so far in the pass.
        fetched_bytes: bytes staged in the pass so far.
        fetched_samples: samples staged in the pass so far.
    """

    epoch: int = 0
    position: int = 0
    samples: int = 0
    staged_bytes: int = 0
    budget: int = 0
    ready_ahead: int = 0
    calls_in_flight: int = 0
    objects_in_flight: int = 0
    mb_s: float = 0.0
    samples_s: float = 0.0
    waited_s: float = 0.0
    retries: int = 0
    skips: int = 0
    fetched_bytes: int = 0
    fetched_samples: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict (for JSON, or a logger's ``add_scalars``)."""
        return {name: getattr(self, name) for name in _FIELDS}


_FIELDS = tuple(f.name for f in dataclasses.fields(Metrics))


class Throughput:
    """A ring of (time, bytes, samples) points added by the engine as samples land; the rates
    are measured from the newest point at least :data:`RATE_WINDOW_S` old (or the oldest
    point) to now, so they fall to zero when staging stops."""

    def __init__(self, now: float) -> None:
        self.points: collections.deque[tuple[float, int, int]] = collections.deque([(now, 0, 0)], maxlen=_POINTS)

    def add(self, now: float, nbytes: int, nsamples: int) -> None:
        if now - self.points[-1][0] >= _POINT_EVERY_S:
            self.points.append((now, nbytes, nsamples))

    def rates(self, now: float, nbytes: int, nsamples: int) -> tuple[float, float]:
        """(MB/s, samples/s) from the points up to ``now``, when the counts are these."""
        points = tuple(self.points)  # one copy under the GIL: the engine may append meanwhile
        base = points[0]
        for p in points:
            if p[0] > now - RATE_WINDOW_S:
                break
            base = p
        dt = now - base[0]
        if dt <= 0:
            return 0.0, 0.0
        return (nbytes - base[1]) / dt / 1e6, (nsamples - base[2]) / dt
