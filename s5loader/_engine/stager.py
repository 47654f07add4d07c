"""The staging engine shared by the Sampler and the prefetch daemon: it only orchestrates.

A background thread walks an ordered list of sample indices, cuts it into calls of at most
``samples_per_call`` samples that fit the byte budget (:mod:`.schedule`, :mod:`.budget`), plans
each call's command lines (:mod:`.plan`), keeps ``calls_in_flight`` ``s5cmd run`` processes in
flight and routes their output to samples as it comes (:mod:`.calls`), so a sample is ready as
soon as its last file is staged. Ended calls are settled (:mod:`.endings`): what fails goes to
the retry policy (:mod:`.retry`); hung copies and stalled calls are found by the watchdog
(:mod:`.watchdog`); keys no command file can carry are fetched aside (:mod:`.side`). Budget
comes back when consumers release what they read.

``windows`` (ascending positions, the first 0) cuts the order into windows that calls stage
whole: a call that reaches past a window's start (by ``samples_per_call`` or by the budget) ends
at the last such start, and one that reaches none grows to the next, so it holds whole windows
and fetches each of their blocks with one wildcard line. While anything is staged, a call the
budget cuts inside a window waits for releases instead; only a window larger than the whole
budget (or a call after a retry) is split.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Container, Sequence

from .._index.blocks import BlockPlan
from .._index.sample import Field, Sample
from .._s5cmd import S5cmd
from .._staging.area import StagingArea
from .._staging.layout import StagingLayout
from .._staging.release_events import ReleaseEvents
from ..config import Access, StagingOptions
from ..exceptions import S5LoaderError, StagingSpaceError
from .budget import Budget
from .callplan import plan_call
from .calls import Calls
from .counters import Metrics, Throughput, snapshot
from .endings import CallEnds
from .ready import Outstanding, Readiness
from .retry import Retries
from .schedule import Scheduler, field_of
from .side import SideFetches
from .stats import Stats
from .watchdog import Watchdog

log = logging.getLogger(__name__)
_ABORT_JOIN_S = 1.0  # how long abort() waits for the engine's thread to end

THREAD_NAME = "s5loader-stager"  # every engine's thread


def close_off_engine(close: Callable[[], None]) -> None:
    """Call ``close`` (an engine's, or that of what owns one) now, or from a new thread when
    this is an engine's thread: a garbage collector runs on whichever thread allocates and
    finalizes what it collects there, and the engine's loop, which the collector only paused,
    would go on using what ``close`` releases (and recreate folders it removed) until it sees
    the stop; from another thread, ``close`` waits for the loop to end first."""
    if threading.current_thread().name == THREAD_NAME:
        threading.Thread(target=close, name="s5loader-close", daemon=True).start()
    else:
        close()


class Stager:
    """Stages ``order`` (indices into ``samples``) into ``area``; see the module docstring.

    Consumers call :meth:`wait` for each position in order, read the sample and release it
    (:meth:`StagingLayout.release <s5loader._staging.layout.StagingLayout.release>`: delete its
    folder, then announce the index on the pass's FIFO); :meth:`yielded` tells the engine which
    samples a consumer holds. With ``is_released`` (the prefetch daemon's ledger) the engine
    also asks that of the keys nobody announces (negative ones), often. The first call takes
    ``first_call`` units of the order, each next one twice as many, up to ``samples_per_call``
    (a shard is a unit), with up to ``first_workers`` s5cmd workers (see :mod:`.schedule`).
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        order: Sequence[int],
        area: StagingArea,
        s5cmd: S5cmd,
        options: StagingOptions,
        *,
        kept: Container[int] | None = None,
        is_released: Callable[[int], bool] | None = None,
        access: Access | str | None = None,
        layout: BlockPlan | None = None,
        windows: Sequence[int] | None = None,
        first_call: int = 32,
        first_workers: int | None = None,
    ) -> None:
        self.samples = samples
        self.order = order
        self.area = area
        self.s5cmd = s5cmd
        self.opts = options
        self.folders = StagingLayout(area.path)
        self.access = access
        self.layout = layout
        self.stats = Stats(samples=len(order))
        self.ready = Readiness(len(order), self.stats)
        self._cond = self.ready.cond  # the engine's one lock
        self._stop = threading.Event()
        self._aborted = False
        self._thread: threading.Thread | None = None
        self._seq = 0
        self.fields = Outstanding()
        self.throughput = Throughput(time.monotonic())
        # Readers announce releases on the pass's FIFO; what a consumer holds under its own
        # protocol (is_released: the daemon's deliveries, negative keys) is looked for instead.
        self.is_released = is_released or (lambda idx: not os.path.isdir(self.folders.sample_dir(idx)))
        events = ReleaseEvents(self.folders)
        self.budget = Budget(options.budget, self._cond, self.is_released, events)
        self.retries = Retries(options, self.stats, area.path, self.fields.forget, s5cmd.settings.endpoint())
        self.calls = Calls(s5cmd, self._field, area.path, options.verify, self.stats)
        self.side = SideFetches(access)
        self._compose()
        self.schedule = Scheduler(
            order,
            samples,
            self.budget,
            self.retries,
            self.ready,
            self.stats,
            kept=kept,
            windows=windows,
            first_call=first_call,
            first_workers=first_workers,
        )

    def _compose(self) -> None:
        """What settles an ended call, and the watchdog over the running ones."""
        order, samples, options = self.order, self.samples, self.opts
        self.ends = CallEnds(
            order,
            samples,
            self.calls,
            self.budget,
            self.retries,
            self.ready,
            self.stats,
            self.folders,
            options.stall_timeout,
            self._field_done,
        )
        self.watchdog = Watchdog(
            options.stall_timeout,
            self.calls,
            self.ends.field_uri,
            lambda pos: self.samples[self.order[pos]].size,
            self.ends.finish_exited,
            self.ends.hold_given_up,
            self.ends.failed,
        )

    def _field(self, pos: int, j: int) -> Field:
        return field_of(self.samples, self.order[pos], j)

    # -- consumer side ------------------------------------------------------------------
    def start(self) -> Stager:
        if self._thread is None:
            self.budget.listen(self.calls.sel, self.area.path)
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()
        return self

    def wait(self, pos: int) -> bool:
        """Block until position ``pos`` is staged; False if its sample was skipped.

        Raises:
            the engine's error (FetchError, StallError, StagingSpaceError, ...).
        """
        return self.ready.wait(pos, self.running)

    def running(self) -> bool:
        """Whether the engine's thread runs (started, not stopped, not failed or done)."""
        t = self._thread
        return not self._stop.is_set() and t is not None and t.is_alive()

    def poll(self, pos: int, timeout: float) -> bool | None:
        """Like :meth:`wait` with a timeout: True staged, False skipped, None not yet.

        Unlike ``wait`` it does not flag a waiting consumer: a producer ahead of its consumer
        (the prefetch daemon) waits on a full budget as long as the consumer takes, which is
        no deadlock.
        """
        return self.ready.poll(pos, timeout)

    def hold(self, idx: int, size: int) -> None:
        """Count ``size`` bytes already on disk for ``idx`` against the budget until released."""
        self.budget.hold_on_disk(idx, size)

    def ready_indices(self) -> list[int]:
        """The indices whose samples are staged."""
        return [self.order[p] for p in self.ready.ready()]

    def yielded(self, idx: int) -> None:
        """The sample ``idx`` went to a consumer, who releases it when done."""
        self.budget.hand_out(idx)

    def close(self) -> None:
        """Stop the engine, kill s5cmd, join. Safe to call twice."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        events = self.budget.events
        if events is not None:
            events.wake()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()
        self.ends.kill_all()
        if events is not None:
            events.close()
        self.side.close()
        self.calls.close()

    # -- engine ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set() and not self._aborted:
                self.budget.poll()
                self._schedule()
                if self._finished():
                    break
                self._pump()
                self.side.check(self._current, self._field_done, self.ends.failed)
                self.watchdog.check()
                self._check_deadlock()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            exc = _no_space(exc, self.area.path)
            if not isinstance(exc, S5LoaderError):
                log.exception("the staging engine failed")
            self.ready.fail(exc)
        finally:
            self.ends.kill_all()

    def _finished(self) -> bool:
        return (
            self.schedule.next >= len(self.order)
            and not self.retries.due
            and not self.calls
            and not self.side
        )

    def _current(self, pos: int, attempt: int) -> bool:
        return attempt == self.retries.attempts.get(pos, 0) and pos in self.fields

    def _schedule(self) -> None:
        while len(self.calls) < self.schedule.most_calls(self.opts.calls_in_flight, len(self.calls)):
            # each call started doubles the next one's size, so the size is taken per call
            picked = self.schedule.next_call(self.schedule.call_size(self.opts.samples_per_call), self.calls)
            if picked is None:
                return
            self._start_call(picked)

    def _start_call(self, positions: list[int]) -> None:
        self._seq += 1
        for pos in positions:
            idx = self.order[pos]
            folder = self.folders.sample_dir(idx)
            if os.path.lexists(folder):  # a retry: start the sample from scratch
                shutil.rmtree(folder, ignore_errors=True)
            self.fields.start(pos, len(self.samples[idx].fields))
        plan = plan_call(
            self.samples,
            self.order,
            positions,
            self.folders.sample_dir,
            self.layout,
            f"{self.area.path}/.c{self._seq}",
            single=set(self.retries.attempts),
            via_scratch=True,
        )
        for pos, _, uri, dest in plan.aside:
            self.side.submit(pos, self.retries.attempts.get(pos, 0), uri, dest)
        self.stats.count_requests(plan.requests)
        if not plan.lines or self._aborted:
            return
        workers = self.schedule.workers(len(plan.items), self.calls.numworkers, self.opts.calls_in_flight)
        self.calls.start(self._seq, self.area.control_dir, plan, workers)
        self.stats.calls += 1
        log.debug("call %d: %d samples, %d lines", self._seq, len(positions), len(plan.lines))

    def _pump(self) -> None:
        # Releases, call output and close() wake the select; only retries due at a time and
        # side fetches need a short tick. Releases nothing announces are looked for less and
        # less often while none comes.
        if self.budget.events is not None:
            timeout = 0.01 if (self.retries.due or self.side) else 0.2
        elif self.budget.blocked and not (self.retries.due or self.side):
            timeout = self.budget.idle_interval
        else:
            timeout = 0.01 if (self.schedule.next < len(self.order) or self.retries.due or self.side) else 0.2
        if not self.calls and self.budget.events is None:
            time.sleep(timeout)
            return
        self.calls.pump(timeout, self._field_done, self.ends.end, self.budget.on_events)

    def _field_done(self, pos: int) -> None:
        if not self.fields.done(pos):
            return
        self.stats.staged_units += 1
        self.throughput.add(time.monotonic(), self.stats.staged_bytes, self.stats.staged_units)
        self.ready.mark(pos)

    def _check_deadlock(self) -> None:
        # Only a consumer waiting while the budget blocks staging and nothing else can free it.
        if (
            not (self.ready.consumer_waiting and self.budget.blocked)
            or self.calls
            or self.side
            or self.retries.due
        ):
            return
        if self.schedule.next < len(self.order):
            self.budget.check_deadlock(self.ready.consumer_waiting, self.opts.stall_timeout)

    def abort(self) -> None:
        """Kill s5cmd at once, taking no lock: for a signal handler, which may have interrupted
        a thread that holds this engine's lock. The process is about to end; nothing else is
        cleaned up. The engine's thread is given a moment to see it (a call it was starting
        would make its folders again after they are removed)."""
        # A plain attribute, not the stop event (whose lock the interrupted thread may
        # hold): the engine thread starts no new call, nor recreates folders, from now on.
        self._aborted = True
        self.calls.kill_now()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(_ABORT_JOIN_S)  # bounded: the interrupted thread may hold what it needs to end
        self.calls.kill_now()  # a call it started meanwhile

    def metrics(
        self, *, epoch: int, position: int, samples: int | None = None, waited_s: float | None = None
    ) -> Metrics:
        """A snapshot of this pass (see :class:`~s5loader._engine.counters.Metrics`), for any thread:
        counters read without the engine's lock, one clock read.

        Args:
            epoch: the consumer's epoch.
            position: positions the consumer has taken (or passed, when skipped).
            samples: samples in the pass (default: the length of the order).
            waited_s: the consumer's own starvation figure (default: the time spent in
                :meth:`wait`, up to now if it waits now).
        """
        running = self.running()
        return snapshot(
            time.monotonic(),
            self.stats,
            self.ready,
            self.budget,
            self.throughput,
            epoch=epoch,
            position=position,
            samples=len(self.order) if samples is None else samples,
            waited_s=waited_s,
            calls=len(self.calls) if running else 0,
            objects=self.fields.objects if running else 0,
        )

    @property
    def reserved(self) -> int:
        return self.budget.reserved


def _no_space(exc: BaseException, path: str) -> BaseException:
    """``exc``, or a :class:`StagingSpaceError` where it is ENOSPC: a control file (a call's
    command file, a word to a reader) had no room in the staging directory ``path``."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        error = StagingSpaceError(
            f"the staging directory {path} ran out of space while staging ({exc}): "
            "lower the budget or free space"
        )
        error.__cause__ = exc
        return error
    return exc
