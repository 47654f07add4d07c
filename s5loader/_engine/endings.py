"""What becomes of a call that ends and of a sample that fails: the call's unused reservations
go back to the budget, its failures to the retry policy (:mod:`.retry`), and a sample the policy
gives up on is removed from its folder and marked skipped for its consumer."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence

from .._index.sample import Sample
from .._staging.layout import StagingLayout
from .budget import Budget
from .calls import Call, Calls
from .ready import SKIPPED, Readiness
from .retry import Failures, Retries
from .stats import Stats


class CallEnds:
    """Settles the engine's calls as they end, are killed or are found stalled (the
    :class:`~s5loader._engine.watchdog.Watchdog` calls :meth:`finish_exited`,
    :meth:`hold_given_up` and :meth:`failed`).

    Args:
        field_done: told each position whose field a draining call staged.
    """

    def __init__(
        self,
        order: Sequence[int],
        samples: Sequence[Sample],
        calls: Calls,
        budget: Budget,
        retries: Retries,
        ready: Readiness,
        stats: Stats,
        folders: StagingLayout,
        stall_timeout: float,
        field_done: Callable[[int], None],
    ) -> None:
        self.order, self.samples, self.calls, self.budget = order, samples, calls, budget
        self.retries, self.ready, self.stats, self.folders = retries, ready, stats, folders
        self.stall_timeout = stall_timeout
        self.field_done = field_done

    def field_uri(self, pos: int, j: int) -> str:
        """The URI of field ``j`` of the sample at position ``pos``."""
        return self.samples[self.order[pos]].fields[j].uri

    def discard(self, call: Call) -> None:
        """Forget ``call``, handing the budget back what it reserved and did not stage."""
        freed = self.calls.discard(call)
        if freed:
            with self.budget.cond:  # the engine's one lock
                self.budget.reserved -= freed

    def end(self, call: Call) -> None:
        """``call``'s process ended: discard it and hand what it failed to the retry policy."""
        rc = call.proc.wait()
        self.discard(call)
        if not call.plan.items:
            return
        self.failed(self.calls.attribute(call, rc, self.stall_timeout, self.field_uri))

    def finish_exited(self, call: Call) -> None:
        """``call`` exited while its output was still unread: read the rest, then end it."""
        self.calls.drain(call, self.field_done)
        self.end(call)

    def hold_given_up(self, extra: int) -> None:
        """Count ``extra`` bytes a given-up copy may still write against the budget."""
        self.budget.add(extra)
        self.stats.peak_reserved = max(self.stats.peak_reserved, self.budget.reserved)

    def failed(self, failures: Failures) -> None:
        """Retry what failed for a transient reason; give up on the rest."""
        self.retries.failed(failures, self.give_up)

    def give_up(self, pos: int, kind: str, msg: str, uri: str) -> None:
        """Skip the sample at ``pos`` (or raise, as the error policy says): remove what was
        staged of it, free its budget and tell its consumer."""
        idx = self.order[pos]
        shutil.rmtree(self.folders.sample_dir(idx), ignore_errors=True)
        self.retries.give_up(self.samples[idx].key, kind, msg, uri)
        with self.budget.cond:
            self.budget.free(idx)
        self.ready.mark(pos, SKIPPED)

    def kill_all(self) -> None:
        """Kill every call in flight and discard it."""
        for call in self.calls:
            self.calls.kill(call)
            self.discard(call)
