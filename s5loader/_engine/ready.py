"""Which positions of a staging pass are ready: the board the engine marks and consumers
wait on, under the engine's one lock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..exceptions import S5LoaderError
from .stats import Stats

WAITING, READY, SKIPPED = 0, 1, 2


class Readiness:
    """One state per position (waiting, ready, skipped) and the engine's error, if any."""

    def __init__(self, n: int, stats: Stats) -> None:
        self.cond = threading.Condition()
        self.state = bytearray(n)
        self.stats = stats
        self.error: BaseException | None = None
        self.consumer_waiting = 0.0  # since when a consumer waits in wait(), or 0
        # For the metrics: positions marked ready, and those a consumer took (each position
        # is waited for, or polled to an answer, once).
        self.n_ready = 0
        self.n_taken = 0
        # the positions a wait or a poll is waiting for (and how many wait for each): marking
        # another position wakes nobody
        self._awaited: dict[int, int] = {}

    def wait(self, pos: int, running: Callable[[], bool]) -> bool:
        """Block until position ``pos`` is staged; False if its sample was skipped."""
        t0 = time.monotonic()
        with self.cond:
            if self.state[pos] == WAITING and self.error is None:
                self.consumer_waiting = t0
                self._await(pos, 1)
                try:
                    while self.state[pos] == WAITING and self.error is None and running():
                        self.cond.wait(0.5)
                finally:
                    self._await(pos, -1)
                self.consumer_waiting = 0.0
            waited = time.monotonic() - t0
            self.stats.wait_s += waited
            if pos == 0:
                self.stats.first_wait_s = waited
            if self.state[pos] == WAITING:
                raise self.error or S5LoaderError(
                    "this staging pass was closed: a newer iterator over the same S5Sampler "
                    "replaced it, or close() was called"
                )
            return self._take(pos)

    def poll(self, pos: int, timeout: float) -> bool | None:
        """Like :meth:`wait` with a timeout, and without flagging a waiting consumer."""
        with self.cond:
            if self.state[pos] == WAITING and self.error is None and timeout > 0:
                self._await(pos, 1)
                try:
                    self.cond.wait(timeout)
                finally:
                    self._await(pos, -1)
            if self.state[pos] == WAITING:
                if self.error is not None:
                    raise self.error
                return None
            return self._take(pos)

    def _await(self, pos: int, more: int) -> None:
        n = self._awaited.get(pos, 0) + more
        if n:
            self._awaited[pos] = n
        else:
            del self._awaited[pos]

    def _take(self, pos: int) -> bool:
        ready = self.state[pos] == READY
        self.n_taken += ready
        return ready

    def mark(self, pos: int, state: int = READY) -> None:
        with self.cond:
            self.n_ready += state == READY and self.state[pos] != READY
            self.state[pos] = state
            if pos in self._awaited:
                self.cond.notify_all()

    def ready(self) -> list[int]:
        """The positions whose samples are staged."""
        with self.cond:
            return [p for p, s in enumerate(self.state) if s == READY]

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            self.error = exc
            self.cond.notify_all()


class Outstanding:
    """The fields each sample in flight still waits for, and their sum (for the metrics)."""

    def __init__(self) -> None:
        self.left: dict[int, int] = {}
        self.objects = 0

    def __contains__(self, pos: int) -> bool:
        return pos in self.left

    def start(self, pos: int, fields: int) -> None:
        self.forget(pos)
        self.left[pos] = fields
        self.objects += fields

    def forget(self, pos: int) -> None:
        self.objects -= self.left.pop(pos, 0)

    def done(self, pos: int) -> bool:
        """One field of ``pos`` is staged: True when it was the sample's last. A late answer
        for a sample already retried or given up counts for nothing."""
        if pos not in self.left:
            return False
        left = self.left[pos] - 1
        self.objects -= 1
        if left:
            self.left[pos] = left
            return False
        del self.left[pos]
        return True
