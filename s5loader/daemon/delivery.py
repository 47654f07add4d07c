"""The daemon's delivery side: a staged sample renamed into the cache as ``SEQUENCE-KEY/``
with its key and epoch files, one state write per delivery (so a restart completes a rename cut short),
skips, the ``END`` marker, and the watch for a consumer that waits on the source."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .._index.sample import Sample
from ..engine import Stager
from ..staging.area import StagingArea
from .epochcache import DaemonEpochCache
from .progress import ProgressReporter
from .protocol import END_MARKER, EPOCH_FILE, KEY_FILE, sample_folder_name
from .shards import Unpacker
from .state import DaemonState, Ledger, write_end

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
    """Hands staged samples over to the consumer, in order, and records each in the state."""

    def __init__(
        self, cache: str, state_path: str, state: DaemonState, ledger: Ledger, summary: Summary,
        view: Sequence[Sample], area: StagingArea, unpacker: Unpacker | None,
        keeper: DaemonEpochCache | None = None,
    ) -> None:
        self.cache, self.state_path, self.state, self.ledger = cache, state_path, state, ledger
        self.summary, self.view, self.area, self.unpacker = summary, view, area, unpacker
        self._key_clash_warned = False
        self.keeper = keeper  # the epoch cache (--epoch-cache), which keeps samples as they are delivered

    def deliver(self, seq: int, stager: Stager) -> None:
        st, sample = self.state, self.view[seq]
        if self.unpacker is not None:
            src, key, size = self.unpacker.unpack(seq)
        else:
            src, key, size = self.area.sample_dir(seq), sample.key, sample.size
        name = sample_folder_name(seq, key)
        dst = os.path.join(self.cache, name)
        hit = self.keeper.delivering(seq, src) if self.keeper is not None else 0
        self._write_key(src, key)
        self._write_control(src, EPOCH_FILE, str(seq // max(1, st.samples)))
        # the one write of this delivery: a restart completes the rename if it did not happen
        st.delivered, st.pending = seq + 1, {"seq": seq, "from": src, "to": dst}
        st.save(self.state_path)
        os.rename(src, dst)  # the sample appears complete, or not at all
        self.ledger.add(seq, name, size)
        if self.unpacker is not None:
            stager.hold(-seq - 1, size)
        elif hit:
            stager.hold(seq, hit)  # a hit was never reserved: held from now as delivered
        else:
            stager.yielded(seq)
        self.summary.delivered += 1

    def _write_key(self, folder: str, key: str) -> None:
        """The sample's full key into its folder, before the folder is renamed into place (a
        control file of a few bytes, not counted in the budget)."""
        if not self._write_control(folder, KEY_FILE, key) and not self._key_clash_warned:
            self._key_clash_warned = True
            log.warning("sample %r has a field named %s; its folders carry no %s file", key, KEY_FILE, KEY_FILE)

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

    def skip(self, seq: int) -> None:
        if self.keeper is not None:
            self.keeper.passed(seq)
        st = self.state
        st.delivered, st.skipped, st.pending = seq + 1, st.skipped + 1, None
        st.save(self.state_path)
        self.summary.skipped += 1
        self.summary.skipped_uris.append(self.view[seq].fields[0].uri)

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

    def check(self, seq: int, state: DaemonState, consumed_now: Callable[[], int], reporter: ProgressReporter) -> None:
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
                self.summary.resumed_from, consumed, seq,
            )
            return
        now = time.monotonic()
        if now - self.last_log > 30:
            self.last_log = now
            log.warning(
                "starved: the consumer has consumed all %d delivered samples and waits for sample "
                "%d (%d starvation(s) so far); the source or the network is the bottleneck",
                consumed, seq, self.summary.starved,
            )
