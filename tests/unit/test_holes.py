"""What readers of a staged tar shard give back (``staging/holes.py``, ``release_shard_sample``):
a block comes back once every sample touching it is done (read, or not needed), counted once
whoever frees it, never a block a sample still to be read (or not yet downloaded) touches.

Private modules (``s5loader._util``, ``s5loader._staging``) are imported on purpose: their own
behaviour is what these tests check."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s5loader._staging.holes import SampleSpans, freed_by, unneeded_ranges

B = 4096


def spans_of(sizes: list[int], known: int | None = None, tail: int = 10240) -> SampleSpans:
    """Samples of one member of ``sizes[k]`` bytes each, after its 512-byte header."""
    ends, at = [], 0
    for size in sizes:
        at += 512 + size
        ends.append(at)
        at = -(-at // 512) * 512
    return SampleSpans(lambda k: ends[k], len(sizes) if known is None else known, len(sizes), at + tail)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 20_000), min_size=1, max_size=40),
    data=st.data(),
)
def test_every_block_comes_back_once_and_only_once_all_samples_touching_it_are_done(
    sizes: list[int], data
) -> None:
    spans = spans_of(sizes)
    n = len(sizes)
    needed = set(data.draw(st.sets(st.integers(0, n - 1), min_size=1)))
    reads = data.draw(st.permutations(sorted(needed)))
    done = set(range(n)) - needed
    freed: list[int] = []
    for lo, hi in unneeded_ranges(spans, needed, B):  # the opener
        freed += range(lo // B, hi // B)
    for j in reads:
        done.add(j)
        lo, hi = freed_by(spans, j, lambda k: k in done, B)
        blocks = list(range(lo // B, max(lo, hi) // B))
        for b in blocks:  # every sample touching the block is done
            touching = [k for k in range(n) if spans.start(k) < (b + 1) * B and spans.end(k) > b * B]
            assert all(k in done for k in touching), (b, touching)
        freed += blocks
    assert len(freed) == len(set(freed))  # counted once
    assert sorted(freed) == list(range(-(-spans.size // B)))  # all done: every block of the file came back


def test_a_shard_still_downloading_keeps_the_blocks_its_unknown_samples_touch() -> None:
    spans = spans_of([3000] * 10, known=5)  # samples 5.. not in the table yet
    lo, hi = freed_by(spans, 4, lambda k: True, B)
    assert hi <= spans.end(4) // B * B  # nothing past the last known sample's last whole block
    whole = spans_of([3000] * 10)
    assert freed_by(whole, 9, lambda k: True, B)[1] >= whole.size  # the tar's end comes with the last sample


def test_readers_of_neighbouring_samples_in_threads_count_each_block_once(tmp_path: Path) -> None:
    from s5loader._staging.layout import StagingLayout
    from s5loader._util.platform import punches_holes

    if not punches_holes(str(tmp_path)):
        pytest.skip("this file system does not punch holes")
    sizes = [1500 + 97 * (k % 13) for k in range(300)]  # small samples: most blocks are shared
    spans = spans_of(sizes)
    told: list[int] = []
    lock = threading.Lock()

    class Counting(StagingLayout):
        __slots__ = ()

        def notify(self, index: int, freed: int = 0) -> None:  # what the engine would be told
            with lock:
                told.append(freed)

    layout = Counting(str(tmp_path))
    os.makedirs(layout.sample_dir(3))
    path = f"{layout.sample_dir(3)}/tar"
    with open(path, "wb") as fh:
        fh.write(os.urandom(spans.size))
    layout.claim_shard(3, range(300))
    before = os.stat(path).st_blocks * 512

    def read(js: range) -> None:
        for j in js:
            with open(path, "r+b") as fh:
                layout.release_shard_sample(3, j, fh.fileno(), spans)

    threads = [
        threading.Thread(target=read, args=(range(w, 299, 4),)) for w in range(4)
    ]  # neighbours in turn
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = os.stat(path).st_blocks * 512
    assert sum(told) == before - after > 0.8 * before  # what the engine is told is what the file gave back
    with open(path, "r+b") as fh:  # the last claim: the shard goes
        assert layout.release_shard_sample(3, 299, fh.fileno(), spans) is True
    assert not os.path.exists(path)
