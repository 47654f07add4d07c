"""How one large object is cut into parts: their size and how many move at once.

A transfer of one object moves as fast as the requests in flight allow: on a link with a long
round trip (a store in another region, a proxy), each request spends a round trip or more
waiting, and only many requests side by side fill the link. So the parts are chosen from the
object's size: about :data:`TARGET_PARTS` of them (16 MiB each for 1 GiB), never smaller
than S3's 5 MiB minimum nor (unless asked) larger than 64 MiB, and never more than S3's
10,000; up to ``concurrency`` (:data:`DEFAULT_CONCURRENCY`) of them at once. A part size
given by the caller is kept (raised to 5 MiB, and where 10,000 parts would not hold the
object). A pure module: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024**2
MIN_PART = 5 * MiB  # S3's smallest part (all but the last)
MAX_PARTS = 10_000  # S3's most parts in one upload
TARGET_PARTS = 64  # parts per object when the object is large enough
MAX_AUTO_PART = 64 * MiB  # the largest part picked without being asked
DEFAULT_CONCURRENCY = 32  # parts in flight per object
STREAM_PART_GROWTH = 2000  # a streamed upload doubles its part size every this many parts


@dataclass(frozen=True)
class PartPlan:
    """The parts of one transfer.

    Attributes:
        part_size: bytes per part (a whole number of MiB, at least 5 MiB).
        parts: how many parts the object takes (1 for an empty or small object).
        concurrency: parts in flight at once (at most ``parts``).
    """

    part_size: int
    parts: int
    concurrency: int

    @property
    def part_mib(self) -> int:
        """``part_size`` in MiB, as s5cmd's ``--part-size`` takes it."""
        return self.part_size // MiB


def _ceil_mib(n: int) -> int:
    return -(-n // MiB) * MiB


def plan_parts(size: int, *, part_size: int = 0, concurrency: int = DEFAULT_CONCURRENCY) -> PartPlan:
    """The parts for an object of ``size`` bytes.

    Args:
        size: the object's size in bytes (an estimate for a stream).
        part_size: bytes per part; 0 picks one from ``size``.
        concurrency: the most parts in flight; 0 or less picks :data:`DEFAULT_CONCURRENCY`.

    Returns:
        the plan; ``concurrency`` is cut to the number of parts.
    """
    size = max(0, size)
    if part_size <= 0:
        part = min(MAX_AUTO_PART, _ceil_mib(-(-size // TARGET_PARTS)))
    else:
        part = _ceil_mib(part_size)
    part = max(part, MIN_PART, _ceil_mib(-(-size // MAX_PARTS)))
    parts = max(1, -(-size // part))
    want = concurrency if concurrency > 0 else DEFAULT_CONCURRENCY
    return PartPlan(part_size=part, parts=parts, concurrency=max(1, min(want, parts)))


def stream_part_size(base: int, number: int) -> int:
    """The size of part ``number`` (from 1) of a streamed upload whose size is not known:
    ``base``, doubled every :data:`STREAM_PART_GROWTH` parts, so that an object far larger
    than its estimate still fits in 10,000 parts (from 5 MiB parts: 325 GB)."""
    return base << ((number - 1) // STREAM_PART_GROWTH)
