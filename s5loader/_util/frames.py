"""The one channel between the processes of one loader: length-prefixed JSON frames over a Unix
socket, never a pickle, and only with the loader's own processes, by the credentials the kernel
gives for a socket's other end (``SO_PEERCRED``).

Two front ends use it: the iterable's feed (:mod:`s5loader._sampling.feed`, a rank's host to
its DataLoader workers) and the sampler's words on samples handed out before they were staged
(:mod:`s5loader._staging.words`, the sampler's process to its DataLoader workers).

* A frame is a 4-byte big-endian length and that many bytes of JSON, at most :data:`MAX_FRAME`;
  the feed sends its messages as lists of them, as many to a frame as fit (:func:`frames_of`).
* A message is ``[kind, payload]``: :data:`INDEX` (a sample), :data:`SKIP`, :data:`END`, or
  :data:`ERROR` with ``[module, type name, message]``, raised again as the same s5loader or
  built-in type (:func:`error_data`, :func:`error_of`).
* Who may be at the other end (:func:`peer_problem`): a process of the same user, and of the
  same loader: this process, a sibling (DataLoader workers are the children of one process), a
  descendant (the sampler's readers) or an ancestor (their sampler), as each side expects.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import socket
import struct
from typing import Any

from .. import exceptions
from ..exceptions import S5LoaderError
from .procs import parent_of, proc_is_ours

_LEN = struct.Struct(">I")  # a frame's length

# Messages: (kind, payload)
INDEX, SKIP, END, ERROR = "i", "s", "e", "x"

#: The largest frame either side accepts (a staged index with its folder takes a few hundred).
MAX_FRAME = 1 << 16

# An error's message crosses cut to this many characters, so that its frame stays well within
# MAX_FRAME whatever the error says (its start names what failed).
MAX_MESSAGE = 8192

# How far up the process tree a loader's process may be from another (a forkserver's workers are
# the grandchildren of the process that started the loader).
_KIN_DEPTH = 8


class FrameError(ValueError):
    """A frame that is not one of the channel's: too long, not JSON, or not the expected shape."""


def frame(obj: Any) -> bytes:
    data = dumps(obj)
    return _LEN.pack(len(data)) + data


def dumps(obj: Any) -> bytes:
    """``obj`` as the JSON a frame carries (see :func:`frames_of`)."""
    return json.dumps(obj, separators=(",", ":")).encode()


def frames_of(items: list[bytes]) -> bytes:
    """The JSON values ``items`` (each from :func:`dumps`, none longer than :data:`MAX_FRAME`
    less 2) as frames of JSON lists, in order, each list as long as fits in one frame: many
    messages cost one frame to read and one JSON value to parse."""
    groups: list[list[bytes]] = [[]]
    size = 1  # the list's brackets, and a comma per item
    for item in items:
        if groups[-1] and size + len(item) + 1 > MAX_FRAME:
            groups.append([])
            size = 1
        groups[-1].append(item)
        size += len(item) + 1
    bodies = [b"[" + b",".join(g) + b"]" for g in groups if g]
    return b"".join(_LEN.pack(len(body)) + body for body in bodies)


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


class Inbox:
    """What a socket's reader received and has not read yet: one receive can bring several
    frames, so whether a whole one is here is asked before the socket is waited on."""

    def __init__(self) -> None:
        self.data = bytearray()

    def take(self) -> Any:
        """The next whole frame's JSON value, or :data:`NOTHING` while it is not all here.

        Raises:
            FrameError: a frame longer than :data:`MAX_FRAME`, or not JSON.
        """
        if len(self.data) < _LEN.size:
            return NOTHING
        end = _LEN.size + _LEN.unpack_from(self.data)[0]
        if end - _LEN.size > MAX_FRAME:
            raise FrameError(f"a frame of {end - _LEN.size} bytes, more than {MAX_FRAME}")
        if len(self.data) < end:
            return NOTHING
        whole = bytes(self.data[_LEN.size : end])
        del self.data[:end]
        try:
            return json.loads(whole)
        except ValueError as exc:
            raise FrameError(f"a frame that is not JSON: {exc}") from None


#: What :meth:`Inbox.take` returns while no whole frame is there.
NOTHING = object()


def error_data(exc: BaseException) -> list[str]:
    """An error as plain data: its type's module and name, and its message (cut to
    :data:`MAX_MESSAGE` characters)."""
    t = type(exc)
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - an exception whose message cannot be made: its type says it
        message = f"({t.__name__} whose message could not be read)"
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + " [...]"
    return [t.__module__, t.__name__, message]


def error_of(payload: Any) -> BaseException:
    """The error :func:`error_data` made: the s5loader type of that name (from
    ``s5loader.exceptions``), else the built-in exception type, else an
    :class:`~s5loader.exceptions.S5LoaderError` that names the type.

    Raises:
        FrameError: not an error's data.
    """
    if not (isinstance(payload, list) and len(payload) == 3 and all(isinstance(x, str) for x in payload)):
        raise FrameError(f"an error that is not one: {str(payload)[:80]!r}")
    module, name, message = payload
    kind = getattr(exceptions, name, None) if module == exceptions.__name__ else None
    if isinstance(kind, type) and issubclass(kind, S5LoaderError):
        return kind(message)
    kind = getattr(builtins, name, None) if module == "builtins" else None
    if isinstance(kind, type) and issubclass(kind, Exception):
        with contextlib.suppress(Exception):
            return kind(message)
    return S5LoaderError(f"{module}.{name}: {message}")


def _kin(pid: int, of: int) -> bool:
    """Whether process ``of`` is ``pid`` or one of its ancestors, within :data:`_KIN_DEPTH`."""
    for _ in range(_KIN_DEPTH):
        if pid == of:
            return True
        parent = parent_of(pid) if pid > 1 else None  # (the training process may be PID 1)
        if parent is None:
            return False
        pid = parent
    return False


def peer_of(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of the Unix socket ``sock``, as the
    kernel gives them (of the process that connected, or that listened)."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def peer_problem(sock: socket.socket, kin: str = "sibling") -> str | None:
    """Why the process at the other end of ``sock`` is not one of this loader's processes, or
    None when it is: the same user, and this process or, as ``kin`` says, a ``"sibling"`` (the
    same parent), a ``"descendant"`` or an ``"ancestor"`` of it. Where ``/proc`` is not this
    pid namespace's, only the user is checked (the loader's sockets are its own then)."""
    pid, uid = peer_of(sock)
    if uid != os.getuid():
        return f"a process of another user (pid {pid}, uid {uid})"
    me = os.getpid()
    if pid == me or not proc_is_ours():
        return None
    if kin == "descendant":
        return None if _kin(pid, me) else f"pid {pid}, which this process {me} did not start"
    if kin == "ancestor":
        return None if _kin(me, pid) else f"pid {pid}, which did not start this process {me}"
    parent, ours = parent_of(pid), os.getppid()  # an identity check (siblings), not a liveness one
    if parent != ours:
        return f"pid {pid}, whose parent is {parent}, not this loader's process {ours}"
    return None


def unix_address(folder: str, name: str) -> tuple[str, int | None]:
    """The address of the socket ``name`` in ``folder`` and a descriptor to close once the
    socket is bound or connected (None where none was opened): the path itself, or, where it
    is longer than a socket address holds, the path through ``/proc/self/fd`` of the folder
    opened."""
    path = os.path.join(folder, name)
    if len(os.fsencode(path)) < 100:
        return path, None
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{fd}/{name}", fd


def close_fd(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)
