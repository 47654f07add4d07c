"""What crosses between a rank's staging host and its DataLoader workers (see :mod:`.feed`), in
the loader's one channel (:mod:`s5loader._util.frames`: JSON frames over a Unix socket, never a
pickle, with only the loader's processes).

* A worker's hello is ``[worker, num_workers, epoch, start, plan, key]`` (ints, the plan's
  ints, bools, strings and nulls, and the loader's key: a secret the dataset drew when it was
  made, which its workers got with their copy of it and which no other process can read).
* A host's message is ``[kind, payload]``: a staged index as ``[int, folder, keep, back, frees,
  early]`` (the folder must lie in the rank's staging area), a skip, the end, or an error,
  raised again as the same s5loader or built-in type. A host's frame is a list of messages:
  those its writer found queued, as many as fit (:func:`~s5loader._util.frames.frames_of`).
* The other end of a connection is one of the loader's processes when it is of the same user
  and is this process or a sibling (the same parent: DataLoader workers are the children of
  one process); the host also refuses a hello without the loader's key, so a process that only
  shares the parent (an orphan that PID 1 adopted, where the training process is PID 1 in a
  container) is refused too.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

from .._staging.reader import StagedIndex
from .._util.frames import (
    END,
    ERROR,
    INDEX,
    MAX_FRAME,
    SKIP,
    FrameError,
    dumps,
    error_data,
    error_of,
    frame,
    frames_of,
    peer_problem,
    read,
)

__all__ = [
    "END",
    "ERROR",
    "INDEX",
    "MAX_FRAME",
    "SKIP",
    "FrameError",
    "Hello",
    "decode",
    "decode_frame",
    "dumps",
    "encode",
    "frame",
    "frames_of",
    "hello_bytes",
    "hello_of",
    "peer_problem",
    "read",
]


class Hello(NamedTuple):
    """What a worker tells its host when its pass begins."""

    worker: int
    num_workers: int
    epoch: int
    start: int  # samples of the worker's share handed out (or skipped) before this pass
    plan: tuple[Any, ...]  # the order's settings (shuffle, seed, shuffle_buffer, drop_last, chunk)
    key: str = ""  # the loader's secret (see the module docstring)


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
        return [kind, error_data(payload)]
    return [kind, None]


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
        return kind, error_of(payload)
    return kind, None


def decode_frame(raw: Any, root: str | None) -> list[tuple[str, Any]]:
    """A host's frame: its messages, each as :func:`decode` makes it.

    Raises:
        FrameError: not a non-empty list of the feed's messages.
    """
    if not (isinstance(raw, list) and raw):
        raise FrameError(f"not a frame of the feed: {str(raw)[:80]!r}")
    return [decode(m, root) for m in raw]


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
