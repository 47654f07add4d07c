"""What crosses between a rank's staging host and its DataLoader workers (see :mod:`.feed`), and
who may take part: plain data in length-prefixed JSON frames, never a pickle, and only the
processes of one loader, by the credentials the kernel gives for a Unix socket's other end.

* A frame is a 4-byte big-endian length and that many bytes of JSON, at most :data:`MAX_FRAME`.
* A worker's hello is ``[worker, num_workers, epoch, start, plan, key]`` (ints, the plan's
  ints, bools, strings and nulls, and the loader's key: a secret the dataset drew when it was
  made, which its workers got with their copy of it and which no other process can read).
* A host's message is ``[kind, payload]``: a staged index as ``[int, folder, keep, back, frees,
  early]`` (the folder must lie in the rank's staging area), a skip, the end, or an error as
  ``[type name, message]``, raised again as the same s5loader or built-in type.
* The other end of a connection is one of the loader's processes when it is of the same user
  and is this process or a sibling (the same parent: DataLoader workers are the children of
  one process); the host also refuses a hello without the loader's key, so a process that only
  shares the parent (an orphan that PID 1 adopted, where the training process is PID 1 in a
  container) is refused too.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import json
import os
import socket
import struct
from typing import Any, NamedTuple

from .. import exceptions
from .._staging.reader import StagedIndex
from .._util.procs import parent_of, proc_is_ours
from ..exceptions import S5LoaderError

_LEN = struct.Struct(">I")  # a frame's length

# Messages, host to worker: (kind, payload)
INDEX, SKIP, END, ERROR = "i", "s", "e", "x"


class Hello(NamedTuple):
    """What a worker tells its host when its pass begins."""

    worker: int
    num_workers: int
    epoch: int
    start: int  # samples of the worker's share handed out (or skipped) before this pass
    plan: tuple[Any, ...]  # the order's settings (shuffle, seed, shuffle_buffer, drop_last, chunk)
    key: str = ""  # the loader's secret (see the module docstring)


#: The largest frame either side accepts (a staged index with its folder takes a few hundred).
MAX_FRAME = 1 << 16


class FrameError(ValueError):
    """A frame that is not one of the feed's: too long, not JSON, or not the expected shape."""


def frame(obj: Any) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return _LEN.pack(len(data)) + data


def read(f: Any) -> Any:
    """The next frame's JSON value.

    Raises:
        EOFError: the other side closed.
        FrameError: a frame longer than :data:`MAX_FRAME`, or not JSON.
    """
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError
    size = _LEN.unpack(head)[0]
    if size > MAX_FRAME:
        raise FrameError(f"a frame of {size} bytes, more than {MAX_FRAME}")
    data = f.read(size)
    if len(data) < size:
        raise EOFError
    try:
        return json.loads(data)
    except ValueError as exc:
        raise FrameError(f"a frame that is not JSON: {exc}") from None


def encode(msg: tuple[str, Any]) -> list[Any]:
    """A host's message as plain data: a staged index as its int, folder and flags; an error as
    its type's name and message."""
    kind, payload = msg
    if kind == INDEX:
        if isinstance(payload, StagedIndex):
            s = payload
            return [kind, [int(s), s.folder, s.keep, s.back, s.frees, s.early]]
        return [kind, [int(payload)]]
    if kind == ERROR:
        t = type(payload)
        try:
            message = str(payload)
        except Exception:  # noqa: BLE001 - an exception whose message cannot be made: its type says it
            message = f"({t.__name__} whose message could not be read)"
        if len(message) > MAX_MESSAGE:
            message = message[:MAX_MESSAGE] + " [...]"
        return [kind, [t.__module__, t.__name__, message]]
    return [kind, None]


# An error's message crosses cut to this many characters, so that its frame stays well within
# MAX_FRAME whatever the error says (its start names what failed).
MAX_MESSAGE = 8192


def _error(module: str, name: str, message: str) -> BaseException:
    """The error a host sent: the s5loader type of that name (from ``s5loader.exceptions``), else
    the built-in exception type, else an :class:`~s5loader.exceptions.S5LoaderError` that names
    the type."""
    kind = getattr(exceptions, name, None) if module == exceptions.__name__ else None
    if isinstance(kind, type) and issubclass(kind, S5LoaderError):
        return kind(message)
    kind = getattr(builtins, name, None) if module == "builtins" else None
    if isinstance(kind, type) and issubclass(kind, Exception):
        with contextlib.suppress(Exception):
            return kind(message)
    return S5LoaderError(f"{module}.{name}: {message}")


def _flag(v: Any) -> bool:
    if not isinstance(v, bool):
        raise FrameError(f"a flag that is not a bool: {v!r}")
    return v


@functools.lru_cache(maxsize=64)
def _inside(folder: str, root: str) -> bool:
    """Whether ``folder`` lies in ``root``, links resolved; asked once per pass folder, not per
    sample (a pass's samples share its folder)."""
    real = os.path.realpath(root)
    return os.path.commonpath([os.path.realpath(folder), real]) == real


def decode(raw: Any, root: str | None) -> tuple[str, Any]:
    """A host's message from plain data (see :func:`encode`); a staged index's folder must lie in
    ``root``, the rank's staging area, where one is given.

    Raises:
        FrameError: not a message of the feed.
    """
    if not (isinstance(raw, list) and len(raw) == 2 and raw[0] in (INDEX, SKIP, END, ERROR)):
        raise FrameError(f"not a message of the feed: {str(raw)[:80]!r}")
    kind, payload = raw
    if kind == INDEX:
        if not (isinstance(payload, list) and payload and type(payload[0]) is int and payload[0] >= 0):
            raise FrameError(f"a staged index that is not one: {str(payload)[:80]!r}")
        if len(payload) == 1:
            return kind, payload[0]
        if len(payload) != 6 or not isinstance(payload[1], str):
            raise FrameError(f"a staged index that is not one: {str(payload)[:80]!r}")
        folder = payload[1]
        if root is not None and not _inside(folder, root):
            raise FrameError(f"a staged index in {folder!r}, outside the staging area {root}")
        return kind, StagedIndex(payload[0], folder, *map(_flag, payload[2:]))
    if kind == ERROR:
        if not (isinstance(payload, list) and len(payload) == 3 and all(isinstance(x, str) for x in payload)):
            raise FrameError(f"an error that is not one: {str(payload)[:80]!r}")
        return kind, _error(*payload)
    return kind, None


def hello_bytes(hello: Hello) -> bytes:
    """A worker's hello, framed."""
    return frame([*hello[:4], list(hello.plan), hello.key])


def hello_of(raw: Any) -> Hello:
    """A worker's hello from plain data.

    Raises:
        FrameError: not a hello.
    """
    ok = isinstance(raw, list) and len(raw) == 6 and all(type(x) is int and x >= 0 for x in raw[:4])
    if not ok or not isinstance(raw[4], list) or not isinstance(raw[5], str):
        raise FrameError(f"not a hello: {str(raw)[:80]!r}")
    return Hello(raw[0], raw[1], raw[2], raw[3], tuple(raw[4]), raw[5])


def peer_problem(sock: socket.socket) -> str | None:
    """Why the process at the other end of ``sock`` is not one of this loader's processes, or
    None when it is: the same user, and this process or a sibling of it (the same parent)."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if uid != os.getuid():
        return f"a process of another user (pid {pid}, uid {uid})"
    if pid == os.getpid() or not proc_is_ours():
        return None
    parent, ours = parent_of(pid), os.getppid()  # an identity check (siblings), not a liveness one
    if parent != ours:
        return f"pid {pid}, whose parent is {parent}, not this loader's process {ours}"
    return None
