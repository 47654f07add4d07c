"""A staging pass over tar shards, without a server: which shards a sampler's order stages,
when, and how many are open at once. Unit tests of the private ``ShardPass`` and the engine's
scheduling of the first call, which are the point of them."""

from __future__ import annotations

import pytest

from s5loader import Access, BudgetError
from s5loader._shards import index as _shards


class _FakeShards:
    """What ShardPass needs of a dataset of shards: shard sizes and sample -> (shard, j)."""

    def __init__(self, counts: list[int], sizes: list[int]) -> None:
        from s5loader._shards.shardset import ShardSet

        shards = [_shards.Shard(f"s3://b/{i}.tar", sizes[i], "", n) for i, n in enumerate(counts)]
        self.shards = ShardSet(shards, Access(), "s3://b/")
        self.source = "s3://b/"


def test_a_pass_stages_each_shard_once_per_run_of_its_samples_and_knows_its_peak() -> None:
    from s5loader._shards.shardpass import ShardPass

    ds = _FakeShards([3, 2, 2], [100, 10, 1])
    # padding repeats samples 0 and 1 at the end: shard 0 is staged again for them
    p = ShardPass(ds, [0, 3, 1, 2, 4, 5, 6, 0, 1], "/nowhere", False, "raise")  # type: ignore[arg-type]
    assert p.engine_order == [0, 1, 2, 0]
    assert p.needed == [[0, 1, 2], [0, 1], [0, 1], [0, 1]]
    assert p.visit_of == [0, 1, 0, 0, 1, 2, 2, 3, 3]
    assert p.peak_bytes() == (110, 1)  # shards 0 and 1 are open together
    p.check_budget(110, "block")
    with pytest.raises(BudgetError, match="lower samples_per_call"):
        p.check_budget(109, "block")
    with pytest.raises(BudgetError, match="open as the budget held"):
        p.check_budget(109, True)


def test_the_first_call_stages_the_shards_of_the_first_samples_together(tmp_path) -> None:
    from s5loader._engine import Stager
    from s5loader._s5cmd import S5cmd
    from s5loader._shards.shardpass import ShardPass
    from s5loader._staging.area import StagingArea
    from s5loader.config import StagingOptions

    ds = _FakeShards([4] * 6, [100] * 6)
    # a shuffled order: the first samples lie in shards 0, 2, 5 and 1; shard 0 is read while
    # it downloads, so the engine's first call takes the other three, side by side
    order = [0, 8, 20, 4, 1, 9, 21, 5, 2, 10, 22, 6, 3, 11, 23, 7, *range(12, 20)]
    p = ShardPass(ds, order, "/nowhere", False, "raise")  # type: ignore[arg-type]
    assert p.streamed == 0 and p.engine_order[:4] == [0, 2, 5, 1] and p.first_call == 4
    area = StagingArea(str(tmp_path))
    area.create()
    try:  # the engine skips the streamed shard inside the call's span and stages the other three
        stager = Stager(
            ds.shards,
            p.engine_order,
            area,
            S5cmd(),
            StagingOptions(budget=10_000),
            kept=p.engine_kept(None),
            first_call=p.first_call,
        )
        started: list[list[int]] = []
        stager._start_call = started.append  # type: ignore[method-assign]
        stager._schedule()
        assert [[p.engine_order[pos] for pos in call] for call in started][:1] == [[2, 5, 1]]
    finally:
        area.remove()
    big = _FakeShards([20] * 3, [100] * 3)
    seq = ShardPass(big, list(range(60)), "/nowhere", False, "raise")  # type: ignore[arg-type]
    assert seq.first_call == 1  # in shard order the first samples need the streamed shard alone
