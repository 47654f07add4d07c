"""The daemon's delivery side: a staged sample renamed into the cache as ``SEQUENCE-KEY/``
with its key and epoch files, one state write per delivery (so a restart completes a rename cut short),
skips, the ``END`` marker, and the watch for a consumer that waits on the source."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .._sampling.units import units_of
from .._staging.layout import StagingLayout
from .._util.uri import format_size
from ..dataset import S5Dataset, StagedIndex
from .cache_state import DaemonState, Ledger, write_end
from .protocol import END_MARKER, EPOCH_FILE, KEY_FILE, sample_folder_name
from .reporting import ProgressReporter
from .stream import DaemonStream

UNPACK_DIR = ".u"  # a tar shard's samples written out of it, below the staging root
# How long a consumer may hold a full delivery window (over tar shards) before it is warned.
HELD_WARN_S = 30.0


def keep_linked(folder: str, dest: str) -> None:
    """Hard-link the files below ``folder`` into ``dest`` (made anew; no bytes copied)."""
    for root, _, files in os.walk(folder):
        out = os.path.join(dest, os.path.relpath(root, folder))
        os.makedirs(out, exist_ok=True)
        for f in files:
            os.link(os.path.join(root, f), os.path.join(out, f))


log = logging.getLogger(__name__)


@dataclass
class Summary:
    """What one run of the daemon did."""

    delivered: int = 0
    skipped: int = 0
    total: int = 0
    resumed_from: int = 0
    stopped: bool = False
    starved: int = 0
    starved_s: float = 0.0
    skipped_uris: list[str] = field(default_factory=list)


class Deliveries:
    """Hands staged samples over to the consumer, in order, and records each in the state.

    Args:
        cache: the cache directory.
        state_path: the state file (written once per delivery).
        state: the daemon's state.
        ledger: the delivered samples the consumer has not deleted.
        summary: what this run did.
        dataset: the data set delivered.
        stream: the staging run (holds what the consumer holds, in its budget).
    """

    def __init__(
        self,
        cache: str,
        state_path: str,
        state: DaemonState,
        ledger: Ledger,
        summary: Summary,
        dataset: S5Dataset,
        stream: DaemonStream,
    ) -> None:
        self.cache, self.state_path, self.state, self.ledger = cache, state_path, state, ledger
        self.summary, self.dataset, self.stream = summary, dataset, stream
        self.units = units_of(dataset)
        self.scratch = os.path.join(stream.run.area.root, UNPACK_DIR)
        self._key_clash_warned = False
        self.hits: dict[int, int] = {}  # delivered epoch cache hits the consumer holds: seq -> bytes
        self.hit_count: dict[int, int] = {}  # epoch -> hits delivered
        self.fetched: dict[int, int] = {}  # epoch -> bytes delivered that came from S3

    def deliver(self, seq: int, staged: StagedIndex) -> int:
        """Rename sample ``seq`` (staged as ``staged``) into the cache as ``SEQUENCE-KEY/``;
        returns its bytes."""
        st = self.state
        epoch = seq // max(1, st.samples)
        cache = self.stream.run.cache
        hit = cache is not None and self.units.unit_of(staged) in cache.taken
        lifted = self.units.lift(staged, os.path.join(self.scratch, str(seq)))
        name = sample_folder_name(seq, lifted.key)
        dst = os.path.join(self.cache, name)
        if staged.back and not lifted.fresh:
            # kept for the next epoch: its files linked into the pass's hand-back folder (no copy),
            # which the engine admits into the epoch cache once it sees the sample gone
            keep_linked(lifted.folder, StagingLayout(staged.folder).handed_back(staged))
        self._write_key(lifted.folder, lifted.key)
        self._write_control(lifted.folder, EPOCH_FILE, str(epoch))
        # the one write of this delivery: a restart completes the rename if it did not happen
        st.delivered, st.pending = seq + 1, {"seq": seq, "from": lifted.folder, "to": dst}
        st.save(self.state_path)
        if not lifted.fresh:  # counted from the release on as the consumer's, with no gap
            self.stream.hand_on(staged, seq, lifted.size)
        os.rename(lifted.folder, dst)  # the sample appears complete, or not at all
        self.ledger.add(seq, name, lifted.size)
        if not lifted.fresh:  # (a copy written out of a shard counts in the delivery window)
            StagingLayout(staged.folder).notify(staged)  # the staged folder is gone
        if hit:
            self.hits[seq] = lifted.size
            self.hit_count[epoch] = self.hit_count.get(epoch, 0) + 1
        else:
            self.fetched[epoch] = self.fetched.get(epoch, 0) + lifted.size
        self.summary.delivered += 1
        return lifted.size

    def await_window(
        self, window: int, estimate: int, budget: int, stop: threading.Event, tick: Callable[[], None]
    ) -> bool | None:
        """Over tar shards: wait until the samples written out that the consumer holds leave
        room for one more (of about ``estimate`` bytes) within the delivery ``window`` (True),
        or ``budget`` has room for it beside the shards open (False: it counts there, see
        :meth:`DaemonStream.room_for <s5loader._daemon.stream.DaemonStream.room_for>`);
        None if the daemon stops meanwhile. A consumer that holds more than the window while the
        open shards fill the budget is told so once it has waited :data:`HELD_WARN_S`."""
        ledger, stream = self.ledger, self.stream
        wait, since = 0.002, time.monotonic()
        while ledger.count and ledger.held - stream.beyond_held(ledger.is_released) + estimate > window:
            if stream.room_for(estimate, ledger.held, budget):
                return False
            if stop.wait(wait):
                return None
            ledger.refresh(force=True)
            tick()
            wait = min(2 * wait, 0.05)
            if since and time.monotonic() - since > HELD_WARN_S:
                since = 0.0
                log.warning(
                    "the consumer of %s holds %d delivered samples (%s) and deletes none: the daemon "
                    "waits, as over tar shards what it holds beside the shards open must fit in the "
                    "budget; delete each sample once it is used, or raise --budget",
                    self.cache,
                    ledger.count,
                    format_size(ledger.held),
                )
        return True

    def epoch_figures(self, epoch: int) -> dict[str, int]:
        """The epoch cache's figures of ``epoch``, for the JSON log: samples delivered from the
        cache, bytes it holds, bytes delivered from S3, and the delivered hits the consumer
        still holds (counted in ``cache_bytes`` beside the budget): those the engine still
        counts, which it stops counting a moment after the consumer deleted them."""
        stager = self.stream.run.passes.active
        counted: set[int] = set()
        if stager is not None:  # held under the delivery's key, or still under the staged index
            with stager.budget.cond:
                counted = {*stager.budget.held, *(key for key, _ in stager.budget.onward.values())}
        released = self.ledger.is_released
        self.hits = {seq: n for seq, n in self.hits.items() if not released(seq) or -seq - 1 in counted}
        cache = self.stream.run.cache
        return {
            "epoch_cache_hits": self.hit_count.get(epoch, 0),
            "epoch_cache_bytes": cache.held if cache is not None else 0,
            "epoch_fetched_bytes": self.fetched.get(epoch, 0),
            "epoch_hit_bytes": sum(self.hits.values()),
        }

    def _write_key(self, folder: str, key: str) -> None:
        """The sample's full key into its folder, before the folder is renamed into place (a
        control file of a few bytes, not counted in the budget)."""
        if not self._write_control(folder, KEY_FILE, key) and not self._key_clash_warned:
            self._key_clash_warned = True
            log.warning(
                "sample %r has a field named %s; its folders carry no %s file", key, KEY_FILE, KEY_FILE
            )

    @staticmethod
    def _write_control(folder: str, name: str, text: str) -> bool:
        """A control file into a sample's folder; False when a field of the sample has its name
        (the field stays)."""
        path = os.path.join(folder, name)
        if os.path.lexists(path):
            return False
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:  # a tar name's own bytes
            f.write(text)
        return True

    def skip(self, seq: int, index: int) -> None:
        """Sample ``seq`` (index ``index``) could not be fetched and is skipped (``on_error="skip"``)."""
        st = self.state
        st.delivered, st.skipped, st.pending = seq + 1, st.skipped + 1, None
        st.save(self.state_path)
        self.summary.skipped += 1
        self.summary.skipped_uris.append(self.dataset.samples[self.units.unit_of(index)].fields[0].uri)

    def finish(self) -> None:
        write_end(self.cache, self.state)
        log.info("all %d samples delivered to %s; wrote %s", self.state.delivered, self.cache, END_MARKER)

    def consumed(self) -> int:
        st = self.state
        return st.delivered - st.skipped - self.ledger.count


class StarvationWatch:
    """Notices a consumer that has used up every delivered sample and waits for the next: an
    event each time, a WARNING at most every 30 s (an INFO while catching up after a restart),
    and the seconds it waited in the summary."""

    def __init__(self, ledger: Ledger, summary: Summary, samples_per_call: int) -> None:
        self.ledger, self.summary, self.samples_per_call = ledger, summary, samples_per_call
        self.since = 0.0  # when the current starvation began; 0: none
        self.last_log = 0.0
        self.last_check = 0.0

    def waiting_s(self) -> float:
        return time.monotonic() - self.since if self.since else 0.0

    def fed(self) -> None:
        """A sample was delivered: a starvation in progress ends."""
        if self.since:
            self.summary.starved_s += time.monotonic() - self.since
            self.since = 0.0

    def check(
        self, seq: int, state: DaemonState, consumed_now: Callable[[], int], reporter: ProgressReporter
    ) -> None:
        self.last_check = time.monotonic()
        self.ledger.refresh(force=True)
        if self.ledger.count or state.delivered - state.skipped == 0 or self.since:
            return
        self.since = time.monotonic()
        self.summary.starved += 1
        consumed = consumed_now()
        # Right after a restart the consumer has used up what the last run delivered while this
        # run's first s5cmd call is under way: an ordinary restart, not a slow source.
        catching_up = bool(self.summary.resumed_from) and self.summary.delivered < self.samples_per_call
        reporter.event("starved", seq=seq, consumed=consumed, catching_up=catching_up)
        if catching_up:
            log.info(
                "catching up after a restart at sample %d: the consumer has consumed the samples "
                "delivered before it (%d in all) and waits for sample %d, which this run is fetching",
                self.summary.resumed_from,
                consumed,
                seq,
            )
            return
        now = time.monotonic()
        if now - self.last_log > 30:
            self.last_log = now
            log.warning(
                "starved: the consumer has consumed all %d delivered samples and waits for sample "
                "%d (%d starvation(s) so far); the source or the network is the bottleneck",
                consumed,
                seq,
                self.summary.starved,
            )
