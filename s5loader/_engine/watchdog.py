"""The watchdog: s5cmd has no request timeout, so the engine watches its calls.

* A call that reads no byte from the network and reports nothing for ``stall_timeout`` is
  killed (its process group); its unfinished part is retried as stalled.
* A copy that has had no answer and written no byte for ``stall_timeout`` since it surely
  started is given up on within its call, which goes on delivering the rest; its sample is
  staged again in a new call.
* A call whose s5cmd has exited but whose pipes never reach end-of-file (a process forked
  meanwhile holds a copy of their write ends) is finished from its exit.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from .._s5cmd import kill_group, partial_of
from .calls import Call, Calls
from .retry import Failures

log = logging.getLogger(__name__)


class Watchdog:
    """Checks the calls at most every half second.

    Args:
        limit: ``stall_timeout``, in seconds.
        calls: the calls in flight.
        uri_of: ``(position, field number) -> URI``.
        size_of: ``position -> sample size``.
        finish: finishes a call whose s5cmd exited without closing its pipes.
        hold: ``bytes ->``: keeps given-up copies' bytes on the budget (they may still land).
        failed: hands the samples of hung copies to the retry policy.
    """

    def __init__(
        self,
        limit: float,
        calls: Calls,
        uri_of: Callable[[int, int], str],
        size_of: Callable[[int], int],
        finish: Callable[[Call], None],
        hold: Callable[[int], None],
        failed: Callable[[Failures], None],
    ) -> None:
        self.limit = limit
        self.calls = calls
        self.uri_of = uri_of
        self.size_of = size_of
        self.finish = finish
        self.hold = hold
        self.failed = failed
        self._last_check = 0.0

    def check(self) -> None:
        now = time.monotonic()
        if now - self._last_check < 0.5:
            return
        self._last_check = now
        for call in self.calls:
            # s5cmd has exited but a pipe never reached EOF: a process forked meanwhile other
            # than by os.fork() (which waits for a start, see s5cmd.process) holds a copy of its write
            # end. Finish the call from its exit.
            if call.proc.poll() is not None:
                if call.exited_at == 0.0:
                    call.exited_at = now
                elif now - call.exited_at > 2.0:
                    self.finish(call)
                continue
            if call.stalled:
                continue
            # Bytes read from the network count as progress, so one large object that takes
            # longer than stall_timeout is not mistaken for a hung server.
            rchar = read_chars(call.proc.pid)
            if rchar > call.rchar:
                call.rchar = rchar
                call.last_progress = now
            if now - call.last_progress > self.limit:
                log.warning(
                    "s5cmd call %d made no progress for %.0fs; killing it and retrying the rest",
                    call.seq,
                    now - call.last_progress,
                )
                call.stalled = True
                kill_group(call.proc)
                continue
            self._check_copies(call, now)

    def _check_copies(self, call: Call, now: float) -> None:
        """Give up, within this call, on copies that have had no answer and written no byte
        for ``stall_timeout`` since they surely started, and stage their samples again in a
        new call, while the call delivers the rest.

        A copy has surely started once s5cmd has a worker for every pending copy of the call
        (its workers take the next copy as soon as one is free); its temporary file shows
        when its GET began and, by its modification time, when it last received bytes.
        """
        limit = self.limit
        if not call.pending or not call.all_running or now - call.all_running <= limit:
            return
        last_write = _last_writes(call.pending)
        wall = time.time()
        hung: Failures = {}
        for where in call.pending:
            idle = now - call.all_running
            if where in last_write:
                idle = min(idle, wall - last_write[where])
            if idle > limit:
                pos, j = call.plan.items[where]
                hung[pos] = ("stall", f"no answer for {limit:g}s (the request hung)", self.uri_of(pos, j))
        if not hung:
            return
        # The given-up copies may still land in this call's scratch folder while their samples
        # are fetched again: their bytes stay on the budget until the call is gone.
        extra = sum(self.size_of(pos) for pos in hung)
        self.hold(extra)
        call.given_up_bytes += extra
        for where, (pos, _) in list(call.plan.items.items()):
            if pos in hung:  # the whole sample starts again elsewhere; late answers are ignored
                del call.plan.items[where]
                call.pending.discard(where)
                call.errors.pop(where, None)
                call.given_up.add(where)
        log.warning(
            "s5cmd call %d: no answer for %gs for %s; staging %s again in a new call",
            call.seq,
            limit,
            ", ".join(u for _, (_, _, u) in sorted(hung.items())[:5]),  # the first in the order
            "it" if len(hung) == 1 else f"these {len(hung)} samples",
        )
        if not call.pending:
            kill_group(call.proc)  # only given-up copies keep it running
        self.failed(hung)


def _last_writes(pending: set[str]) -> dict[str, float]:
    """The latest modification time of each pending destination's file or s5cmd's partial."""
    folders: dict[str, dict[str, str]] = {}
    for where in pending:
        folder, name = os.path.split(where)
        folders.setdefault(folder, {})[name] = where
    last_write: dict[str, float] = {}
    for folder, names in folders.items():
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for e in entries:
            for name in (e.name, *partial_of(e.name)):
                dest = names.get(name)
                if dest is None:
                    continue
                try:
                    mtime = e.stat(follow_symlinks=False).st_mtime
                except OSError:
                    continue
                last_write[dest] = max(last_write.get(dest, 0.0), mtime)
    return last_write


def read_chars(pid: int) -> int:
    """Bytes the process has read so far (``/proc/PID/io``), or -1."""
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            for line in f:
                if line.startswith(b"rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return -1
