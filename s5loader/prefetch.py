"""The prefetch daemon from Python: :class:`Prefetcher` runs ``s5loader prefetch`` in a
background process for as long as a ``with`` block, for notebooks and scripts that want the
cache without a second terminal."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Generator, Iterator, Sequence
from typing import Any

from ._daemon.flags import staging_to_args
from ._sampling.order import check_shuffle
from ._util.platform import die_with_parent
from .config import Access, StagingOptions
from .consume import ReadySample, consume
from .exceptions import ConfigError, DaemonError

log = logging.getLogger(__name__)


def _stop_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    # SIGTERM, not SIGKILL: the daemon then stops cleanly (kills s5cmd, removes partial files).
    die_with_parent(signal.SIGTERM)


class Prefetcher:
    """Runs the prefetch daemon (``python -m s5loader prefetch``) in a background process.

    ``with Prefetcher(...) as p:`` starts the daemon and returns once it runs (the source is
    listed and the cache locked); leaving the block stops it (SIGTERM, then SIGKILL after
    ``stop_timeout`` seconds), which also stops its s5cmd processes. Samples already delivered
    stay in the cache, and a new ``Prefetcher`` with the same arguments continues where this
    one stopped (see the daemon's restart promise).

    Args:
        source: ``s3://bucket/prefix/`` or a JSON Lines manifest (local path or s3 URI).
        options: the staging options (:class:`~s5loader.StagingOptions`, the object every front
            end takes; ``budget`` is the most bytes in the cache); ``staging_dir``,
            ``keep_staged``, ``shrink_budget`` and ``keep_epoch_cache`` are not the daemon's.
        cache: the cache directory (created if needed; empty, or a cache of this source).
        group_by, shuffle, seed, epochs, fresh: the daemon's options of the same names;
            ``shuffle`` is True, False or ``"block"``.
        access: how to reach the store (:class:`~s5loader.Access`), passed as the daemon's
            access flags; ``endpoint_url`` alone is a shorthand for it.
        extra_args: more command-line options for ``s5loader prefetch``, passed as they are.
        start_timeout: seconds to wait for the daemon to run (listing a large prefix takes
            a while).
        stop_timeout: seconds between SIGTERM and SIGKILL on exit.
        **staging: any field of :class:`~s5loader.StagingOptions`, overriding ``options``'
            (``budget="8GiB"``, ``samples_per_call=100``, ...).

    Raises:
        ConfigError: an invalid option or timeout.
        DaemonError: from :meth:`start`, the daemon exited or did not start in time (with
            its exit code and the end of its log); from iteration or :meth:`wait`, it failed.
    """

    def __init__(
        self,
        source: str,
        options: StagingOptions | None = None,
        *,
        cache: str | os.PathLike[str],
        group_by: str = "stem",
        shuffle: bool | str = False,
        seed: int = 0,
        epochs: int = 1,
        endpoint_url: str | None = None,
        access: Access | None = None,
        fresh: bool = False,
        extra_args: Sequence[str] = (),
        start_timeout: float = 300.0,
        stop_timeout: float = 10.0,
        **staging: Any,
    ) -> None:
        if not start_timeout > 0 or not stop_timeout > 0:
            raise ConfigError(
                f"start_timeout and stop_timeout must be positive, got {start_timeout!r}, {stop_timeout!r}"
            )
        self.source = source
        self.cache = os.path.abspath(os.fspath(cache))
        self.options = StagingOptions.merge(options, staging, "Prefetcher")
        self.budget = self.options.budget
        check_shuffle(shuffle)
        argv = [
            source,
            "--cache",
            self.cache,
            "--group-by",
            group_by,
            "--seed",
            str(int(seed)),
            "--epochs",
            str(int(epochs)),
            "--no-progress",
            *staging_to_args(self.options),
        ]
        argv += Access.coerce(access, endpoint_url).to_args()
        argv += ["--shuffle", "block"] if shuffle == "block" else ["--shuffle"] if shuffle else []
        argv += ["--fresh"] if fresh else []
        self.argv = argv + list(extra_args)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._workdir: str | None = None
        self._loops: weakref.WeakSet[Generator[ReadySample, None, None]] = weakref.WeakSet()

    @property
    def pid(self) -> int | None:
        """The daemon's process id, while it was started."""
        return self.proc.pid if self.proc is not None else None

    # -- starting ----------------------------------------------------------------------------
    def start(self) -> Prefetcher:
        """Start the daemon and wait until it runs. Calling it again does nothing.

        Raises:
            DaemonError: the daemon exited first, or did not run within ``start_timeout``.
        """
        if self.proc is not None:
            return self
        self._workdir = tempfile.mkdtemp(prefix="s5loader-prefetcher-")
        events = os.path.join(self._workdir, "events.jsonl")
        cmd = [sys.executable, "-m", "s5loader", "prefetch", *self.argv, "--json-log", events]
        main_thread = threading.current_thread() is threading.main_thread()
        with open(self._log_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                # The daemon stops when the thread that started it dies: only the main thread
                # lives as long as this process.
                preexec_fn=_stop_with_parent if main_thread else None,  # noqa: PLW1509
            )
        log.info(
            "started the prefetch daemon (pid %d) for %s into %s", self.proc.pid, self.source, self.cache
        )
        deadline = time.monotonic() + self.start_timeout
        try:
            while not self._started(events):
                rc = self.proc.poll()
                if rc is not None:
                    raise DaemonError(
                        f"the prefetch daemon for {self.source} exited with code {rc} before it ran: "
                        f"{self._log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise DaemonError(
                        f"the prefetch daemon for {self.source} did not run within {self.start_timeout:g}s: "
                        f"{self._log_tail()}"
                    )
                time.sleep(0.02)
        except BaseException:
            self.close()
            raise
        return self

    @property
    def _log_path(self) -> str:
        assert self._workdir is not None
        return os.path.join(self._workdir, "daemon.log")

    @staticmethod
    def _started(events: str) -> bool:
        try:
            with open(events, encoding="utf-8") as f:
                return any(json.loads(line).get("event") == "start" for line in f if line.endswith("\n"))
        except FileNotFoundError:
            return False

    def _log_tail(self, n: int = 2000) -> str:
        try:
            with open(self._log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode("utf-8", "replace").strip() or "(no output)"
        except (OSError, AssertionError):
            return "(no output)"

    # -- reading -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[ReadySample]:
        return self.samples()

    def samples(self, *, timeout: float | None = None) -> Iterator[ReadySample]:
        """Yield the delivered samples in order, deleting each when the loop moves on (as
        :func:`~s5loader.consume`), until the daemon has delivered everything. :meth:`close`
        ends the loops still open, which hands their current samples back to the cache.

        Raises:
            DaemonError: the daemon failed (its exit code and the end of its log).
            StallError: ``timeout`` seconds passed without a sample.
        """
        self.start()
        loop = consume(self.cache, timeout=timeout, finished=self._finished)
        assert isinstance(loop, Generator)
        self._loops.add(loop)
        return loop

    def _finished(self) -> bool:
        """For :func:`consume` while no sample is ready: True once the daemon has ended."""
        proc = self.proc
        if proc is None:
            return True
        rc = proc.poll()
        if rc is None:
            return False
        if rc != 0:
            raise DaemonError(
                f"the prefetch daemon for {self.source} failed with exit code {rc}: {self._log_tail()}"
            )
        return True

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the daemon to deliver everything and exit; its exit code (0).

        Raises:
            DaemonError: the daemon failed.
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        self.start()
        assert self.proc is not None
        rc = self.proc.wait(timeout)
        self._finished()
        return rc

    @property
    def log(self) -> str:
        """The end of the daemon's log (its stderr)."""
        return self._log_tail(8000) if self._workdir is not None else ""

    # -- stopping ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the daemon: SIGTERM, then SIGKILL after ``stop_timeout``; end the loops over
        its samples still open (their current samples go back to the cache). Safe to call twice."""
        for loop in list(self._loops):
            with contextlib.suppress(ValueError):  # running in another thread: it ends with the daemon
                loop.close()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                log.warning(
                    "the prefetch daemon (pid %d) did not stop within %gs; killing it",
                    proc.pid,
                    self.stop_timeout,
                )
                proc.kill()
                proc.wait()
        workdir, self._workdir = self._workdir, None
        if workdir is not None:
            for name in os.listdir(workdir):
                os.unlink(os.path.join(workdir, name))
            os.rmdir(workdir)

    def __enter__(self) -> Prefetcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Prefetcher({self.source!r}, cache={self.cache!r}, budget={self.budget}, pid={self.pid})"
