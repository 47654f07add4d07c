"""How :class:`~s5loader.S5Dataset` reads a sample's fields: from the files a staging pass
staged (then released), after waiting for a sample handed out before it was staged, or
directly from S3."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import time
from collections.abc import Sequence
from typing import Any

from .. import exceptions
from .._index.sample import Sample
from .._s3api.client import s3_client
from .._s3api.errors import boto3_error
from .._util.procs import ProcessId
from .._util.uri import parse_s3_uri
from ..config import Access
from ..exceptions import S5LoaderError, StagingSpaceError
from .area import LOCK
from .layout import NO_SPACE_MARK, NOT_STAGED, StagingLayout

# where no FIFO can be made, pauses between looks for the word on a sample handed out before it
# was staged: short at first (the first batch waits for it), then up to this long
_FIRST_PAUSE, _MOST_PAUSE = 0.0005, 0.005
_RECHECK_S = 0.5  # how often a reader waiting on its bell looks whether the pass is still there

log = logging.getLogger("s5loader.dataset")


class StagedIndex(int):
    """A sample index as :class:`~s5loader.S5Sampler` yields it: the int, plus the folder of
    the staging pass that staged the sample and whether reading it keeps the files.

    The index carries its folder through the DataLoader's index queue to the workers, so one
    dataset can serve several samplers (a training and an evaluation loader), and a worker
    that reads a sample of a pass that was replaced (``persistent_workers`` after a
    ``break``) reads that pass's files, never the next pass's.

    The folder travels only while the index stays a ``StagedIndex``: code between the sampler
    and the dataset that makes a plain int of it (``int(i)``) leaves the dataset no folder to
    read, so it fetches the sample directly and the staged files stay unreleased. The dataset
    of a sampler reports such a read (a warning, :attr:`Stats.plain_indices
    <s5loader._engine.stats.Stats.plain_indices>`; see :mod:`s5loader._staging.plainindex`).
    """

    folder: str
    keep: bool
    back: bool
    frees: bool  # a tar shard's sample: free its bytes once read (see ShardSet.read)
    early: bool  # handed out before it was staged: the reader waits for it (see wait_staged)

    def __new__(
        cls,
        value: int,
        folder: str,
        keep: bool = False,
        back: bool = False,
        frees: bool = False,
        early: bool = False,
    ) -> StagedIndex:
        self = super().__new__(cls, value)
        self.folder = folder
        self.keep = keep
        self.back = back
        self.frees = frees
        self.early = early
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (StagedIndex, (int(self), self.folder, self.keep, self.back, self.frees, self.early))


def wait_staged(layout: StagingLayout, index: int) -> bool:
    """Wait for the sampler's word on sample ``index``, which it handed out before the sample
    was staged (see :mod:`s5loader._sampling.early`): True once it is staged, False when the
    pass is gone (its folder, or the process that stages it): read it directly, as any sample
    not staged. A pass folder that someone else removed is gone even if the engine made it again
    (its release FIFO, made once when the pass starts, is not).

    Raises:
        the staging engine's error (FetchError, StallError, BudgetError, ...), as the sampler
        raises it; S5LoaderError: the pass stopped before the sample was staged (a newer
        iterator replaced it, or ``close()``), as the sampler's own wait says.
    """
    mark = layout.early_mark(index)
    word = _word(mark)
    if word is None:
        word = _wait_for_word(layout, index)
        if word is None:
            return False
    with contextlib.suppress(OSError):
        os.unlink(mark)  # read: a long pass leaves no word behind per sample
    if not word:
        return True
    if word == NOT_STAGED:
        raise S5LoaderError(
            f"sample {int(index)} of the staging pass {layout.folder} was not staged: the pass was "
            "closed first (a newer iterator over the same S5Sampler replaced it, or close() was called)"
        )
    raise error_of_word(word)


def _word(mark: str) -> bytes | None:
    try:
        with open(mark, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        pass
    if os.path.exists(mark + NO_SPACE_MARK):  # the engine had no room to write its error
        return word_of_error(
            StagingSpaceError(
                f"the staging directory {os.path.dirname(os.path.dirname(mark))} ran out of space "
                "while the sample was staged: free space there or lower the budget"
            )
        )
    return None


def _wait_for_word(layout: StagingLayout, index: int) -> bytes | None:
    """Wait on a FIFO the sampler rings once the word on ``index`` is there (a blocking wait,
    so that a worker spends no CPU on a sample while it waits, as a sleep loop would); None
    when the pass folder or the sampler's process is gone."""
    mark, bell = layout.early_mark(index), layout.early_bell(index)
    stager = owner_of(os.path.dirname(layout.folder))  # the sampler's process, named by its lock
    try:
        os.mkfifo(bell, 0o600)
    except FileExistsError:
        pass
    except OSError:  # no FIFO here (or the pass folder is gone): look now and then
        return _poll_for_word(layout, mark, stager)
    fds: list[int] = []
    try:
        fds.append(os.open(bell, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        fds.append(os.open(bell, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))  # its own: no end-of-file
        while True:
            word = _word(mark)  # after the bell is open: a word written before it rang nothing
            if word is not None:
                return word
            if _gone(layout, stager):
                return None
            if select.select(fds[:1], [], [], _RECHECK_S)[0]:
                with contextlib.suppress(BlockingIOError):
                    os.read(fds[0], 4096)
    except FileNotFoundError:
        return None  # the pass folder went meanwhile
    finally:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(bell)


def owner_of(area: str) -> ProcessId | None:
    """The process that made the staging directory ``area`` (its lock's pid and start time), or
    None where the lock cannot be read."""
    try:
        with open(os.path.join(area, LOCK), encoding="utf-8") as f:
            raw = json.load(f)
        return ProcessId(int(raw["pid"]), int(raw["start"]) if raw.get("start") is not None else None)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _gone(layout: StagingLayout, stager: ProcessId | None) -> bool:
    """The process that stages the pass ended (``stager``, named by pid and start time, not by
    this process's parent: inside a container that is often 1 while the sampler lives), or its
    folder was removed (the release FIFO the engine made when the pass began is missing even
    where the engine made the folder again)."""
    return (stager is not None and not stager.alive()) or not os.path.exists(layout.releases)


def _poll_for_word(layout: StagingLayout, mark: str, stager: ProcessId | None) -> bytes | None:
    pause = _FIRST_PAUSE
    while True:
        word = _word(mark)
        if word is not None:
            return word
        if _gone(layout, stager):
            return None
        time.sleep(pause)
        pause = min(2 * pause, _MOST_PAUSE)


def word_of_error(exc: BaseException) -> bytes:
    """An engine error as the word :func:`wait_staged` raises again: its type's name and message."""
    return f"{type(exc).__name__}\n{exc}".encode("utf-8", "replace")


def error_of_word(word: bytes) -> S5LoaderError:
    """The error :func:`word_of_error` wrote: the same s5loader type (else :class:`S5LoaderError`)
    with the same message."""
    name, _, message = word.decode("utf-8", "replace").partition("\n")
    kind = getattr(exceptions, name, None)
    if isinstance(kind, type) and issubclass(kind, S5LoaderError):
        return kind(message)
    return S5LoaderError(message)


def read_staged(
    layout: StagingLayout, index: int, sample: Sample, keep: bool, back: bool = False
) -> list[bytes] | None:
    """The fields of sample ``index`` from its staged files, which are released unless
    ``keep`` (handed back for the epoch cache with ``back``); None when none is staged (a file
    missing after the first is an error)."""
    paths = layout.paths(index, sample)
    data = []
    try:
        for p in paths:
            with open(p, "rb") as fh:
                data.append(fh.read())
    except FileNotFoundError:
        if not data:
            return None
        raise
    if back and not keep:
        layout.hand_back(index, paths)
    elif not keep:
        layout.release(index, paths)
    return data


def fetch_fields(client: Any, sample: Sample) -> list[bytes]:
    """The fields of ``sample``, each with one GET through the boto3 ``client``."""
    out = []
    for f in sample.fields:
        u = parse_s3_uri(f.uri)
        try:
            out.append(client.get_object(Bucket=u.bucket, Key=u.key)["Body"].read())
        except Exception as exc:
            raise boto3_error(exc, f.uri) from exc
    return out


class ObjectReader:
    """How an :class:`~s5loader.S5Dataset` of raw objects reads its samples (the counterpart of
    :class:`~s5loader._shards.shardset.ShardSet` for tar shards): a sample is its own staging
    unit, read from the files a pass staged (then released), else fetched with one GET per
    field."""

    disk = None  # a staged sample takes its objects' bytes

    def __init__(self, count: int) -> None:
        self.samples = count
        self._warned_unstaged = False

    def read(
        self, index: int, units: Sequence[Sample], access: Access
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Sample ``index`` of ``units`` as ``{"__key__": ..., FIELD: bytes, extra...}`` and
        where each field came from (fetched through ``access`` when not staged)."""
        sample = units[index]
        data = None
        if isinstance(index, StagedIndex):
            folder = index.folder
            layout = StagingLayout(folder)
            # A sample handed to a DataLoader before it was staged: wait for it (the engine's
            # error, or a pass closed first, is raised). Where the pass is gone (its folder
            # removed by someone else), what is staged of it is read (and so released), and a
            # sample not all there is fetched directly.
            if not index.early or wait_staged(layout, int(index)):
                data = read_staged(layout, int(index), sample, keep=index.keep, back=index.back)
            else:
                with contextlib.suppress(FileNotFoundError):
                    data = read_staged(layout, int(index), sample, keep=index.keep, back=index.back)
            # A pass whose folder is gone was replaced: whoever asked will not use the sample
            # (a worker of a loader that was shut down), so that is no staging fault to report.
            if data is None and not index.early and not self._warned_unstaged and os.path.isdir(folder):
                self._warned_unstaged = True
                log.warning(
                    "sample %d (%s) was not staged in %s; fetching it directly (further "
                    "cases are not logged)",
                    index,
                    sample.key,
                    folder,
                )
        if data is None:
            data = fetch_fields(s3_client(access), sample)
        out: dict[str, Any] = {"__key__": sample.key}
        for f, value in zip(sample.fields, data, strict=True):
            out[f.name] = value
        if sample.extra:
            for k, v in sample.extra.items():
                out.setdefault(k, v)
        return out, {f.name: f.uri for f in sample.fields}

    def unit_of(self, index: int) -> int:
        """The staging unit of sample ``index``: the sample itself."""
        return int(index)

    def describe(self) -> str:
        return f"{self.samples} samples"
