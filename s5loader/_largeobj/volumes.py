"""How ``s5loader fetch`` moves objects through a small disk: its work directory inside the
destination (every transfer registered, so one stop kills them all), and the volumes of a
split archive read once, joined, as one file, at most a budget of them on disk at a time."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import threading
from collections.abc import Callable
from typing import IO

from .._s5cmd import ObjectInfo, S5cmd, kill, start_cat
from .._staging.area import register_cleanup
from ..exceptions import FetchError
from . import transfer as _transfer
from . import verify as _verify
from .parts import plan_parts

log = logging.getLogger(__name__)

WORK_PREFIX = ".s5loader-fetch-"
_WAKE_S = 0.5  # the longest the reading thread sleeps between looks (see Volumes._next)


class FetchWork:
    """``DEST/.s5loader-fetch-TOKEN/``: everything lands here first. :meth:`close` kills
    the transfers still running and removes the directory; it runs at the end, on errors,
    KeyboardInterrupt and SIGTERM."""

    def __init__(self, dest_dir: str) -> None:
        self.path = os.path.join(dest_dir, WORK_PREFIX + secrets.token_hex(4))
        os.makedirs(self.path, mode=0o700)
        self.procs: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()
        self.stopped = False
        self._pid = os.getpid()
        register_cleanup(self)

    def kill(self) -> None:
        """Kill the transfers still running."""
        with self._lock:
            self.stopped = True
            procs, self.procs = list(self.procs), set()
        for proc in procs:
            kill(proc)

    def start(self, fn: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        with self._lock:
            if self.stopped:
                raise FetchError("the fetch was stopped")
            proc = fn()
            self.procs.add(proc)
        return proc

    def close(self) -> None:
        if os.getpid() != self._pid:
            return
        self.kill()
        shutil.rmtree(self.path, ignore_errors=True)


def poll_progress(
    progress: Callable[[int, int], None] | None, done: Callable[[], int], total: int
) -> Callable[[], None]:
    """Call ``progress(done(), total)`` every half second in a thread; returns its stop."""
    if progress is None:
        return lambda: None
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.5):
            progress(min(done(), total), total)

    t = threading.Thread(target=loop, daemon=True, name="s5loader-fetch-progress")
    t.start()

    def end() -> None:
        stop.set()
        t.join()

    return end


class Volumes:
    """The volumes, joined, as one file to read once: each is read from its staged file (or
    from ``s5cmd cat`` when larger than the budget), checked at its end and deleted."""

    def __init__(
        self,
        objects: list[ObjectInfo],
        checkers: dict[str, _verify.Checker | None],
        s5: S5cmd,
        work: FetchWork,
        budget: int,
        concurrency: int,
        part: int,
    ) -> None:
        self.objects, self.checkers, self.s5, self.work = objects, checkers, s5, work
        self.budget, self.concurrency, self.part = budget, concurrency, part
        self.dir = os.path.join(work.path, "volumes")
        os.makedirs(self.dir)
        self.cond = threading.Condition()
        self.ready: dict[int, str] = {}  # index -> staged path ("" = stream it)
        self.reserved = self.peak = self.read_bytes = 0
        self.error: BaseException | None = None
        self.closed_ = False
        self.index = -1
        self.cur: IO[bytes] | None = None
        self.cur_proc: subprocess.Popen[bytes] | None = None
        self.thread = threading.Thread(
            target=self._download_ahead, daemon=True, name="s5loader-fetch-volumes"
        )
        self.thread.start()

    # --- the downloader thread
    def _download_ahead(self) -> None:
        try:
            for i, o in enumerate(self.objects):
                if o.size > self.budget:
                    with self.cond:
                        self.ready[i] = ""
                        self.cond.notify_all()
                    continue
                with self.cond:
                    while self.reserved and self.reserved + o.size > self.budget and not self.closed_:
                        self.cond.wait()
                    if self.closed_:
                        return
                    self.reserved += o.size
                    self.peak = max(self.peak, self.reserved)
                path = os.path.join(self.dir, f"{i:06d}")
                proc = self.work.start(
                    lambda o=o, path=path: _transfer.s5cmd_copy(  # type: ignore[misc]
                        self.s5, o.uri, path, size=o.size, concurrency=self.concurrency, part_size=self.part
                    )
                )
                _transfer.run(proc, o.uri)
                with self.cond:
                    self.ready[i] = path
                    self.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the reading thread
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    # --- the reading side
    def _next(self) -> bool:
        self._end_current()
        self.index += 1
        if self.index >= len(self.objects):
            return False
        with self.cond:
            while self.index not in self.ready and self.error is None:
                # with a timeout: a Ctrl-C or SIGTERM whose C handler ran just before this thread
                # (the main one) blocked runs its Python handler at the next wake-up, not never
                self.cond.wait(_WAKE_S)
            if self.index not in self.ready:
                assert self.error is not None
                raise self.error
            path = self.ready[self.index]
        o = self.objects[self.index]
        if path:
            self.cur = open(path, "rb")  # noqa: SIM115 - closed in _end_current
        else:
            log.info("%s is larger than the budget: reading it straight from the store", o.uri)
            plan = plan_parts(o.size, part_size=self.part, concurrency=self.concurrency)
            self.cur_proc = self.work.start(
                lambda: start_cat(
                    self.s5, o.uri, concurrency=plan.concurrency, part_size=plan.part_size, size=o.size
                )
            )
            self.cur = self.cur_proc.stdout
        return True

    def _end_current(self) -> None:
        if self.cur is None:
            return
        o = self.objects[self.index]
        if self.cur_proc is not None:
            proc, self.cur_proc = self.cur_proc, None
            _transfer.run(proc, o.uri)
        else:
            self.cur.close()
            path = self.ready.get(self.index, "")
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            with self.cond:
                self.reserved -= o.size
                self.cond.notify_all()
        self.cur = None
        checker = self.checkers[o.uri]
        if checker is not None:
            checker.check()

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = 1 << 20
        while True:
            if self.cur is None and not self._next():
                return b""
            assert self.cur is not None
            data = self.cur.read(n)
            if data:
                self.read_bytes += len(data)
                checker = self.checkers[self.objects[self.index].uri]
                if checker is not None:
                    checker.update(data)
                return data
            self._end_current()

    def finish(self) -> None:
        """Read whatever the extractor left (tar padding), so every volume is checked."""
        while self.read(1 << 20):
            pass

    def close(self) -> None:
        with self.cond:
            self.closed_ = True
            self.cond.notify_all()
        if self.cur is not None:
            self.cur.close()
            self.cur = None
