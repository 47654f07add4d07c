"""The s5cmd calls in flight: starting them, reading their output in one select loop,
routing each JSON line to the object it names, and, when a call ends, giving every object
without a success its own cause (attribution)."""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .._index.sample import Field
from .._s5cmd import S5cmd, classify, kill_group, parse_line, reported_destinations, write_command_file
from .._staging.layout import file_problem
from .callplan import CallPlan
from .retry import Failures
from .stats import Stats

log = logging.getLogger(__name__)


@dataclass
class Call:
    """One ``s5cmd run`` process and what it still owes."""

    seq: int
    proc: Any
    command_file: str
    plan: CallPlan
    workers: int = 256  # its s5cmd's --numworkers
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


class Calls:
    """The calls of one staging pass and the selector their pipes (and the release FIFO) are in.

    Args:
        s5cmd: runs the command files.
        field_of: ``(position, field number) -> Field`` of the pass's order.
        staging_path: the pass folder; a wildcard's unexpected object is removed only below it.
        verify: check each staged file against the listing (size, MD5 ETag).
        stats: counts the staged bytes.
    """

    def __init__(
        self,
        s5cmd: S5cmd,
        field_of: Callable[[int, int], Field],
        staging_path: str,
        verify: bool,
        stats: Stats,
    ) -> None:
        self.s5cmd = s5cmd
        self.field_of = field_of
        self.staging_path = staging_path
        self.verify = verify
        self.live: list[Call] = []
        self.sel = selectors.DefaultSelector()
        self.numworkers = getattr(s5cmd, "numworkers", 256)
        self.stats = stats
        self._warned_unexpected = False

    def __bool__(self) -> bool:
        return bool(self.live)

    def __len__(self) -> int:
        return len(self.live)

    def __iter__(self) -> Iterator[Call]:
        return iter(list(self.live))

    def start(self, seq: int, control_dir: str, plan: CallPlan, workers: int | None = None) -> Call:
        """Write the call's command file into ``control_dir`` and run it with ``workers`` s5cmd
        workers (default: the s5cmd's own)."""
        command_file = os.path.join(control_dir, f"{seq}.txt")
        for attempt in range(3):
            try:
                os.makedirs(control_dir, mode=0o700, exist_ok=True)
                write_command_file(command_file, plan.lines)
                break
            except FileNotFoundError:
                # the staging directory was removed (by someone else) while this ran
                if attempt == 2:
                    raise
        workers = workers or self.numworkers
        proc = self.s5cmd.run_file(command_file, workers)
        call = Call(seq, proc, command_file, plan, pending=set(plan.items), workers=workers)
        if len(call.pending) <= call.workers:
            call.all_running = call.started
        for stream in (proc.stdout, proc.stderr):
            assert stream is not None
            fd = stream.fileno()
            os.set_blocking(fd, False)
            call.bufs[fd] = bytearray()
            self.sel.register(fd, selectors.EVENT_READ, (call, stream is proc.stdout))
        self.live.append(call)
        return call

    def pump(
        self,
        timeout: float,
        on_done: Callable[[int], None],
        on_end: Callable[[Call], None],
        on_releases: Callable[[], None],
    ) -> None:
        """Read what is ready; ``on_done(position)`` per staged field, ``on_end(call)`` once a
        call's pipes are closed, ``on_releases()`` when the release FIFO is readable."""
        for key, _ in self.sel.select(timeout):
            if key.data is None:
                on_releases()
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
                    self.on_line(call, line, on_done)
            else:
                if buf:
                    self.on_line(call, bytes(buf), on_done)
                self.sel.unregister(fd)
                call.open_fds -= 1
                if call.open_fds == 0:
                    on_end(call)

    def drain(self, call: Call, on_done: Callable[[int], None]) -> None:
        """Read whatever a call that has exited left in its pipes."""
        for fd, buf in call.bufs.items():
            try:
                while chunk := os.read(fd, 1 << 16):
                    buf += chunk
            except (BlockingIOError, OSError):
                pass
            for line in bytes(buf).split(b"\n"):
                self.on_line(call, line, on_done, fd == call.proc.stdout.fileno())
            buf.clear()

    def on_line(
        self, call: Call, line: bytes, on_done: Callable[[int], None], is_stdout: bool = True
    ) -> None:
        r = parse_line(line)
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
            self.answered(call, r.destination)
            pos, j = item
            f = self.field_of(pos, j)
            problem = file_problem(r.destination, f) if self.verify else ""
            final = call.plan.moves.get(r.destination)
            if final is not None and not problem:
                problem = _move(r.destination, final)
            if problem:
                items[r.destination] = item
                call.errors[r.destination] = problem
                return
            self.stats.staged_bytes += f.size
            on_done(pos)
            return
        # A failure line is matched by the destination it names, which s5loader chose; a
        # line that names none of this call's destinations is no object's error.
        for where in reported_destinations(r.command) if r.command else ():
            if where in items or where in call.given_up:
                reported = [where]
            elif where in call.plan.folders:
                reported = call.plan.folders[where]
            else:
                continue
            for path in reported:
                if path in items and path not in call.errors:
                    call.errors[path] = r.error
                    self.answered(call, path)
            return
        if r.command:
            log.debug(
                "s5cmd call %d: an error about no object of this call: %s: %s", call.seq, r.command, r.error
            )
        else:
            call.call_errors.append(r.error)

    def answered(self, call: Call, where: str) -> None:
        call.pending.discard(where)
        if not call.all_running and len(call.pending) <= call.workers:
            call.all_running = time.monotonic()

    def _unexpected(self, call: Call, where: str) -> None:
        # A wildcard matched an object that was not in the listing (uploaded since): drop it
        # at once so it does not sit on the budget. Its path is below the scratch folder,
        # since wildcard lines exclude keys with "..".
        if not call.plan.scratch or not os.path.realpath(where).startswith(self.staging_path + os.sep):
            return
        try:
            os.unlink(where)
        except OSError:
            return
        if not self._warned_unexpected:
            self._warned_unexpected = True
            log.warning(
                "an object not in the listing was fetched (%s): dropped; objects added since the "
                "listing are not loaded",
                where,
            )

    def discard(self, call: Call) -> int:
        """Forget a call that has exited: its pipes, command file and scratch folders.

        Returns:
            the bytes still reserved for its given-up copies, now free.
        """
        self.live.remove(call)
        for stream in (call.proc.stdout, call.proc.stderr):
            if stream is not None:
                try:
                    self.sel.unregister(stream.fileno())
                except (KeyError, ValueError):
                    pass
                try:
                    stream.close()
                except OSError:  # already closed under it (EBADF): the call is over either way
                    log.debug("s5cmd call %d: a pipe was already closed", call.seq)
        try:
            os.unlink(call.command_file)
        except OSError:
            pass
        if call.plan.scratch:
            shutil.rmtree(os.path.dirname(call.plan.scratch[0]), ignore_errors=True)
        freed, call.given_up_bytes = call.given_up_bytes, 0
        return freed

    def attribute(
        self, call: Call, rc: int, stall_timeout: float, uri_of: Callable[[int, int], str]
    ) -> Failures:
        """The failed samples of a call that ended: each by its first field's own cause.

        An object without an error line of its own is never given another object's error.
        """
        failures: Failures = {}
        said = f"; s5cmd said: {call.call_errors[-1]}" if call.call_errors else ""
        default = (
            f"no progress for {stall_timeout:g}s (stalled: the server stopped answering?)"
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
                kind = classify(msg)
            failures[pos] = (kind, msg, uri_of(pos, j))
        return failures

    def kill(self, call: Call) -> None:
        kill_group(call.proc)
        call.proc.wait()

    def kill_now(self) -> None:
        """Kill every call's process group, taking no lock: for a signal handler."""
        for call in list(self.live):
            kill_group(call.proc)
            try:
                call.proc.wait(timeout=1)  # polls; never blocks on the engine thread's reaping
            except Exception:  # noqa: BLE001 - dying anyway
                pass

    def close(self) -> None:
        self.sel.close()


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
