"""Running s5cmd: one process group per run, killed if this process dies, never started
while this process forks; listing a prefix; one large object in many parallel parts."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from .._util.platform import die_with_parent
from ..config import Access
from ..exceptions import EmptySourceError, S5cmdNotFoundError
from .binary import INSTALL_HINT, environment, find_s5cmd
from .commands import can_write
from .output import ObjectInfo, classify, error_for, last_error, looks_unreachable, ls_object

log = logging.getLogger(__name__)


def _set_pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    # The kernel kills the child when the thread that started it dies, so a loader that is
    # SIGKILLed cannot leave a downloader running behind it.
    die_with_parent(signal.SIGKILL)


_SETPRIV: list[str] | None = None  # see death_prefix


def death_prefix() -> list[str]:
    """``setpriv --pdeathsig KILL --`` where util-linux's ``setpriv`` runs a program so (tried
    once: it runs itself that way), else ``[]``. s5cmd started through it dies with the thread
    that started it, as with a ``preexec_fn`` that asks the kernel so (the fallback), but without
    a ``preexec_fn`` Python starts it with ``vfork``, which copies nothing of this process,
    where a ``fork`` copies its page tables with the GIL held, longer the more memory the
    training process maps. Called holding ``_spawn_lock`` (the trial is a start of its own, see
    below)."""
    global _SETPRIV
    if _SETPRIV is None:
        found, prefix = shutil.which("setpriv"), []
        if found is not None:
            trial = [found, "--pdeathsig", "KILL", "--", found, "--version"]
            try:
                ok = subprocess.run(trial, capture_output=True, timeout=10).returncode == 0
            except (OSError, subprocess.SubprocessError):
                ok = False
            prefix = [found, "--pdeathsig", "KILL", "--"] if ok else []
        _SETPRIV = prefix
    return _SETPRIV


# Starting s5cmd and forking this process (a DataLoader starting its workers) must not
# overlap. Until Popen returns it holds open the write end of the pipe on which the child
# reports its exec, and reads that pipe to its end; a process forked meanwhile by another
# thread keeps a copy of that write end (and of s5cmd's stdout and stderr) and never execs,
# so Popen would block until that process exits. A DataLoader worker exits only when its
# iterator shuts down, possibly after the main thread has begun to wait for the very thread
# that is starting s5cmd (closing a replaced staging pass): neither would ever go on. So a
# fork waits for a start in progress (milliseconds), and a start waits for a fork.
_spawn_lock = threading.RLock()
_fork_hooks_registered = False
# the forks under way in each thread that took the lock before them: a fork that began before
# the hooks were registered (by the first start, in another thread) ends without releasing
_forks = threading.local()


def _before_fork() -> None:
    _spawn_lock.acquire()
    _forks.held = getattr(_forks, "held", 0) + 1


def _after_fork_in_parent() -> None:
    if getattr(_forks, "held", 0):
        _forks.held -= 1
        _spawn_lock.release()


def _after_fork_in_child() -> None:
    global _spawn_lock
    _spawn_lock = threading.RLock()  # held by the forking thread in the parent only
    _forks.held = 0


def _register_fork_hooks() -> None:
    """Register the hooks once, at the first start (called holding ``_spawn_lock``).

    ``os.fork()`` runs "before" hooks newest first, so a fork meets this one before those of
    modules imported earlier (logging, concurrent.futures), which take locks of their own:
    it waits holding none of them, and the start it waits for can run them (its own fork,
    with a ``preexec_fn``, runs them too, in the starting thread, which already holds
    ``_spawn_lock``: hence a reentrant lock).
    """
    global _fork_hooks_registered
    if not _fork_hooks_registered:
        _fork_hooks_registered = True
        os.register_at_fork(
            before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
        )


@dataclass(frozen=True)
class S5cmd:
    """How to run s5cmd: the binary, the store's access settings and the worker count.
    Picklable. ``endpoint_url`` and ``access`` merge as :meth:`Access.coerce` does."""

    endpoint_url: str | None = None
    numworkers: int = 256
    retry_count: int = 3
    binary: str | None = None
    access: Access | None = None

    def path(self) -> str:
        return self.binary or find_s5cmd()

    @property
    def settings(self) -> Access:
        """The access settings in effect (``access`` with ``endpoint_url`` folded in)."""
        return Access.coerce(self.access, self.endpoint_url)

    def _argv(self, *args: str) -> list[str]:
        argv = [self.path(), "--json", "--retry-count", str(self.retry_count)]
        return argv + self.settings.s5cmd_flags() + list(args)

    def env(self) -> dict[str, str]:
        return environment(self.settings)

    def start(self, args: list[str], stdin: int | IO[bytes] | None = None) -> subprocess.Popen[bytes]:
        """Start s5cmd with ``args`` in a process group of its own, killed if we die."""
        argv = self._argv(*args)
        # checked here: through setpriv, Popen starts setpriv, whose exec of s5cmd fails later
        found = argv[0] if os.sep in argv[0] else shutil.which(argv[0])
        if found is None or not os.path.isfile(found) or not os.access(found, os.X_OK):
            raise S5cmdNotFoundError(f"cannot run {argv[0]!r}; {INSTALL_HINT}")
        env = self.env()
        # SIGINT blocked in this thread while it forks, so in the child until it runs s5cmd:
        # Ctrl-C sent to the process group between the fork and the exec would otherwise raise
        # KeyboardInterrupt in the child's at-fork hooks (a traceback on stderr). s5cmd, in a
        # session of its own, keeps it blocked: it is stopped by its parent, never by Ctrl-C.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # (as it is: restored below)
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            with _spawn_lock:
                _register_fork_hooks()
                prefix = death_prefix()
                return subprocess.Popen(
                    prefix + argv,
                    stdin=stdin if stdin is not None else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                    start_new_session=True,
                    preexec_fn=None if prefix else _set_pdeathsig,
                )
        except FileNotFoundError as exc:
            raise S5cmdNotFoundError(f"cannot run {argv[0]!r}; {INSTALL_HINT}") from exc
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def run_file(self, command_file: str, numworkers: int | None = None) -> subprocess.Popen[bytes]:
        """Start ``s5cmd run COMMAND_FILE`` in the background (with ``numworkers`` workers, by
        default :attr:`numworkers`)."""
        return self.start(["--numworkers", str(numworkers or self.numworkers), "run", command_file])

    def list(self, prefix_uri: str) -> Iterator[ObjectInfo]:
        """List every object under an ``s3://bucket/prefix`` (recursively) with ``ls --json``,
        yielding each object as its line arrives (the output is never held whole).

        Raises:
            NoSuchBucketError, AccessDeniedError, EndpointError, EmptySourceError, FetchError
        """
        if any(c in prefix_uri for c in "*?[") or not can_write(prefix_uri):
            raise _GlobInPrefix(prefix_uri)
        proc = self.start(["ls", prefix_uri + "*"])
        assert proc.stdout is not None and proc.stderr is not None
        err = proc.stderr
        tail: list[bytes] = []
        # stderr is read by a thread: a full stderr pipe would stop s5cmd while we read stdout
        drain = threading.Thread(target=lambda: tail.append(err.read()[-65536:]), daemon=True)
        drain.start()
        try:
            for line in proc.stdout:
                obj = ls_object(line)
                if obj is not None:
                    yield obj
            rc = proc.wait()
            drain.join()
        finally:
            # the caller stopped early, or an error: no s5cmd left behind, and the stderr
            # reader done before the pipes close
            kill_group(proc)
            drain.join(timeout=10)
            kill(proc)
        if rc != 0:
            msg = last_error(b"".join(tail).decode("utf-8", "replace")) or f"exit code {rc}"
            kind = classify(msg)
            if kind == "not_found":
                raise EmptySourceError(f"no object under {prefix_uri} ({msg})")
            if kind == "transient" and looks_unreachable(msg):
                kind = "endpoint"
            raise error_for(
                kind, f"cannot list {prefix_uri}: {msg} (s5cmd exit code {rc})", self.settings.endpoint()
            )


class _GlobInPrefix(Exception):
    """A prefix s5cmd's ``ls`` cannot express; the caller lists another way."""


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Send SIGKILL to s5cmd's process group without waiting for it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill s5cmd's whole process group and reap it. Safe to call twice."""
    kill_group(proc)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - a kernel that will not reap
        log.error("s5cmd (pid %d) did not exit after SIGKILL", proc.pid)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass


# One large object at a time, in many parallel parts: checkpoints and archive volumes.

MIN_PART_SIZE = 5 * 1024**2  # S3's smallest multipart part
MAX_PARTS = 10_000  # S3's most parts in one upload


AUTO_MAX_PART = 32 * 1024**2


def part_size_mib(part_size: int, object_size: int | None = None, concurrency: int = 1) -> int:
    """s5cmd's ``--part-size`` (whole MiB) for ``part_size`` bytes, raised where an object of
    ``object_size`` bytes would need more than S3's 10,000 parts. ``part_size=0`` picks one:
    the object split over the ``concurrency`` parallel requests, 5 to 32 MiB (small parts
    would leave requests idle on a small object; big ones cost a long tail on a large one)."""
    if part_size <= 0:
        part_size = min(AUTO_MAX_PART, (object_size or 16 * 1024**2 * concurrency) // max(1, concurrency))
    size = max(part_size, MIN_PART_SIZE)
    if object_size:
        size = max(size, -(-object_size // (MAX_PARTS - 100)))
    return -(-size // 1024**2)


def _part_args(concurrency: int, part_size: int, object_size: int | None) -> list[str]:
    concurrency = max(1, concurrency)
    return [
        "--concurrency",
        str(concurrency),
        "--part-size",
        str(part_size_mib(part_size, object_size, concurrency)),
    ]


def start_copy(
    s5: S5cmd, source: str, destination: str, *, concurrency: int, part_size: int, size: int | None = None
) -> subprocess.Popen[bytes]:
    """Start ``s5cmd cp --raw`` of one object (upload, download or server-side copy) in
    ``concurrency`` parallel parts of ``part_size`` bytes."""
    return s5.start(["cp", "--raw", *_part_args(concurrency, part_size, size), source, destination])


def start_pipe(
    s5: S5cmd, destination: str, *, concurrency: int, part_size: int, size: int | None = None
) -> subprocess.Popen[bytes]:
    """Start ``s5cmd pipe``: whatever is written to the process's stdin becomes the object
    ``destination`` when stdin is closed (a multipart upload for more than one part).

    s5cmd holds every part in flight in memory: the automatic part size is 8 MiB here and
    at most 16 parts are in flight, so a stream costs at most 128 MiB unless told otherwise."""
    if part_size <= 0:
        concurrency, part_size = min(concurrency, 16), 8 * 1024**2
    return s5.start(
        ["pipe", "--raw", *_part_args(concurrency, part_size, size), destination], stdin=subprocess.PIPE
    )


def start_cat(
    s5: S5cmd, source: str, *, concurrency: int, part_size: int, size: int | None = None
) -> subprocess.Popen[bytes]:
    """Start ``s5cmd cat``: the object's bytes, in order, on the process's stdout, fetched in
    ``concurrency`` parallel ranged requests."""
    return s5.start(["cat", "--raw", *_part_args(concurrency, part_size, size), source])
