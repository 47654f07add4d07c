"""Live figures of a staging pass (:class:`Metrics`), cheap enough to read every training step.

The engine's thread keeps plain counters where events happen (a call starts, an object lands,
a sample is retried or skipped) and a small ring of (time, bytes, samples) points for the
rates; a reader in another thread takes a snapshot of them with one clock read and no lock.
Each figure is read once, so a snapshot can be a few events apart between figures (a sample
counted as fetched a moment before it counts as ready), never torn within one.

At the end of a pass, :class:`PassReport` logs what it did, and "data starvation" when the
loader waited for staging.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._util.uri import format_size
from ..config import StagingOptions
from .stats import Stats

if TYPE_CHECKING:
    from .budget import Budget
    from .ready import Readiness

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
        fetched_units: what the pass staged so far, in the units it stages: samples over raw
            objects, tar shards over shards (a shard staged twice in a pass counts twice).
        get_requests, head_requests, list_requests: S3 requests of each kind s5loader asked
            for in the pass so far, counted from what it asks s5cmd and boto3 for, not at the
            store: each ``cp --raw`` line costs s5cmd 2.3.0 a HEAD and a GET (a GET per 50 MiB
            part), a wildcard line a LIST (per 1,000 keys) and a GET per object, a fetch with
            boto3 its own (a HEAD and a GET per 8 MiB part for a key no command file can carry,
            a GET per connection for a tar shard read while it downloads). A retried sample is
            counted again. The listing and the GETs of a sample read directly (one that was not
            staged) are not counted.
        epoch_cache_hits: units of the pass read from the epoch cache (not fetched) so far:
            samples over raw objects, tar shards over shards.
        epoch_cache_bytes: bytes this rank holds in the epoch cache now (kept for a later epoch,
            or taken from it into the pass and not yet read).
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
    fetched_units: int = 0
    get_requests: int = 0
    head_requests: int = 0
    list_requests: int = 0
    epoch_cache_hits: int = 0
    epoch_cache_bytes: int = 0

    @property
    def fetched_samples(self) -> int:
        """Deprecated (removed in the next release): :attr:`fetched_units`, which it always was;
        over tar shards it counts shards, not samples."""
        warnings.warn(
            "Metrics.fetched_samples is deprecated: it counts what was staged, which over tar shards is "
            "shards; use Metrics.fetched_units",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.fetched_units

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict (for JSON, or a logger's ``add_scalars``); for one more release
        also ``fetched_samples``, the old name of ``fetched_units``."""
        return {**{name: getattr(self, name) for name in _FIELDS}, "fetched_samples": self.fetched_units}


_FIELDS = tuple(f.name for f in dataclasses.fields(Metrics))


class Throughput:
    """A ring of (time, bytes, samples) points added by the engine as samples land; the rates
    are measured from the newest point at least :data:`RATE_WINDOW_S` old (or the oldest
    point) to now, so they fall to zero when staging stops."""

    def __init__(self, now: float) -> None:
        self.points: collections.deque[tuple[float, int, int]] = collections.deque(
            [(now, 0, 0)], maxlen=_POINTS
        )

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


def snapshot(
    now: float,
    stats: Stats,
    ready: Readiness,
    budget: Budget,
    throughput: Throughput,
    *,
    epoch: int,
    position: int,
    samples: int,
    waited_s: float | None,
    calls: int,
    objects: int,
) -> Metrics:
    """The :class:`Metrics` of a pass at ``now`` from the engine's counters, read once each
    and without its lock; ``calls`` and ``objects`` are those in flight (0 once it stopped)."""
    fetched, staged = stats.staged_bytes, stats.staged_units
    mb_s, samples_s = throughput.rates(now, fetched, staged)
    if waited_s is None:
        since = ready.consumer_waiting
        waited_s = stats.wait_s + (now - since if since else 0.0)
    return Metrics(
        epoch=epoch,
        position=position,
        samples=samples,
        staged_bytes=budget.reserved,
        budget=budget.limit,
        ready_ahead=max(0, ready.n_ready - ready.n_taken),
        calls_in_flight=calls,
        objects_in_flight=max(0, objects),
        mb_s=round(mb_s, 3),
        samples_s=round(samples_s, 3),
        waited_s=round(waited_s, 3),
        retries=stats.retries,
        skips=len(stats.skipped),
        fetched_bytes=fetched,
        fetched_units=staged,
        get_requests=stats.requests["GET"],
        head_requests=stats.requests["HEAD"],
        list_requests=stats.requests["LIST"],
    )


# "data starvation" is a WARNING only when waiting takes this share of an epoch, in a run
# (all passes of the sampler so far) at least this long; a short run is not worth tuning.
_STARVED_SHARE = 0.2
_STARVED_MIN_RUN_S = 60.0


class PassReport:
    """The log line at the end of each staging pass: what it staged, and "data starvation"
    (a WARNING with advice) when the loader waited for staging a large share of a long run."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log  # the sampler's: users filter its lines by its name
        self.run_s = 0.0  # seconds of all passes so far

    def report(
        self, stats: Stats, elapsed: float, finished: bool, epoch: int, options: StagingOptions
    ) -> None:
        starved = stats.wait_s - stats.first_wait_s
        msg = (
            "epoch %d%s: %d samples, %s staged in %d calls (%d retried, %d skipped) in %.1fs; "
            "waited %.2fs for staging (%.2fs before the first sample)"
        )
        args = (
            epoch,
            "" if finished else " (stopped early)",
            stats.staged_units,
            format_size(stats.staged_bytes),
            stats.calls,
            stats.retries,
            len(stats.skipped),
            elapsed,
            stats.wait_s,
            stats.first_wait_s,
        )
        if stats.skipped:
            self.log.warning(
                "epoch %d: skipped %d sample(s) that could not be fetched (on_error='skip'): %s%s",
                epoch,
                len(stats.skipped),
                ", ".join(stats.skipped[:10]),
                " ..." if len(stats.skipped) > 10 else "",
            )
        if stats.plain_indices:
            self.log.warning(
                "epoch %d: %d sample(s) reached the dataset as plain ints instead of the StagedIndex "
                "the sampler yielded (a wrapper called int() on them): each was fetched again and its "
                "staged files left to hold the budget; pass the sampler's indices through unchanged",
                epoch,
                stats.plain_indices,
            )
        self.run_s += elapsed
        if self.run_s >= _STARVED_MIN_RUN_S and elapsed > 0 and starved >= _STARVED_SHARE * elapsed:
            o = options
            self.log.warning(
                "data starvation: " + msg + "; the loader waited %.0f%% of the epoch after its first "
                "sample. To stage faster: a larger calls_in_flight (now %d), a larger "
                "samples_per_call (now %d), shuffle='block' (one request per block of samples), or a "
                "larger budget (now %s)",
                *args,
                100 * starved / elapsed,
                o.calls_in_flight,
                o.samples_per_call,
                format_size(o.budget),
            )
        else:
            self.log.info(msg, *args)
