"""How s5cmd is driven: the staging engine shared by the Sampler and the prefetch daemon.

A background thread walks an ordered list of sample indices, cuts it into calls of at most
``samples_per_call`` samples that fit the byte budget, writes one command file per call and
keeps ``buffers`` ``s5cmd run`` processes in flight. It reads their JSON output as it comes,
so a sample is ready as soon as its last file is staged, not when its whole call ends, and
gives each object the cause of the error line that names its destination. It retries what
failed for a transient reason (with backoff), stages again in a new call a copy that hangs
while the rest of its call goes on, kills a call that makes no progress for ``stall_timeout``
seconds, applies the error policy to what cannot be fetched, and frees budget when consumers
delete the samples they have read.
"""

from __future__ import annotations

import hashlib
import logging
import os
import selectors
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from . import _s5cmd
from ._blocks import Layout
from ._index import Sample, boto3_error, make_boto3_client
from ._uri import format_size, parse_s3_uri
from .exceptions import (
    BudgetError,
    ConfigError,
    S5LoaderError,
    StagingSpaceError,
    StallError,
)
from .staging.area import StagingArea
from .staging.layout import ReleaseEvents, StagingLayout, field_names

log = logging.getLogger(__name__)

WAITING, READY, SKIPPED = 0, 1, 2
ON_ERROR = ("raise", "skip")


@dataclass(frozen=True)
class StagerOptions:
    """How the engine stages. Checked on creation; messages say what to change."""

    budget: int
    samples_per_call: int = 1000
    buffers: int = 2
    stall_timeout: float = 60.0
    retries: int = 3
    retry_backoff: float = 0.5
    on_error: str = "raise"
    verify: bool = False

    def __post_init__(self) -> None:
        def positive_int(name: str, value: Any) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")

        positive_int("samples_per_call", self.samples_per_call)
        positive_int("buffers", self.buffers)
        positive_int("budget", self.budget)
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"retries must be an int >= 0, got {self.retries!r}")
        if not self.stall_timeout > 0:
            raise ConfigError(f"stall_timeout must be a positive number of seconds, got {self.stall_timeout!r}")
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"on_error must be one of {', '.join(ON_ERROR)}; got {self.on_error!r}")


@dataclass
class CallPlan:
    """The command lines of one call and how to read s5cmd's answers to them."""

    lines: list[str] = field(default_factory=list)
    items: dict[str, tuple[int, int]] = field(default_factory=dict)  # reported path -> (position, field)
    moves: dict[str, str] = field(default_factory=dict)  # reported path -> final path (scratch paths)
    folders: dict[str, list[str]] = field(default_factory=dict)  # wildcard line's folder -> reported paths
    scratch: list[str] = field(default_factory=list)  # folders to remove when the call ends
    aside: list[tuple[int, int, str, str]] = field(default_factory=list)  # keys no command file can carry


def plan_call(
    samples: Sequence[Sample],
    order: Sequence[int],
    positions: Sequence[int],
    sample_dir: Callable[[int], str],
    layout: Layout | None = None,
    scratch_dir: str = "",
    single: set[int] | frozenset[int] = frozenset(),
    via_scratch: bool = False,
) -> CallPlan:
    """Turn the samples at ``positions`` into s5cmd command lines.

    A block (see :mod:`._blocks`) whose samples are all in the call is fetched with one
    wildcard line into a scratch folder below ``scratch_dir``; its files are renamed into
    their samples' folders as they arrive. So is a sample of several objects that has a key
    prefix of its own. Every other object gets its own ``cp --raw`` line.
    Destinations come from sample indices and field names only, never from a key (block
    scratch paths come from keys that :mod:`._blocks` checked to be plain names).
    Positions in ``single`` (retries) always go one object at a time.
    With ``via_scratch``, ``cp --raw`` lines also download below ``scratch_dir`` (to
    ``.r/POSITION.FIELD``) and their files are renamed into place on arrival, so a copy
    that is given up on while its call runs on can never write into a sample's folder.
    """
    plan = CallPlan()
    whole: dict[int, list[int]] = {}
    if layout is not None and layout.blocks:
        for pos in positions:
            b = layout.block_of[order[pos]]
            if b >= 0 and pos not in single:
                whole.setdefault(b, []).append(pos)
        whole = {b: ps for b, ps in whole.items() if len({order[p] for p in ps}) == len(layout.blocks[b]) == len(ps)}
    in_blocks = {p for ps in whole.values() for p in ps}
    wildcards = [(layout.blocks[b], ps, f"b{b}") for b, ps in whole.items()] if layout is not None else []
    if layout is not None and layout.single is not None:
        for pos in positions:
            blk1 = layout.single[order[pos]]
            if pos not in in_blocks and pos not in single and blk1 is not None:
                wildcards.append((blk1, [pos], f"s{pos}"))
                in_blocks.add(pos)
    for blk, ps, tag in wildcards:
        scratch = f"{scratch_dir}/.{tag}"
        plan.scratch.append(scratch)
        plan.lines.append(_s5cmd.wildcard_line(blk.wildcard, scratch + "/"))
        reported = plan.folders.setdefault(scratch + "/", [])
        for pos in ps:
            idx = order[pos]
            names = field_names(samples[idx])
            for j, rel in enumerate(blk.rels[idx - blk.start]):
                where = f"{scratch}/{rel}"
                plan.items[where] = (pos, j)
                plan.moves[where] = f"{sample_dir(idx)}/{names[j]}"
                reported.append(where)
    raw = f"{scratch_dir}/.r"
    for pos in positions:
        if pos in in_blocks:
            continue
        idx = order[pos]
        sample = samples[idx]
        folder = sample_dir(idx)
        for j, (f, name) in enumerate(zip(sample.fields, field_names(sample), strict=True)):
            dest = f"{folder}/{name}"
            if not _s5cmd.can_write(f.uri):
                plan.aside.append((pos, j, f.uri, dest))
                continue
            if via_scratch:
                if not plan.scratch or plan.scratch[-1] != raw:
                    plan.scratch.append(raw)
                plan.moves[f"{raw}/{pos}.{j}"] = dest
                dest = f"{raw}/{pos}.{j}"
            plan.lines.append(_s5cmd.copy_line(f.uri, dest))
            plan.items[dest] = (pos, j)
    return plan


@dataclass
class _Call:
    seq: int
    proc: Any
    command_file: str
    plan: CallPlan
    errors: dict[str, str] = field(default_factory=dict)
    pending: set[str] = field(default_factory=set)  # reported paths with no answer yet
    given_up: set[str] = field(default_factory=set)  # reported paths retried in another call
    given_up_bytes: int = 0  # budget held for them until the call ends (they may still land)
    all_running: float = 0.0  # since when s5cmd has a worker for every pending copy
    call_errors: list[str] = field(default_factory=list)  # error lines about no object of ours
    bufs: dict[int, bytearray] = field(default_factory=dict)
    open_fds: int = 2
    started: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)
    rchar: int = -1
    stalled: bool = False
    exited_at: float = 0.0


@dataclass
class Stats:
    """What one pass of the engine did."""

    samples: int = 0
    staged_samples: int = 0
    staged_bytes: int = 0
    calls: int = 0
    retries: int = 0
    stalls: int = 0
    skipped: list[str] = field(default_factory=list)
    skip_errors: dict[str, S5LoaderError] = field(default_factory=dict)  # skipped URI -> why
    wait_s: float = 0.0
    first_wait_s: float = 0.0
    peak_reserved: int = 0


class Stager:
    """Stages ``order`` (indices into ``samples``) into ``area``; see the module docstring.

    Consumers call :meth:`wait` for each position in order, read the sample and release it
    (:meth:`StagingLayout.release <s5loader.staging.layout.StagingLayout.release>`: delete its
    folder, then announce the index on the pass's FIFO); :meth:`yielded` tells the engine which
    samples a consumer holds. With ``is_released`` (the prefetch daemon's ledger) the engine
    asks that instead, and polls.
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        order: Sequence[int],
        area: StagingArea,
        s5cmd: _s5cmd.S5cmd,
        options: StagerOptions,
        *,
        kept: set[int] | None = None,
        is_released: Callable[[int], bool] | None = None,
        endpoint_url: str | None = None,
        layout: Layout | None = None,
    ) -> None:
        self.samples = samples
        self.order = order
        self.area = area
        self.s5cmd = s5cmd
        self.opts = options
        self.kept = kept
        self.folders = StagingLayout(area.path)
        # Readers announce releases on the pass's FIFO; a consumer with a protocol of its own
        # (is_released) is asked instead.
        self._events = ReleaseEvents(self.folders) if is_released is None else None
        self.is_released = is_released or (lambda idx: not os.path.isdir(self.folders.sample_dir(idx)))
        self.endpoint_url = endpoint_url
        self.layout = layout
        self.stats = Stats(samples=len(order))
        self._state = bytearray(len(order))
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._aborted = False
        self._thread: threading.Thread | None = None
        self._next = 0
        self._retry: list[tuple[float, int]] = []
        self._attempts: dict[int, int] = {}
        self._stalled_pos: set[int] = set()
        self._held: dict[int, int] = {}
        self._reserved = 0
        self._yielded: dict[int, int] = {}
        self._calls: list[_Call] = []
        self._seq = 0
        self._fields_left: dict[int, int] = {}
        self._side: list[tuple[Future[None], int, int, str]] = []
        self._executor: ThreadPoolExecutor | None = None
        self._consumer_waiting = 0.0
        self._last_release = time.monotonic()
        self._last_stall_check = 0.0
        self._budget_blocked = False
        self._last_poll = 0.0
        self._warned_unexpected = False
        self._sel = selectors.DefaultSelector()
        self._numworkers = getattr(s5cmd, "numworkers", 256)

    # -- consumer side ------------------------------------------------------------------
    def start(self) -> Stager:
        if self._thread is None:
            if self._events is not None:
                try:
                    self._sel.register(self._events.open().fileno(), selectors.EVENT_READ, None)
                except OSError as exc:  # a file system without FIFOs: watch the folders
                    log.debug("no release FIFO in %s (%s); polling for released samples", self.area.path, exc)
                    self._events.close()
                    self._events = None
            self._thread = threading.Thread(target=self._run, name="s5loader-stager", daemon=True)
            self._thread.start()
        return self

    def wait(self, pos: int) -> bool:
        """Block until position ``pos`` is staged; False if its sample was skipped.

        Raises:
            the engine's error (FetchError, StallError, StagingSpaceError, ...).
        """
        t0 = time.monotonic()
        with self._cond:
            if self._state[pos] == WAITING and self._error is None:
                self._consumer_waiting = t0
                while self._state[pos] == WAITING and self._error is None and self._running():
                    self._cond.wait(0.5)
                self._consumer_waiting = 0.0
            waited = time.monotonic() - t0
            self.stats.wait_s += waited
            if pos == 0:
                self.stats.first_wait_s = waited
            if self._state[pos] == WAITING:
                raise self._error or S5LoaderError(
                    "this staging pass was closed: a newer iterator over the same S5Sampler "
                    "replaced it, or close() was called"
                )
            return self._state[pos] == READY

    def _running(self) -> bool:
        t = self._thread
        return not self._stop.is_set() and t is not None and t.is_alive()

    def poll(self, pos: int, timeout: float) -> bool | None:
        """Like :meth:`wait` with a timeout: True staged, False skipped, None not yet.

        Unlike ``wait`` it does not flag a waiting consumer: a producer ahead of its consumer
        (the prefetch daemon) waits on a full budget as long as the consumer takes, which is
        no deadlock.
        """
        with self._cond:
            if self._state[pos] == WAITING and self._error is None and timeout > 0:
                self._cond.wait(timeout)
            if self._state[pos] == WAITING:
                if self._error is not None:
                    raise self._error
                return None
            return self._state[pos] == READY

    def hold(self, idx: int, size: int) -> None:
        """Count ``size`` bytes already on disk for ``idx`` against the budget until released."""
        with self._cond:
            self._held[idx] = size
            self._reserved += size
            self._yielded[idx] = size

    def ready_indices(self) -> list[int]:
        """The indices whose samples are staged."""
        with self._cond:
            return [self.order[p] for p, s in enumerate(self._state) if s == READY]

    def yielded(self, idx: int) -> None:
        """The sample ``idx`` went to a consumer, who deletes its folder when done."""
        with self._cond:
            self._yielded[idx] = self._held.get(idx, 0)

    def close(self) -> None:
        """Stop the engine, kill s5cmd, join. Safe to call twice."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        events = self._events
        if events is not None:
            events.wake()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()
        self._kill_all()
        if events is not None:
            events.close()
        if self._executor is not None:
            # close() may run on one of the pool's own threads (garbage collection happens
            # anywhere); a pool cannot join itself
            own = threading.current_thread().name.startswith("s5loader-aside")
            self._executor.shutdown(wait=not own, cancel_futures=True)
            self._executor = None
        self._sel.close()

    # -- engine ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set() and not self._aborted:
                self._poll_releases()
                self._schedule()
                if self._finished():
                    break
                self._pump()
                self._check_side()
                self._check_stalls()
                self._check_deadlock()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            if not isinstance(exc, S5LoaderError):
                log.exception("the staging engine failed")
            with self._cond:
                self._error = exc
                self._cond.notify_all()
        finally:
            self._kill_all()

    def _finished(self) -> bool:
        return self._next >= len(self.order) and not self._retry and not self._calls and not self._side

    def _poll_releases(self) -> None:
        # A stat per sample handed out and not yet read. Without release events: often while
        # the budget blocks staging, rarely otherwise. With them, only a safety net for
        # consumers that delete folders without announcing it: once a second, while blocked.
        now = time.monotonic()
        if not self._yielded:
            return
        if self._events is not None:
            if not self._budget_blocked or now - self._last_poll < 1.0:
                return
        elif now - self._last_poll < (0.005 if self._budget_blocked else 0.05):
            return
        self._last_poll = now
        with self._cond:
            candidates = list(self._yielded)
        freed = []
        for idx in candidates:
            if self.is_released(idx):
                freed.append(idx)
        if freed:
            with self._cond:
                for idx in freed:
                    self._yielded.pop(idx, None)
                    self._reserved -= self._held.pop(idx, 0)
            self._last_release = time.monotonic()

    def _on_releases(self) -> None:
        assert self._events is not None
        # An index counts only while handed out and its folder is gone: an announcement that
        # comes after the safety net freed the sample cannot free a later copy of it.
        released = [idx for idx in self._events.read() if idx in self._yielded and self.is_released(idx)]
        if released:
            with self._cond:
                for idx in released:
                    if self._yielded.pop(idx, None) is not None:
                        self._reserved -= self._held.pop(idx, 0)
            self._last_release = time.monotonic()

    def _schedule(self) -> None:
        order, samples = self.order, self.samples
        # The first calls are small (32, 64, 128, ... samples) so the first batch does not
        # wait for a whole call of samples_per_call to come in.
        spc = min(self.opts.samples_per_call, 32 << min(self.stats.calls, 20))
        while len(self._calls) < self.opts.buffers:
            now = time.monotonic()
            retried = sorted(p for t, p in self._retry if t <= now)[:spc]
            picked = list(retried)  # a retried sample still holds its budget
            in_call = {order[p] for p in picked}
            left = self.opts.budget - self._reserved
            nxt, cut = self._next, False
            while nxt < len(order) and len(picked) < spc:
                idx = order[nxt]
                if self.kept is not None and idx in self.kept:
                    self._mark_ready(nxt)
                    nxt = self._next = nxt + 1
                    continue
                size = samples[idx].size
                if size > self.opts.budget:
                    raise BudgetError(
                        f"sample {samples[idx].key!r} ({format_size(size)}: "
                        f"{', '.join(f.uri for f in samples[idx].fields[:3])}) is larger than "
                        f"the budget of {format_size(self.opts.budget)}"
                    )
                # An index still on disk from earlier in the order (padding can repeat one)
                # is staged again only once its first copy is released.
                if idx in self._held or idx in in_call or size > left:
                    cut = True
                    break
                picked.append(nxt)
                in_call.add(idx)
                left -= size
                nxt += 1
            self._budget_blocked = cut and not picked
            if not picked:
                return
            new = len(picked) - len(retried)
            want = min(spc, len(order) - self._next)
            if cut and self._calls and not retried and new < max(1, want // 2):
                return  # wait for releases rather than start a sliver of a call
            if retried:
                done = set(retried)
                self._retry = [(t, p) for t, p in self._retry if p not in done]
            with self._cond:
                for pos in picked[len(retried):]:
                    size = samples[order[pos]].size
                    self._held[order[pos]] = size
                    self._reserved += size
            self._next = nxt
            self.stats.peak_reserved = max(self.stats.peak_reserved, self._reserved)
            self._start_call(picked)

    def _mark_ready(self, pos: int) -> None:
        with self._cond:
            self._state[pos] = READY
            self._cond.notify_all()

    def _start_call(self, positions: list[int]) -> None:
        self._seq += 1
        for pos in positions:
            idx = self.order[pos]
            folder = self.area.sample_dir(idx)
            if os.path.lexists(folder):  # a retry: start the sample from scratch
                shutil.rmtree(folder, ignore_errors=True)
            self._fields_left[pos] = len(self.samples[idx].fields)
        plan = plan_call(
            self.samples, self.order, positions, self.area.sample_dir, self.layout,
            f"{self.area.path}/.c{self._seq}", single=set(self._attempts), via_scratch=True,
        )
        for pos, j, uri, dest in plan.aside:
            self._fetch_aside(pos, j, uri, dest)
        if not plan.lines:
            return
        cmd_file = os.path.join(self.area.control_dir, f"{self._seq}.txt")
        if self._aborted:
            return
        for attempt in range(3):
            try:
                os.makedirs(self.area.control_dir, mode=0o700, exist_ok=True)
                _s5cmd.write_command_file(cmd_file, plan.lines)
                break
            except FileNotFoundError:
                # the staging directory was removed (by someone else) while this ran
                if attempt == 2:
                    raise
        proc = self.s5cmd.run_file(cmd_file)
        call = _Call(self._seq, proc, cmd_file, plan, pending=set(plan.items))
        if len(call.pending) <= self._numworkers:
            call.all_running = call.started
        for stream in (proc.stdout, proc.stderr):
            assert stream is not None
            fd = stream.fileno()
            os.set_blocking(fd, False)
            call.bufs[fd] = bytearray()
            self._sel.register(fd, selectors.EVENT_READ, (call, stream is proc.stdout))
        self._calls.append(call)
        self.stats.calls += 1
        log.debug("call %d: %d samples, %d lines", self._seq, len(positions), len(plan.lines))

    # Objects whose key s5cmd cannot carry in a command file (a line break in the key) are
    # fetched with boto3 instead, so they are neither dropped nor able to inject a command.
    def _fetch_aside(self, pos: int, j: int, uri: str, dest: str) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(4, thread_name_prefix="s5loader-aside")
        fut = self._executor.submit(_download, uri, dest, self.endpoint_url)
        self._side.append((fut, pos, self._attempts.get(pos, 0), uri))

    def _check_side(self) -> None:
        if not self._side:
            return
        still = []
        for fut, pos, attempt, uri in self._side:
            if not fut.done():
                still.append((fut, pos, attempt, uri))
                continue
            if attempt != self._attempts.get(pos, 0) or pos not in self._fields_left:
                continue  # the sample was retried (or given up) since: this result is stale
            exc = fut.exception()
            if exc is None:
                self._field_done(pos)
            else:
                msg = str(exc)
                self._failed({pos: (_s5cmd.classify(msg), msg, uri)})
        self._side = still

    def _pump(self) -> None:
        if self._events is not None:
            # Releases, call output and close() wake the select; only retries due at a time
            # and side fetches need a short tick.
            timeout = 0.01 if (self._retry or self._side) else 0.2
        else:
            timeout = 0.01 if (self._next < len(self.order) or self._retry or self._side) else 0.2
        if not self._calls and self._events is None:
            time.sleep(timeout)
            return
        for key, _ in self._sel.select(timeout):
            if key.data is None:
                self._on_releases()
                continue
            call, is_stdout = key.data
            fd = key.fd
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            buf = call.bufs[fd]
            if chunk:
                buf += chunk
                call.last_progress = time.monotonic()
                *lines, rest = buf.split(b"\n")
                call.bufs[fd] = bytearray(rest)
                for line in lines:
                    self._on_line(call, line, is_stdout)
            else:
                if buf:
                    self._on_line(call, bytes(buf), is_stdout)
                self._sel.unregister(fd)
                call.open_fds -= 1
                if call.open_fds == 0:
                    self._end_call(call)

    def _drain(self, call: _Call) -> None:
        for fd, buf in call.bufs.items():
            try:
                while chunk := os.read(fd, 1 << 16):
                    buf += chunk
            except (BlockingIOError, OSError):
                pass
            for line in bytes(buf).split(b"\n"):
                self._on_line(call, line, fd == call.proc.stdout.fileno())
            buf.clear()

    def _on_line(self, call: _Call, line: bytes, is_stdout: bool) -> None:
        r = _s5cmd.parse_line(line)
        if r is None:
            return
        items = call.plan.items
        if r.ok:
            if r.destination in call.given_up:
                _remove(r.destination)  # a late answer: the object was fetched again elsewhere
                return
            item = items.pop(r.destination, None)
            if item is None:
                self._unexpected(call, r.destination)
                return
            self._answered(call, r.destination)
            pos, j = item
            f = self.samples[self.order[pos]].fields[j]
            problem = _verify(r.destination, f) if self.opts.verify else ""
            final = call.plan.moves.get(r.destination)
            if final is not None and not problem:
                problem = _move(r.destination, final)
            if problem:
                items[r.destination] = item
                call.errors[r.destination] = problem
                return
            self.stats.staged_bytes += f.size
            self._field_done(pos)
            return
        # A failure line is matched by the destination it names, which s5loader chose; a
        # line that names none of this call's destinations is no object's error.
        for where in _s5cmd.reported_destinations(r.command) if r.command else ():
            if where in items or where in call.given_up:
                reported = [where]
            elif where in call.plan.folders:
                reported = call.plan.folders[where]
            else:
                continue
            for path in reported:
                if path in items and path not in call.errors:
                    call.errors[path] = r.error
                    self._answered(call, path)
            return
        if r.command:
            log.debug("s5cmd call %d: an error about no object of this call: %s: %s", call.seq, r.command, r.error)
        else:
            call.call_errors.append(r.error)

    def _answered(self, call: _Call, where: str) -> None:
        call.pending.discard(where)
        if not call.all_running and len(call.pending) <= self._numworkers:
            call.all_running = time.monotonic()

    def _unexpected(self, call: _Call, where: str) -> None:
        # A wildcard matched an object that was not in the listing (uploaded since): drop it
        # at once so it does not sit on the budget. Its path is below the scratch folder,
        # since wildcard lines exclude keys with "..".
        if not call.plan.scratch or not os.path.realpath(where).startswith(self.area.path + os.sep):
            return
        try:
            os.unlink(where)
        except OSError:
            return
        if not self._warned_unexpected:
            self._warned_unexpected = True
            log.warning("an object not in the listing was fetched (%s): dropped; objects added since the listing are not loaded", where)

    def _field_done(self, pos: int) -> None:
        if pos not in self._fields_left:
            return  # a late answer for a sample already retried or given up
        left = self._fields_left[pos] - 1
        if left:
            self._fields_left[pos] = left
            return
        del self._fields_left[pos]
        self.stats.staged_samples += 1
        self._mark_ready(pos)

    def _discard(self, call: _Call) -> None:
        """Forget a call that has exited: its pipes, command file and scratch folders."""
        self._calls.remove(call)
        for stream in (call.proc.stdout, call.proc.stderr):
            if stream is not None:
                try:
                    self._sel.unregister(stream.fileno())
                except (KeyError, ValueError):
                    pass
                stream.close()
        try:
            os.unlink(call.command_file)
        except OSError:
            pass
        if call.plan.scratch:
            shutil.rmtree(os.path.dirname(call.plan.scratch[0]), ignore_errors=True)
        if call.given_up_bytes:
            with self._cond:
                self._reserved -= call.given_up_bytes
            call.given_up_bytes = 0

    def _end_call(self, call: _Call) -> None:
        rc = call.proc.wait()
        self._discard(call)
        if not call.plan.items:
            return
        failures: dict[int, tuple[str, str, str]] = {}
        # An object without an error line of its own is never given another object's error.
        said = f"; s5cmd said: {call.call_errors[-1]}" if call.call_errors else ""
        default = (
            f"no progress for {self.opts.stall_timeout:g}s (stalled: the server stopped answering?)"
            if call.stalled
            else f"s5cmd reported no result for it (exit code {rc}{said})"
        )
        for dest, (pos, j) in call.plan.items.items():
            msg = call.errors.get(dest)
            if pos in failures and (msg is None or failures[pos][1] != default):
                continue  # a sample's first field with an error line of its own decides
            if msg is None:
                kind, msg = ("stall" if call.stalled else "transient"), default
            else:
                kind = _s5cmd.classify(msg)
            failures[pos] = (kind, msg, self.samples[self.order[pos]].fields[j].uri)
        self._failed(failures)

    def _failed(self, failures: dict[int, tuple[str, str, str]]) -> None:
        retry_again: list[int] = []
        for pos, (kind, msg, uri) in sorted(failures.items()):
            self._fields_left.pop(pos, None)
            if kind == "no_space":
                raise StagingSpaceError(
                    f"the staging directory {self.area.path} ran out of space while staging "
                    f"{uri}: {msg}; lower the budget or free space"
                )
            if kind in ("transient", "stall", "endpoint"):
                n = self._attempts.get(pos, 0) + 1
                self._attempts[pos] = n
                if kind == "stall":
                    self._stalled_pos.add(pos)
                if n <= self.opts.retries:
                    retry_again.append(pos)
                    continue
                if pos in self._stalled_pos:
                    stalled = [u for p, (k, _, u) in failures.items() if k == "stall"] or [uri]
                    raise StallError(
                        f"staging made no progress for {self.opts.stall_timeout:g}s, "
                        f"{self.opts.retries} times; gave up on {len(stalled)} object(s): "
                        f"{', '.join(stalled[:5])}{' ...' if len(stalled) > 5 else ''}"
                    )
                msg = f"failed after {self.opts.retries} retries: {msg}"
            self._give_up(pos, kind, msg, uri)
        if retry_again:
            self.stats.retries += len(retry_again)
            if any(failures[p][0] == "stall" for p in retry_again):
                self.stats.stalls += 1
            now = time.monotonic()
            for pos in retry_again:
                n = self._attempts[pos]
                delay = min(self.opts.retry_backoff * 2 ** (n - 1), 30.0)
                self._retry.append((now + delay, pos))
            log.warning(
                "retrying %d sample(s) (attempt %d of %d): %s%s",
                len(retry_again), max(self._attempts[p] for p in retry_again), self.opts.retries,
                "; ".join(f"{failures[p][2]}: {failures[p][1]}" for p in retry_again[:3]),
                " ..." if len(retry_again) > 3 else "",
            )

    def _give_up(self, pos: int, kind: str, msg: str, uri: str) -> None:
        idx = self.order[pos]
        shutil.rmtree(self.area.sample_dir(idx), ignore_errors=True)
        error = _s5cmd.error_for(kind, f"cannot stage {uri}: {msg}")
        if self.opts.on_error == "raise":
            raise error
        log.warning("skipping sample %r: %s", self.samples[idx].key, error)
        self.stats.skipped.append(uri)
        self.stats.skip_errors[uri] = error
        with self._cond:
            self._reserved -= self._held.pop(idx, 0)
            self._state[pos] = SKIPPED
            self._cond.notify_all()

    def _check_stalls(self) -> None:
        now = time.monotonic()
        if now - self._last_stall_check < 0.5:
            return
        self._last_stall_check = now
        for call in list(self._calls):
            # s5cmd has exited but a pipe never reached EOF: a process forked meanwhile (a
            # DataLoader worker) holds a copy of its write end. Finish the call from its exit.
            if call.proc.poll() is not None:
                if call.exited_at == 0.0:
                    call.exited_at = now
                elif now - call.exited_at > 2.0:
                    self._drain(call)
                    self._end_call(call)
                continue
            if call.stalled:
                continue
            # Bytes read from the network count as progress, so one large object that takes
            # longer than stall_timeout is not mistaken for a hung server.
            rchar = _read_chars(call.proc.pid)
            if rchar > call.rchar:
                call.rchar = rchar
                call.last_progress = now
            if now - call.last_progress > self.opts.stall_timeout:
                log.warning(
                    "s5cmd call %d made no progress for %.0fs; killing it and retrying the rest",
                    call.seq, now - call.last_progress,
                )
                call.stalled = True
                _s5cmd.kill_group(call.proc)
                continue
            self._check_copies(call, now)

    def _check_copies(self, call: _Call, now: float) -> None:
        """Give up, within this call, on copies that have had no answer and written no byte
        for ``stall_timeout`` since they surely started, and stage their samples again in a
        new call, while the call delivers the rest.

        A copy has surely started once s5cmd has a worker for every pending copy of the call
        (its workers take the next copy as soon as one is free); its temporary file shows
        when its GET began and, by its modification time, when it last received bytes.
        """
        limit = self.opts.stall_timeout
        if not call.pending or not call.all_running or now - call.all_running <= limit:
            return
        folders: dict[str, dict[str, str]] = {}
        for where in call.pending:
            folder, name = os.path.split(where)
            folders.setdefault(folder, {})[name] = where
        last_write: dict[str, float] = {}
        for folder, names in folders.items():
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for e in entries:
                for name in (e.name, *_s5cmd.partial_of(e.name)):
                    dest = names.get(name)
                    if dest is None:
                        continue
                    try:
                        mtime = e.stat(follow_symlinks=False).st_mtime
                    except OSError:
                        continue
                    last_write[dest] = max(last_write.get(dest, 0.0), mtime)
        wall = time.time()
        hung: dict[int, tuple[str, str, str]] = {}
        for where in call.pending:
            idle = now - call.all_running
            if where in last_write:
                idle = min(idle, wall - last_write[where])
            if idle > limit:
                pos, j = call.plan.items[where]
                uri = self.samples[self.order[pos]].fields[j].uri
                hung[pos] = ("stall", f"no answer for {limit:g}s (the request hung)", uri)
        if not hung:
            return
        # The given-up copies may still land in this call's scratch folder while their samples
        # are fetched again: their bytes stay on the budget until the call is gone.
        extra = sum(self.samples[self.order[pos]].size for pos in hung)
        with self._cond:
            self._reserved += extra
        call.given_up_bytes += extra
        self.stats.peak_reserved = max(self.stats.peak_reserved, self._reserved)
        for where, (pos, _) in list(call.plan.items.items()):
            if pos in hung:  # the whole sample starts again elsewhere; late answers are ignored
                del call.plan.items[where]
                call.pending.discard(where)
                call.errors.pop(where, None)
                call.given_up.add(where)
        log.warning(
            "s5cmd call %d: no answer for %gs for %s; staging %s again in a new call",
            call.seq, limit, ", ".join(u for _, _, u in list(hung.values())[:5]),
            "it" if len(hung) == 1 else f"these {len(hung)} samples",
        )
        if not call.pending:
            _s5cmd.kill_group(call.proc)  # only given-up copies keep it running
        self._failed(hung)

    def _check_deadlock(self) -> None:
        # A consumer waiting for a sample that cannot be staged because the budget is held by
        # samples the consumer already has but never released: the budget is smaller than
        # what the DataLoader holds at once (a batch, plus its prefetch).
        if not (self._consumer_waiting and self._budget_blocked) or self._calls or self._side or self._retry:
            return
        now = time.monotonic()
        limit = self.opts.stall_timeout
        if now - self._consumer_waiting < limit or now - self._last_release < limit:
            return
        if self._next >= len(self.order) and not self._retry:
            return
        raise BudgetError(
            f"the budget of {format_size(self.opts.budget)} is full with "
            f"{len(self._yielded)} samples handed out but not read for {limit:g}s; it must "
            "hold at least one batch (plus the DataLoader's prefetch): raise the budget or "
            "lower batch_size"
        )

    def _kill_all(self) -> None:
        for call in list(self._calls):
            _s5cmd.kill_group(call.proc)
            call.proc.wait()
            self._discard(call)

    def abort(self) -> None:
        """Kill s5cmd at once, taking no lock and joining no thread: for a signal handler,
        which may have interrupted a thread that holds this engine's lock. The process is
        about to end; nothing else is cleaned up."""
        # A plain attribute, not the stop event (whose lock the interrupted thread may
        # hold): the engine thread starts no new call, nor recreates folders, from now on.
        self._aborted = True
        for call in list(self._calls):
            _s5cmd.kill_group(call.proc)
            try:
                call.proc.wait(timeout=1)  # polls; never blocks on the engine thread's reaping
            except Exception:  # noqa: BLE001 - dying anyway
                pass

    @property
    def reserved(self) -> int:
        return self._reserved


def _read_chars(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            for line in f:
                if line.startswith(b"rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return -1


def _verify(path: str, f: Any) -> str:
    """Why a staged file does not match its listing, or '' when it does."""
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        return f"staged file missing: {exc.strerror}"
    if size != f.size:
        return f"size mismatch: listed {f.size} bytes, staged {size} (truncated transfer)"
    etag = f.etag
    if etag and "-" not in etag and len(etag) == 32:
        h = hashlib.md5(usedforsecurity=False)
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != etag.lower():
            return f"MD5 mismatch: ETag {etag}, staged file {h.hexdigest()}"
    return ""


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _move(src: str, dest: str) -> str:
    """Rename a file out of a call's scratch folder into its sample's folder."""
    try:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.rename(src, dest)
    except OSError as exc:
        return f"cannot move {src} to {dest}: {exc.strerror}"
    return ""


def _download(uri: str, dest: str, endpoint_url: str | None) -> None:
    u = parse_s3_uri(uri)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = dest + ".part"
    try:
        make_boto3_client(endpoint_url).download_file(u.bucket, u.key, tmp)
    except Exception as exc:
        raise boto3_error(exc, uri) from exc
    os.rename(tmp, dest)

