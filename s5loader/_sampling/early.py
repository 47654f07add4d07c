"""Samples handed to the DataLoader before they are staged, so that a batch waits only for
its own samples.

A DataLoader takes ``prefetch_factor x num_workers`` batches of indices from its sampler before
it hands out its first batch (256 samples at batch 32 and 4 workers), and the indices of one
more batch before it hands out each next one. A sampler that yields an index only once its
sample is staged makes the first batch wait for the whole first fill, and every batch, while
staging is behind, for one a fill further on. So a pass that a DataLoader iterates hands out an
index whose sample is not staged yet at once (at most :data:`EARLY_MOST` of them unsettled),
and a reader of such a sample waits for it (:func:`~s5loader._staging.words.ask`; a DataLoader
worker asks for a batch's at once, :func:`~s5loader._staging.words.announce`).
Indices still go out in order, and a sample staged already goes out as it is; so does every
sample of a pass iterated directly, whose consumer may expect its files in place.

A thread in the sampler's process waits on the engine for those samples, in order, as the
sampler waits for any other (so the time counts as the loader's wait, and a budget too small
for what the readers hold is found), and gives its word on each to the pass's
:class:`~s5loader._staging.words.WordServer`, which answers the sample's reader in the
loader's one channel: staged (the sample is then handed to its reader, whose release frees its
budget as for any other), not staged (the pass stopped first, replaced by a newer one or
closed: the reader raises, as the sampler's own wait does; a DataLoader drops what its workers
read for an iterator it replaced), or the engine's error, which the reader raises as the
sampler does. So no reader waits for a sample that will not come: an object that cannot be
fetched, a stall past ``stall_timeout`` and a budget that cannot hold the DataLoader's batches
end as they do for the sampler, and a reader whose sampler's process ended sees its connection
close.

A pass folder that someone else removes takes the socket with it: a waiting reader is told so,
reads what is staged of its sample or fetches it directly, and from then on the pass hands out
samples once staged.

Only with ``on_error="raise"``: a sample skipped under ``"skip"`` must be left out of the
epoch, which an index already handed out cannot be. Not with ``keep_staged`` either (every pass
stages into one folder, whose words would outlive their pass).
"""

from __future__ import annotations

import collections
import logging
import threading

from .._engine import Stager
from .._engine.ready import READY, WAITING
from .._staging.words import WordServer
from ..config import StagingOptions

log = logging.getLogger(__name__)


class Early:
    """What a pass's units answer for a sample handed out before it was staged: true, as for
    any sample handed out (see ``PassUnits.take``)."""

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "EARLY"


EARLY = Early()

#: The most samples handed out before they are staged and not settled yet; past them the
#: sampler waits (a DataLoader's first fill at batch 256, 16 workers and ``prefetch_factor`` 2 is
#: 8192 samples).
EARLY_MOST = 8192


class EarlyHandOut:
    """The samples of one pass handed out before they were staged, and the thread that tells
    their readers what became of them. :meth:`close` is safe to call twice."""

    def __init__(self, stager: Stager) -> None:
        self.stager = stager
        self.server: WordServer | None = None  # made when the first sample goes out early
        self.cond = threading.Condition()
        self.pending: collections.deque[tuple[int, int]] = collections.deque()  # (position, index)
        self.ending = False  # no more samples come: the thread ends once they are settled
        self.stopped = False  # the pass stops: what is not settled is marked not staged
        self._thread: threading.Thread | None = None

    def take(self, pos: int, idx: int) -> bool:
        """Hand out position ``pos`` (sample ``idx``) now, before it is staged (not once the
        engine failed, nor when the sample is staged already: then it goes the usual way, at
        once). The thread settles it from here."""
        ready = self.stager.ready
        if ready.error is not None or ready.state[pos] != WAITING or not self._serving():
            return False
        with self.cond:
            # the thread ended (the engine failed meanwhile): nobody would settle it
            if self.ending or len(self.pending) >= EARLY_MOST:
                return False
            self.pending.append((pos, idx))
            self.cond.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="s5loader-early", daemon=True)
            self._thread.start()
        return True

    def _serving(self) -> bool:
        """Whether the pass's words are served (False where no socket can be made in the pass
        folder, or someone removed the folder: its samples go out once staged, as before)."""
        if self.server is None:
            try:
                self.server = WordServer(self.stager.area.path)
            except OSError as exc:
                log.debug("no socket for early samples in %s (%s)", self.stager.area.path, exc)
                return False
        return not self.server.gone

    def finish(self) -> None:
        """The pass handed out its last sample: wait until every early one is settled.

        Raises:
            the engine's error, when it failed on the way.
        """
        self._end(stop=False)
        error = self.stager.ready.error
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop: what is not settled is marked not staged (or with the engine's error)."""
        self._end(stop=True)

    def _end(self, stop: bool) -> None:
        with self.cond:
            self.ending = True
            self.stopped = self.stopped or stop
            self.cond.notify_all()
        if stop:
            with self.stager.ready.cond:  # wake a wait on the engine at once
                self.stager.ready.cond.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()

    def _going(self) -> bool:
        return not self.stopped and self.stager.running()

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.pending and not self.ending:
                        self.cond.wait()
                    if not self.pending or self.stopped:
                        return
                    pos, idx = self.pending[0]
                # as the sampler's own wait: a budget too small for what readers hold is found
                try:
                    staged = self.stager.ready.wait(pos, self._going)
                except BaseException:  # noqa: BLE001 - the engine's error (or the pass closed): marked below
                    return
                if staged:
                    self.stager.yielded(idx)
                self._settle(idx, True if staged else None)
                with self.cond:
                    self.pending.popleft()
        finally:
            self._mark_rest()

    def _mark_rest(self) -> None:
        with self.cond:
            rest, self.pending = list(self.pending), collections.deque()
            self.ending = True  # a sample taken from now on would have nobody to settle it
        ready = self.stager.ready
        error = ready.error
        for pos, idx in rest:  # a sample staged already stays readable (its folder goes after the drain)
            self._settle(idx, True if ready.state[pos] == READY else error)

    def _settle(self, idx: int, word: object) -> None:
        assert self.server is not None  # made before the first sample went out early
        self.server.settle(idx, word)


def early_hand_out(stager: Stager, options: StagingOptions, keep: bool) -> EarlyHandOut | None:
    """The early hand-out of a pass over raw objects, where it applies (see the module
    docstring)."""
    if keep or options.on_error != "raise":
        return None
    return EarlyHandOut(stager)
