"""Blocks: runs of consecutive samples whose objects are exactly the objects under one key
prefix, so that one wildcard ``cp`` fetches all of them.

s5cmd pays a HEAD request and its bookkeeping for every single-object ``cp`` line, but one LIST
for a wildcard, so a command file of one wildcard line per block costs s5cmd much less CPU than
one ``cp --raw`` line per object, close to a bulk copy of the whole prefix (docs/s5cmd-head.md
has the figures). The engine uses a block's wildcard line whenever a call holds the whole block
and the block has enough objects that its LIST costs no more than the HEADs it saves
(:func:`~s5loader._s5cmd.wildcard_pays`), and plain per-object lines otherwise, so every order
still works.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .._s5cmd.commands import wildcard_pays
from .compact import SampleIndex
from .sample import Sample

# Relative paths that s5cmd writes under the block's scratch folder come from the keys, so a
# block is only formed where every component is plainly safe.
_SAFE_REL = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9._-]{0,254}/)*[A-Za-z0-9_][A-Za-z0-9._-]{0,254}").fullmatch
_GLOB = re.compile(r"[*?\[\]\\\n\r\x00]")
_MAX = chr(0x10FFFF)
_ODD_FOLDER = re.compile(r"/(?:\.\.?)?/")  # an empty, "." or ".." component
#: How far past ``block_size`` a block may grow: a prefix of up to ``GROW * block_size`` samples
#: whose key names split it only into parts too small for a wildcard line to pay (decimal keys'
#: tens of one-object samples) is one block, not parts sent one ``cp --raw`` line per object.
GROW = 2


@dataclass(frozen=True)
class Block:
    """Samples ``start`` to ``stop - 1``: every object under ``s3://bucket/prefix`` and no other."""

    bucket: str
    prefix: str
    start: int
    stop: int
    rels: tuple[tuple[str, ...], ...]  # per sample, per field: its path below the wildcard's folder

    @property
    def wildcard(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}*"

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def objects(self) -> int:
        """The objects its wildcard fetches."""
        return sum(len(r) for r in self.rels)


def _split(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[5:].partition("/")
    return bucket, key


def _lcp(a: str, b: str) -> str:
    # bisect on the length: a few slice comparisons in C instead of a loop per character
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return a[:hi]
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return a[:lo]


@dataclass(frozen=True)
class BlockPlan:
    """The blocks of a data set, and which sample lies in which (-1: none)."""

    blocks: list[Block]
    block_of: list[int]
    # per sample of two or more objects whose own key prefix holds exactly them: a block of
    # one, so a call without the whole block still fetches that sample with one line
    single: list[Block | None] | None = None

    @property
    def units(self) -> list[list[int]]:
        """The samples as units of locality: each block, and each sample outside a block."""
        out: list[list[int]] = []
        i, n = 0, len(self.block_of)
        while i < n:
            b = self.block_of[i]
            if b < 0:
                out.append([i])
                i += 1
            else:
                out.append(list(range(self.blocks[b].start, self.blocks[b].stop)))
                i = self.blocks[b].stop
        return out


def plan_blocks(samples: Sequence[Sample], block_size: int, listing: Sequence[str] | None) -> BlockPlan:
    """Cut the (key-sorted) samples into blocks of at most ``block_size`` samples.

    Args:
        samples: the data set's samples, sorted by key.
        block_size: most samples in a block, except a prefix of up to :data:`GROW` times as
            many whose key names cut it only into parts that would not pay for a wildcard.
        listing: every key the source listing returned, those no sample uses included
            (objects the grouping left out, folder markers). A block's prefix must match no
            key outside the block. Without a listing (object lists, manifests) there are no
            blocks: what else lies under a prefix is unknown.

    Samples outside any block (a key with glob characters, ``..`` or unsafe path parts, a
    prefix shared with other objects, or ``block_size`` 1) are fetched one object at a time.
    """
    n = len(samples)
    block_of = [-1] * n
    blocks: list[Block] = []
    if n == 0 or block_size < 2 or listing is None:
        return BlockPlan(blocks, block_of)
    found = _keys_in_one_bucket(samples)
    if found is None:
        return BlockPlan(blocks, block_of)
    bucket, keys = found
    lo = [min(k) for k in keys]
    hi = [max(k) for k in keys]
    every = sorted(listing)
    counts = [len(k) for k in keys]
    prefix_counts = [0]
    for c in counts:
        prefix_counts.append(prefix_counts[-1] + c)

    def exact(a: int, b: int, p: str) -> bool:
        found = bisect.bisect_left(every, p + _MAX) - bisect.bisect_left(every, p)
        return found == prefix_counts[b] - prefix_counts[a]

    def parts_pay(bounds: list[int]) -> bool:
        # whether a wildcard line pays for at least one part of a split (in objects)
        edges = [prefix_counts[i] for i in bounds]
        return any(wildcard_pays(edges[k + 1] - edges[k]) for k in range(len(edges) - 1))

    stack = [(0, n)]
    while stack:
        a, b = stack.pop()
        p = _lcp(min(lo[a:b]), max(hi[a:b]))
        # split where the character after the common prefix changes
        cuts = [i for i in range(a + 1, b) if lo[i][len(p) : len(p) + 1] != lo[i - 1][len(p) : len(p) + 1]]
        bounds = [a, *(cuts or [(a + b) // 2]), b]
        fits = b - a <= block_size or (b - a <= GROW * block_size and bool(cuts) and not parts_pay(bounds))
        if fits and exact(a, b, p):
            block = _make_block(bucket, p, a, b, keys)
            if block is not None:
                blocks.append(block)
                continue
        if b - a == 1:
            continue
        stack.extend((bounds[i], bounds[i + 1]) for i in range(len(bounds) - 2, -1, -1))
    blocks.sort(key=lambda blk: blk.start)
    for number, blk in enumerate(blocks):
        for i in range(blk.start, blk.stop):
            block_of[i] = number
    single: list[Block | None] = [None] * n
    for i in range(n):
        if counts[i] > 1:
            p = _lcp(lo[i], hi[i])
            if exact(i, i + 1, p):
                single[i] = _make_block(bucket, p, i, i + 1, keys)
    return BlockPlan(blocks, block_of, single)


def block_count(samples: Sequence[Sample], size: int, listing: Sequence[str] | None) -> tuple[int, bool]:
    """How many blocks :func:`plan_blocks` cuts ``samples`` into at ``block_size`` ``size``, and
    whether any holds more than ``size`` samples (one an s5loader before :data:`GROW` cut smaller)."""
    plan = plan_blocks(samples, size, listing)
    return len(plan.blocks), any(len(b) > size for b in plan.blocks)


def _keys_in_one_bucket(samples: Sequence[Sample]) -> tuple[str, list[list[str]]] | None:
    """The bucket of ``samples`` and each sample's keys, or ``None`` when they lie in several
    buckets (a wildcard line lists one)."""
    if isinstance(samples, SampleIndex):
        # the keys straight from the index's string table, no Sample built per sample
        if len(samples.buckets) != 1:
            return None
        every_key = list(samples.text)
        at = samples.first.tolist()
        return samples.buckets[0], [every_key[at[i] : at[i + 1]] for i in range(len(samples))]
    buckets = {_split(f.uri)[0] for s in samples for f in s.fields}
    if len(buckets) != 1:
        return None
    return buckets.pop(), [[_split(f.uri)[1] for f in s.fields] for s in samples]


def _make_block(bucket: str, prefix: str, a: int, b: int, keys: list[list[str]]) -> Block | None:
    folder = prefix[: prefix.rfind("/") + 1]
    # s5cmd cleans paths: a "." or ".." or empty component would change what the wildcard
    # means, so such prefixes never become blocks
    if _GLOB.search(prefix) or (folder and _ODD_FOLDER.search("/" + folder)):
        return None
    rels = []
    for i in range(a, b):
        rel = tuple(k[len(folder) :] for k in keys[i])
        for r in rel:
            if ".." in r:  # wildcard lines exclude such keys (see wildcard_line)
                return None
            if not _SAFE_REL(r):
                return None
        rels.append(rel)
    return Block(bucket, prefix, a, b, tuple(rels))
