"""Reading what ``s5loader prefetch`` delivers: :func:`consume`.

The protocol (see docs/daemon.md and :mod:`s5loader.handover`) needs nothing but a file system:

* a sample appears in the cache directory only when it is complete, as one folder named
  ``SEQUENCE-KEY`` where ``SEQUENCE`` is a zero-padded delivery number
  (:data:`SEQ_WIDTH` digits), so plain ``ls`` order is the delivery order;
* the files in the folder are named by the sample's fields (``image``, ``label``,
  ``text.txt``, ``video.mp4``); small files :data:`KEY_FILE` and :data:`EPOCH_FILE` hold the
  sample's full key (the folder name carries it shortened and made file-name-safe) and epoch;
* a consumer claims a sample by renaming its folder into ``.claimed/`` (so several consumers
  share a cache, each sample going to one of them), and deletes it there when done with it;
  the daemon refills the cache;
* the file :data:`END_MARKER` appears once every sample has been delivered; it names the run
  (a new one with every ``--fresh`` start), so an old run's end can be told from a new one's;
  :data:`ERROR_MARKER` holds the daemon's message when it failed;
* everything else in the cache (the daemon's lock, state and staging area) is hidden
  (a name starting with ``.``).

This module has no dependency on the daemon, so a consumer can run on its own.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property

from .exceptions import ConfigError, DaemonError, StallError
from .handover import (
    CONTROL_FILES,
    END_MARKER,
    EPOCH_FILE,
    ERROR_MARKER,
    KEY_FILE,
    SEQ_WIDTH,
    claim,
    daemon_status,
    parse_seq,
    ready_names,
    unclaim,
)

__all__ = [
    "END_MARKER",
    "EPOCH_FILE",
    "ERROR_MARKER",
    "KEY_FILE",
    "SEQ_WIDTH",
    "ReadySample",
    "consume",
    "parse_seq",
    "ready_names",
]

log = logging.getLogger(__name__)

#: Seconds a consumer waits for a daemon to (re)appear on a cache before it gives up (a daemon
#: takes the cache's lock about a second after it starts, before it loads torch).
GRACE_S = 10.0
# How often a waiting consumer probes the daemon's lock.
_PROBE_S = 0.25


def _read_end(cache: str) -> str | None:
    """The end marker's content, or None when there is none."""
    try:
        with open(os.path.join(cache, END_MARKER), encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class ReadySample:
    """One delivered sample, claimed by this consumer.

    Attributes:
        seq: its delivery number (the order of delivery over all epochs).
        name: the folder's name, ``SEQUENCE-KEY`` (the key shortened and made safe).
        path: the folder's path (in the cache's ``.claimed/`` once claimed).
        files: field name -> file path, e.g. ``{"image": ".../image", "label": ...}``;
            fields of folder samples keep their path inside the folder (``sub/x.txt``).
            The ``__key__`` and ``__epoch__`` files are not fields.
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

    @cached_property
    def epoch(self) -> int | None:
        """The epoch the sample was delivered in (from 0), from the folder's ``__epoch__``
        file; None from a daemon that wrote none."""
        try:
            with open(os.path.join(self.path, EPOCH_FILE), encoding="ascii") as f:
                return int(f.read())
        except (FileNotFoundError, ValueError):
            return None

    def read(self, field: str) -> bytes:
        """The bytes of one field.

        Raises:
            KeyError: the sample has no such field.
        """
        with open(self.files[field], "rb") as f:
            return f.read()


def _load(name: str, path: str) -> ReadySample:
    files: dict[str, str] = {}
    for root, dirs, filenames in os.walk(path):
        dirs.sort()
        for fn in sorted(filenames):
            full = os.path.join(root, fn)
            rel = os.path.relpath(full, path)
            if rel not in CONTROL_FILES:
                files[rel] = full
    seq = parse_seq(name)
    assert seq is not None
    return ReadySample(seq, name, path, files)


def _remove(path: str) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass  # the loop body removed it already


class _Liveness:
    """Whether the daemon of a cache is alive, asked while no sample is ready: a daemon that
    failed or is gone, and that no daemon replaced within ``grace`` seconds, is an error; one
    that failed while this consumer watched (an ``ERROR`` it did not find when it began) at
    once. A cache no daemon has run on yet is waited on."""

    def __init__(self, cache: str, grace: float | None) -> None:
        self.cache, self.grace = cache, grace
        self.away_since: float | None = None
        self._last = 0.0
        self._stale_error = daemon_status(cache).error  # a failure from before this consumer

    def check(self) -> None:
        now = time.monotonic()
        if self.grace is None or (self.away_since is None and now - self._last < _PROBE_S):
            return
        self._last = now
        status = daemon_status(self.cache)
        if status.alive or status.state == "absent":  # absent: not started yet (any order)
            self.away_since = None
            self._stale_error = None  # a daemon took over: any failure from now on is news
            return
        if self.away_since is None:
            self.away_since = now
        fresh_failure = status.state == "failed" and status.error != self._stale_error
        if fresh_failure or now - self.away_since >= self.grace:
            raise DaemonError(status.describe())


def consume(
    cache: str | os.PathLike[str],
    *,
    poll_interval: float = 0.05,
    timeout: float | None = None,
    delete: bool = True,
    finished: Callable[[], bool] | None = None,
    grace: float | None = GRACE_S,
) -> Iterator[ReadySample]:
    """Yield the samples a prefetch daemon delivers into ``cache``, in order, until its end.

    Each sample is claimed before it is yielded (its folder renamed into the cache's
    ``.claimed/``), so several consumers, in any processes, may share one cache: each sample
    goes to exactly one of them. A sample's folder is deleted when the loop asks for the next
    one, which frees its bytes for the daemon to refill. When the loop is left early
    (``break``, an exception), the current sample is handed back (renamed into the cache
    again), so the next consumer starts with it. The iteration ends at the end marker, once
    every sample before it has been claimed.

    Waits while the daemon is behind, or not started yet: the consumer and the daemon may be
    started in any order, in different processes. A daemon that failed (the cache's ``ERROR``
    marker) or is gone (killed, or stopped by a signal, before the end), and that no daemon
    replaced within ``grace`` seconds, is a :class:`~s5loader.DaemonError` once every sample
    delivered before has been yielded; the grace lets a restarted daemon take over. A daemon
    that fails while the consumer runs (an ``ERROR`` that was not there when it began) is the
    error at once.

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
        delete: delete each sample when the loop moves on (False leaves that to you: the
            folders stay claimed at ``sample.path`` until you delete them, and the daemon
            refills only what is deleted).
        finished: asked while no sample is ready: True ends the iteration (the producer has
            ended, so nothing more will come); an exception from it propagates (the
            producer failed). :class:`~s5loader.Prefetcher` passes its daemon's state.
        grace: seconds a failed or missing daemon may take to be replaced before the error
            (a daemon takes the cache's lock about a second after it starts); None waits for
            ever.

    Yields:
        :class:`ReadySample`: the folder path and the paths of its files.

    Raises:
        DaemonError: the daemon failed (its message) or is gone, and none took its place
            within ``grace`` seconds; the message names the cache.
        StallError: ``timeout`` passed without a new sample.
        ConfigError: ``poll_interval``, ``timeout`` or ``grace`` is not positive.
    """
    _check_waits(poll_interval, timeout, grace)
    cache = os.fspath(cache)
    since = time.monotonic()
    stale = _read_end(cache) if not ready_names(cache) else None
    if stale is not None:
        log.info("%s holds only the end of a finished run: waiting for the next run", cache)
    daemon = _Liveness(cache, grace)
    held: ReadySample | None = None  # claimed and yielded, not yet done with
    try:
        while True:
            end = _read_end(cache)  # before listing: no race
            ended = end is not None and end != stale
            names = ready_names(cache)
            claimed = _claim_first(cache, names)
            if claimed is not None:
                held = _load(*claimed)
                yield held
                sample, held = held, None
                since = time.monotonic()
                if delete:
                    _remove(sample.path)
                continue
            if names:
                continue  # all claimed by other consumers meanwhile: look again
            if ended or (finished is not None and finished() and not ready_names(cache)):
                return
            daemon.check()
            if timeout is not None and time.monotonic() - since > timeout:
                raise _stall(cache, timeout, stale is not None and end == stale)
            time.sleep(poll_interval)
    finally:
        if held is not None and delete:
            unclaim(cache, held.name)  # left early: the next consumer starts with it


def _check_waits(poll_interval: float, timeout: float | None, grace: float | None) -> None:
    """Refuse a wait of :func:`consume` that is not a positive number of seconds (``grace``:
    not negative); ``timeout`` and ``grace`` may be None, for ever."""
    if not poll_interval > 0:
        raise ConfigError(f"poll_interval must be positive, got {poll_interval!r}")
    if timeout is not None and not timeout > 0:
        raise ConfigError(f"timeout must be positive or None, got {timeout!r}")
    if grace is not None and not grace >= 0:
        raise ConfigError(f"grace must be >= 0 or None, got {grace!r}")


def _claim_first(cache: str, names: list[str]) -> tuple[str, str] | None:
    """Claim the first of the ready samples ``names`` that no other consumer claimed first;
    its name and its claimed path, or None when the others took them all."""
    for name in names:
        path = claim(cache, name)
        if path is not None:
            return name, path
    return None


def _stall(cache: str, timeout: float, only_stale_end: bool) -> StallError:
    """The error of a consumer that waited ``timeout`` seconds for a sample, saying what the
    cache holds: only a finished run's end marker (``only_stale_end``), or no end marker."""
    why = (
        "only the end marker of a finished run, whose samples were all consumed, is there"
        if only_stale_end
        else "the end marker is not there"
    )
    return StallError(
        f"no sample arrived in {cache} for {timeout:g}s and {why}; "
        "is 's5loader prefetch --cache' running on it?"
    )
