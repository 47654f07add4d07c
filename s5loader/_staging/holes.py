"""Which blocks of a staged tar shard come back as its samples are read.

A staged shard is cut into its samples' spans: sample ``j`` spans from where sample ``j - 1``
ends (the shard's start for the first) to the end of its own last member, padded as tar pads
(so its member headers are inside its span); the tar's end (two zero blocks, the padding to a
record, members that belong to no sample) counts with the last sample once the member table is
whole. A sample is *done* once it was read, or when the pass does not need it (no claim). A
block of the file comes back once every sample whose span touches it is done: blocks inside one
sample's span as soon as it is read, a block that two small samples share once both are.

Each block is counted once. The reader that makes a block whole frees it, holding the shard's
lock (see :meth:`StagingLayout.release_shard_sample
<s5loader._staging.layout.StagingLayout.release_shard_sample>`), so that two readers of
neighbouring samples never both see the other done; blocks that touch no sample the pass
needs are freed by whoever opens the shard for the pass (:func:`unneeded_ranges`), before any
reader starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Collection, Iterator

from .._util.platform import HOLE_BLOCK, punch_hole

TAR_BLOCK = 512  # tar pads each member's data to this


class SampleSpans:
    """The spans of a staged shard's samples.

    Args:
        end_of: the end of sample ``k``'s last member (offset plus size), for ``k`` below
            ``known``.
        known: the samples in the member table (a shard read while it downloads has a growing
            table; nothing past it is done).
        count: the samples of the whole shard.
        size: the file's size.
        grow: where the table may have grown since (a shard still downloading), what reads it
            again: the new ``end_of`` and ``known``.
    """

    __slots__ = ("_end_of", "known", "count", "size", "_grow")

    def __init__(
        self,
        end_of: Callable[[int], int],
        known: int,
        count: int,
        size: int,
        grow: Callable[[], tuple[Callable[[int], int], int]] | None = None,
    ) -> None:
        self._end_of = end_of
        self.known = known
        self.count = count
        self.size = size
        self._grow = grow

    def grow(self) -> None:
        """Read the table again, if it can have grown."""
        if self._grow is not None and not self.whole:
            self._end_of, self.known = self._grow()

    @property
    def whole(self) -> bool:
        """The table names every sample, so the tar's end counts with the last one."""
        return self.known >= self.count

    def end(self, k: int) -> int:
        """Where sample ``k``'s span ends (the file's end for the last sample of a whole table)."""
        end = -(-self._end_of(k) // TAR_BLOCK) * TAR_BLOCK
        return max(self.size, end) if k == self.count - 1 and self.known >= self.count else end

    def start(self, k: int) -> int:
        return self.end(k - 1) if k > 0 else 0


def freed_by(spans: SampleSpans, j: int, done: Callable[[int], bool], block: int) -> tuple[int, int]:
    """The blocks that sample ``j``, just read, makes whole: a range ``[lo, hi)`` of offsets on
    ``block`` boundaries (empty when ``hi <= lo``). The blocks inside its span always; the block
    its span begins in once the samples before it that touch that block are ``done``; the block
    it ends in once the samples after it that touch it are (not when one of them is not in the
    table yet)."""
    s, e = spans.start(j), spans.end(j)
    lo, hi = s // block, -(-e // block)
    if s % block and not _before_done(spans, j, lo * block, done):
        lo += 1
    if e % block and not _after_done(spans, j, hi * block, done):
        hi -= 1
    return lo * block, hi * block


def _before_done(spans: SampleSpans, j: int, edge: int, done: Callable[[int], bool]) -> bool:
    k = j - 1
    while k >= 0 and spans.end(k) > edge:
        if not done(k):
            return False
        k -= 1
    return True


def _after_done(spans: SampleSpans, j: int, edge: int, done: Callable[[int], bool]) -> bool:
    k = j + 1
    while k < spans.count and spans.start(k) < edge:
        if k >= spans.known:
            spans.grow()  # under the shard's lock: a reader of sample k read it after it was published
        if k >= spans.known or not done(k):
            return False
        k += 1
    return k < spans.count or spans.whole


def unneeded_ranges(spans: SampleSpans, needed: Collection[int], block: int) -> list[tuple[int, int]]:
    """The blocks that no sample in ``needed`` touches, as ranges ``[lo, hi)`` on ``block``
    boundaries: what a pass that reads only ``needed`` gives back as it opens the shard (the
    table must be whole)."""
    out = []
    k = 0
    while k < spans.count:
        if k in needed:
            k += 1
            continue
        a = k
        while k < spans.count and k not in needed:
            k += 1
        s, e = spans.start(a), spans.end(k - 1)
        lo, hi = -(-s // block) * block, (e // block) * block
        if k == spans.count:  # up to the file's end: its last block, partly past it, too
            hi = -(-e // block) * block
        if hi > lo:
            out.append((lo, hi))
    return out


def give_back(fd: int, spans: SampleSpans, j: int, claims: str, punch: bool = True) -> int:
    """Punch out of the shard open for writing as ``fd`` what the read of sample ``j`` made whole
    (:func:`freed_by`; a sample is done once its claim in the folder ``claims`` is gone) and
    return the bytes given back. Call it holding the shard's lock, the claim of ``j`` dropped.
    Without ``punch`` (a shard the epoch cache keeps whole) nothing is punched and the bytes
    that would have been are returned: they count against the cache from then on."""
    lo, hi = freed_by(spans, j, lambda k: not os.path.lexists(f"{claims}/{k}"), HOLE_BLOCK)
    if hi <= lo:
        return 0
    return punch_hole(fd, lo, hi - lo, HOLE_BLOCK) if punch else hi - lo


def give_back_unneeded(path: str, spans: SampleSpans, needed: Collection[int], punch: bool = True) -> int:
    """Punch out of the shard at ``path``, just opened for a pass, the blocks no sample in
    ``needed`` touches (:func:`unneeded_ranges`: what an earlier pass of the epoch read, or
    another rank's samples); the bytes given back, 0 where the file system cannot punch.
    Without ``punch``, the bytes that would be given back, nothing punched (see
    :func:`give_back`)."""
    if not punch:
        return sum(hi - lo for lo, hi in unneeded_ranges(spans, needed, HOLE_BLOCK))
    try:
        with open(path, "r+b") as fh:
            return sum(
                punch_hole(fh.fileno(), lo, hi - lo, HOLE_BLOCK)
                for lo, hi in unneeded_ranges(spans, needed, HOLE_BLOCK)
            )
    except OSError:
        return 0


@contextlib.contextmanager
def shard_lock(fd: int) -> Iterator[None]:
    """The lock of a staged shard open as ``fd`` (``flock``: each reader opens the shard itself),
    held while a reader drops its claim and looks at its neighbours'; nothing for ``fd < 0``."""
    if fd < 0:
        yield
        return
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
