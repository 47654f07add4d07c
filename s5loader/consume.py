"""Reading what ``s5loader prefetch`` delivers: the hand-over protocol and :func:`consume`.

The protocol (see docs/daemon.md) needs nothing but a file system:

* a sample appears in the cache directory only when it is complete, as one folder named
  ``SEQUENCE-KEY`` where ``SEQUENCE`` is a zero-padded delivery number
  (:data:`SEQ_WIDTH` digits), so plain ``ls`` order is the delivery order;
* the files in the folder are named by the sample's fields (``image``, ``label``,
  ``text.txt``, ``video.mp4``), and a small file :data:`KEY_FILE` holds the sample's full key
  (the folder name carries it shortened and made file-name-safe);
* the consumer deletes the folder when done with it, and the daemon refills the cache;
* the file :data:`END_MARKER` appears once every sample has been delivered; it names the run
  (a new one with every ``--fresh`` start), so an old run's end can be told from a new one's;
* everything else in the cache (the daemon's lock, state and staging area) is hidden
  (a name starting with ``.``).

This module has no dependency on the daemon, so a consumer can run on its own.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property

from .exceptions import ConfigError, StallError

log = logging.getLogger(__name__)

#: Digits of the delivery number that starts every sample folder's name.
SEQ_WIDTH = 12
#: The file the daemon writes into the cache once every sample has been delivered.
END_MARKER = "END"
#: The file in each delivered folder that holds the sample's full key (UTF-8, no newline; a
#: tar member name that is not UTF-8 keeps its own bytes).
KEY_FILE = "__key__"
_SAMPLE_RE = re.compile(rf"^(\d{{{SEQ_WIDTH}}})-")


def _read_end(cache: str) -> str | None:
    """The end marker's content, or None when there is none."""
    try:
        with open(os.path.join(cache, END_MARKER), encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return None


def parse_seq(name: str) -> int | None:
    """The delivery number of a sample folder's name, or None if ``name`` is not one."""
    m = _SAMPLE_RE.match(name)
    return int(m.group(1)) if m else None


def ready_names(cache: str) -> list[str]:
    """The sample folders ready in ``cache``, in delivery order (empty if it does not exist)."""
    try:
        names = os.listdir(cache)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if _SAMPLE_RE.match(n))


@dataclass(frozen=True)
class ReadySample:
    """One delivered sample.

    Attributes:
        seq: its delivery number (the order of delivery over all epochs).
        name: the folder's name, ``SEQUENCE-KEY`` (the key shortened and made safe).
        path: the folder's path.
        files: field name -> file path, e.g. ``{"image": ".../image", "label": ...}``;
            fields of folder samples keep their path inside the folder (``sub/x.txt``).
            The ``__key__`` file is not a field.
    """

    seq: int
    name: str
    path: str
    files: dict[str, str]

    @cached_property
    def key(self) -> str:
        """The sample's full key, from the folder's ``__key__`` file; from a daemon that wrote
        none, the shortened, file-name-safe key of the folder name."""
        try:
            with open(os.path.join(self.path, KEY_FILE), encoding="utf-8", errors="surrogateescape") as f:
                return f.read()
        except FileNotFoundError:
            return self.name.split("-", 1)[1]

    def read(self, field: str) -> bytes:
        """The bytes of one field.

        Raises:
            KeyError: the sample has no such field.
        """
        with open(self.files[field], "rb") as f:
            return f.read()


def _load(cache: str, name: str) -> ReadySample | None:
    path = os.path.join(cache, name)
    files: dict[str, str] = {}
    for root, dirs, filenames in os.walk(path):
        dirs.sort()
        for fn in sorted(filenames):
            full = os.path.join(root, fn)
            rel = os.path.relpath(full, path)
            if rel != KEY_FILE:
                files[rel] = full
    if not files and not os.path.isdir(path):
        return None  # removed under us (by another consumer)
    seq = parse_seq(name)
    assert seq is not None
    return ReadySample(seq, name, path, files)


def _remove(path: str) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass  # the loop body removed it already


def consume(
    cache: str | os.PathLike[str],
    *,
    poll_interval: float = 0.05,
    timeout: float | None = None,
    delete: bool = True,
    finished: Callable[[], bool] | None = None,
) -> Iterator[ReadySample]:
    """Yield the samples a prefetch daemon delivers into ``cache``, in order, until its end.

    Waits while the daemon is behind (or not started yet: the consumer and the daemon may be
    started in any order, in different processes). A sample's folder is deleted when the
    loop asks for the next one, which frees its bytes for the daemon to refill. When the
    loop is left early (``break``, an exception), the current sample is left in the cache,
    so the next consumer starts with it. The iteration ends at the end marker, once every
    sample before it has been consumed. One consumer per cache.

    A cache that holds nothing but a finished run's end marker when the iteration starts
    (every sample consumed) has nothing for this consumer: it waits for the next run
    (``s5loader prefetch --fresh``, started before or after it) and ends at that run's end
    marker. This keeps a consumer started together with ``--fresh`` from ending at once on
    the old run's marker; pass ``timeout`` to give up instead.

    Args:
        cache: the daemon's ``--cache`` directory.
        poll_interval: seconds between looks at the cache while waiting.
        timeout: raise :class:`~s5loader.StallError` when no sample arrives for this many
            seconds; None (default) waits for ever.
        delete: delete each sample when the loop moves on (False leaves that to you; the
            daemon refills only what is deleted).
        finished: asked while no sample is ready: True ends the iteration (the producer has
            ended, so nothing more will come); an exception from it propagates (the
            producer failed). :class:`~s5loader.Prefetcher` passes its daemon's state.

    Yields:
        :class:`ReadySample`: the folder path and the paths of its files.

    Raises:
        StallError: ``timeout`` passed without a new sample.
        ConfigError: ``poll_interval`` or ``timeout`` is not positive.
    """
    if not poll_interval > 0:
        raise ConfigError(f"poll_interval must be positive, got {poll_interval!r}")
    if timeout is not None and not timeout > 0:
        raise ConfigError(f"timeout must be positive or None, got {timeout!r}")
    cache = os.fspath(cache)
    last = -1
    since = time.monotonic()
    stale = _read_end(cache) if not ready_names(cache) else None
    if stale is not None:
        log.info("%s holds only the end of a finished run: waiting for the next run", cache)
    while True:
        end = _read_end(cache)  # before listing: no race
        ended = end is not None and end != stale
        names = ready_names(cache)
        if not delete:  # what was yielded stays: never yield it again
            names = [n for n in names if (parse_seq(n) or 0) > last]
        sample = _load(cache, names[0]) if names else None
        if sample is not None:
            yield sample
            last = sample.seq
            since = time.monotonic()
            if delete:
                _remove(sample.path)
            continue
        if names:
            continue  # the folder vanished between listing and reading: look again
        if ended or (finished is not None and finished() and not ready_names(cache)):
            return
        if timeout is not None and time.monotonic() - since > timeout:
            why = (
                "only the end marker of a finished run, whose samples were all consumed, is there"
                if stale is not None and end == stale else "the end marker is not there"
            )
            raise StallError(
                f"no sample arrived in {cache} for {timeout:g}s and {why}; "
                "is 's5loader prefetch --cache' running on it?"
            )
        time.sleep(poll_interval)
