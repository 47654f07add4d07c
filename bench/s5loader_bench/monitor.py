"""CPU seconds of the process tree, split into s5cmd, the training process and the DataLoader
workers, and the tree's peak memory.

:class:`TreeMonitor` samples the tree from a thread; :class:`CpuSplit` turns the samples into
CPU seconds per kind of process (a pure computation, tested on made-up trees).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

KINDS = ("s5cmd", "main", "workers", "unattributed")
EXCLUDED = "excluded"  # a process followed so that its CPU is told apart, and left out
_ALL = (*KINDS, EXCLUDED)


@dataclass(frozen=True)
class ProcTimes:
    """One live descendant at one sample."""

    key: tuple[int, float]  # (pid, create time): a pid can be reused
    kind: str  # "s5cmd", "workers" or EXCLUDED
    own: float  # its own user + system CPU seconds
    reaped: float  # its reaped children's (``children_user + children_system``)


class CpuSplit:
    """CPU seconds per kind of process from samples of the tree, since the first sample.

    A sample has the training process's own CPU (all its threads but the monitor's), its reaped
    children's CPU (``RUSAGE_CHILDREN``) and every live descendant's own and reaped children's
    CPU. The tree's total at a sample counts every process once: a live one by itself, a
    finished one inside the reaped figure of the process that waited for it. A live
    descendant's own CPU goes to its kind, and a finished one keeps what it had at its last
    sample. What the total grew by beyond that in an interval (a finished process's CPU after
    its last sample, one that lived and ended between two samples, a live process's newly
    reaped children) goes to the kinds of the processes that ended in that interval, in
    proportion to their CPU; when none did, it is reported as ``unattributed``. Processes of
    kind ``EXCLUDED`` are followed the same way and left out of the result.
    """

    def __init__(self) -> None:
        self._base_total: float | None = None
        self._base_main = 0.0
        self._base_own: dict[tuple[int, float], float] = {}
        self._live: dict[tuple[int, float], ProcTimes] = {}
        self._main = 0.0
        self._done = dict.fromkeys(_ALL, 0.0)  # ended processes and distributed remainders
        self.samples = 0

    def _live_part(self) -> dict[str, float]:
        out = dict.fromkeys(_ALL, 0.0)
        out["main"] = self._main - self._base_main
        for key, p in self._live.items():
            out[p.kind] += p.own - self._base_own.get(key, 0.0)
        return out

    def add(self, main_own: float, main_reaped: float, procs: Iterable[ProcTimes]) -> None:
        """One sample of the tree."""
        now = {p.key: p for p in procs}
        total = main_own + main_reaped + sum(p.own + p.reaped for p in now.values())
        self.samples += 1
        if self._base_total is None:
            self._base_total, self._base_main, self._main = total, main_own, main_own
            self._base_own = {k: p.own for k, p in now.items()}
            self._live = now
            return
        ended = {k: p for k, p in self._live.items() if k not in now}
        weights = dict.fromkeys(_ALL, 0.0)
        for key, p in ended.items():
            share = max(p.own - self._base_own.get(key, 0.0), 0.0)
            self._done[p.kind] += share
            weights[p.kind] += share + 1e-6  # a process that ended idle still takes a share
        self._live, self._main = now, max(main_own, self._main)
        accounted = sum(self._live_part().values()) + sum(self._done.values())
        rest = (total - self._base_total) - accounted
        if rest > 0:
            wsum = sum(weights.values())
            if wsum > 0:
                for kind, w in weights.items():
                    self._done[kind] += rest * w / wsum
            else:
                self._done["unattributed"] += rest

    def result(self) -> dict[str, float]:
        """CPU seconds per kind (``s5cmd``, ``main``, ``workers``, ``unattributed``)."""
        live = self._live_part()
        return {k: max(live[k] + self._done[k], 0.0) for k in KINDS}


def process_kind(p: psutil.Process) -> str:
    """``s5cmd`` for an s5cmd process (by name or by its program), else ``workers``: a
    DataLoader worker or anything else the training process or its workers started."""
    try:
        if p.name() == "s5cmd":
            return "s5cmd"
        cmd = p.cmdline()
        return "s5cmd" if cmd and os.path.basename(cmd[0]) == "s5cmd" else "workers"
    except psutil.Error:
        return "workers"


class TreeMonitor:
    """CPU seconds, split by :class:`CpuSplit`, and peak memory of this process and the
    descendants it starts while it runs: the ``exclude`` pids and processes already running at
    :meth:`start` (a local S3 server started by the same program, the request-counting proxy)
    are not the measured method's.

    A thread samples the tree every ``interval`` seconds (0.2): this process's CPU
    (``os.times``, less the sampling thread's own), its reaped children's
    (``getrusage(RUSAGE_CHILDREN)``), every live descendant found recursively with psutil (its
    own CPU and its reaped children's), and the memory (sum of PSS, or RSS where PSS cannot be
    read).
    """

    def __init__(self, interval: float = 0.2, exclude: Iterable[int] = ()) -> None:
        self.interval = interval
        self.exclude = set(exclude)
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._own_cpu = 0.0  # the sampling thread's CPU: not counted
        self._kinds: dict[tuple[int, float], str] = {}
        self.split = CpuSplit()
        self.peak_mem = 0

    def _sample(self) -> None:
        with self._lock:
            t = os.times()
            main_own = t.user + t.system - self._own_cpu
            mem = self._memory(self._proc)
            try:
                children = self._proc.children(recursive=True)
            except psutil.Error:
                children = []
            procs = []
            for c in children:
                try:
                    key = (c.pid, c.create_time())
                    kind = (
                        EXCLUDED
                        if c.pid in self.exclude
                        else (self._kinds.get(key) or self._kinds.setdefault(key, process_kind(c)))
                    )
                    ct = c.cpu_times()
                    procs.append(
                        ProcTimes(key, kind, ct.user + ct.system, ct.children_user + ct.children_system)
                    )
                    if kind != EXCLUDED:
                        mem += self._memory(c)
                except psutil.Error:
                    pass
            self.split.add(main_own, t.children_user + t.children_system, procs)
            self.peak_mem = max(self.peak_mem, mem)

    @staticmethod
    def _memory(p: psutil.Process) -> int:
        try:
            return int(getattr(p.memory_full_info(), "pss", 0)) or p.memory_info().rss
        except (psutil.AccessDenied, AttributeError):
            return p.memory_info().rss
        except psutil.Error:
            return 0

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._own_cpu = time.thread_time()
            self._sample()
        self._own_cpu = time.thread_time()

    def start(self) -> TreeMonitor:
        try:
            self.exclude |= {c.pid for c in self._proc.children(recursive=True)}
        except psutil.Error:
            pass
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="s5loader-bench-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> tuple[float, int]:
        """Stop sampling; returns (CPU seconds since :meth:`start`, peak bytes). The split is
        in :meth:`cpu_split`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        return sum(self.split.result().values()), self.peak_mem

    def cpu_split(self) -> dict[str, float]:
        """CPU seconds since :meth:`start` per kind: ``s5cmd``, ``main``, ``workers``, ``unattributed``."""
        return self.split.result()
