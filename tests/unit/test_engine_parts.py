"""Unit tests of the staging engine's pure parts: which positions a call takes (windows, budget,
kept samples, samples still held) and the count of fields each sample in flight waits for.

Private modules (``s5loader._index``, ``s5loader._util``, ``s5loader._engine``,
``s5loader._s5cmd``, ``s5loader._staging``) are imported on purpose: their own behaviour is what
these tests check."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from s5loader import BudgetError
from s5loader._engine.budget import Budget
from s5loader._engine.ready import Outstanding, Readiness
from s5loader._engine.schedule import Scheduler, call_end, pick_call
from s5loader._engine.stats import Stats
from s5loader._index.sample import Field, Sample


def _samples(*sizes: int) -> list[Sample]:
    return [Sample(f"k{i}", (Field("data", f"s3://b/k{i}", s, ""),)) for i, s in enumerate(sizes)]


def _budget(limit: int) -> Budget:
    return Budget(limit, threading.Condition(), lambda idx: False, None)


def test_call_end_stops_at_the_last_window_start() -> None:
    windows = [0, 10, 20]
    assert call_end(0, 15, windows, 30) == 10
    assert call_end(0, 25, windows, 30) == 20
    # no window starts inside the call: it grows to the next start, never ending inside a window
    assert call_end(10, 5, windows, 30) == 20
    assert call_end(12, 3, windows, 30) == 20
    assert call_end(20, 5, windows, 30) == 30  # the last window: the order's end
    assert call_end(20, 15, windows, 30) == 30  # the order's end, not a window start
    assert call_end(0, 15, [], 30) == 15


def test_a_call_smaller_than_its_window_takes_the_whole_window() -> None:
    samples = _samples(*([10] * 12))
    pick = pick_call(list(range(12)), samples, _budget(1000), 0, 2, [], [0, 5, 9], None, lambda pos: None)
    assert (pick.picked, pick.nxt, pick.cut) == ([0, 1, 2, 3, 4], 5, False)
    # retries take places from samples_per_call where the call does not grow (no windows)
    pick = pick_call(list(range(12)), samples, _budget(1000), 4, 3, [0, 1], [], None, lambda pos: None)
    assert (pick.picked, pick.nxt) == ([0, 1, 4], 5)


def test_two_calls_run_until_the_first_ends_and_the_first_has_a_worker_per_copy() -> None:
    stats = Stats(samples=100)
    common = {"kept": None, "windows": None, "first_call": 32}
    plain = Scheduler([], [], _budget(1), None, None, stats, **common)
    wide = Scheduler([], [], _budget(1), None, None, stats, **common, first_workers=256)
    assert (plain.most_calls(4, 0), plain.most_calls(1, 0)) == (2, 1)  # no call ended yet
    assert (wide.workers(64, 32, 4), wide.workers(10, 32, 4), wide.workers(1000, 32, 4)) == (64, 32, 96)
    assert wide.workers(1000, 128, 4) == 256  # at most first_workers
    # a user's few workers bound the first call too: 4 x (4 - 1) requests, never below the 4
    assert (wide.workers(64, 4, 4), wide.workers(64, 4, 1), wide.workers(64, 512, 2)) == (12, 4, 512)
    assert plain.workers(64, 32, 4) is None  # no first_workers: the s5cmd's own
    stats.calls = 2
    assert (plain.most_calls(4, 2), plain.most_calls(4, 1)) == (2, 4)  # one of two ended
    assert wide.workers(64, 32, 4) is None  # only the first call


def test_pick_call_takes_what_fits_and_keeps_windows_whole() -> None:
    samples = _samples(*([10] * 12))
    order = list(range(12))
    # 45 bytes fit 4 samples; the cut falls inside the window [3, 6): the call ends at 3
    budget = _budget(45)
    pick = pick_call(order, samples, budget, 0, 12, [], [0, 3, 6, 9], None, lambda pos: None)
    assert (pick.picked, pick.nxt, pick.cut, pick.whole, pick.end) == ([0, 1, 2], 3, True, True, 12)
    assert not budget.blocked
    # without windows the call takes what fits
    pick = pick_call(order, samples, _budget(45), 0, 12, [], [], None, lambda pos: None)
    assert (pick.picked, pick.nxt, pick.cut, pick.whole) == ([0, 1, 2, 3], 4, True, False)


def test_pick_call_skips_kept_samples_and_waits_for_held_ones() -> None:
    samples = _samples(*([10] * 6))
    order = [0, 1, 2, 3, 1, 4]  # padding repeats index 1
    marked: list[int] = []
    pick = pick_call(order, samples, _budget(1000), 0, 6, [], [], {0, 2}, marked.append)
    # 0 and 2 are kept (marked ready, passed); the repeated 1 waits for its first copy
    assert marked == [0, 2]
    assert (pick.picked, pick.nxt, pick.cut) == ([1, 3], 4, True)
    # the unstaged part begins at 1, not after the kept 2: a call held back for releases
    # must not leave position 1 behind
    assert pick.first == 1
    budget = _budget(1000)
    budget.reserve(1, 10)  # still on disk
    pick = pick_call(order, samples, budget, 1, 6, [], [], None, lambda pos: None)
    assert pick.picked == [] and budget.blocked
    # a retried position still holds its budget and comes first
    pick = pick_call(order, samples, _budget(15), 3, 6, [2], [], None, lambda pos: None)
    assert pick.picked == [2, 3]


def test_kept_units_at_the_start_do_not_hold_back_the_first_call(tmp_path: Path) -> None:
    # Over shards the first unit of a pass is read while it downloads (kept from the engine)
    # and the first call takes one unit: the engine must start the call after it at once, not
    # after its next wake-up (0.2 s), which the first batch waited for.
    from s5loader._engine import Stager
    from s5loader._s5cmd import S5cmd
    from s5loader._staging.area import StagingArea
    from s5loader.config import StagingOptions

    area = StagingArea(str(tmp_path))
    area.create()
    try:
        stager = Stager(
            _samples(10, 10, 10, 10),
            [0, 1, 2, 3],
            area,
            S5cmd(),
            StagingOptions(budget=1000),
            kept={0},
            first_call=1,
        )
        started: list[list[int]] = []
        stager._start_call = started.append  # type: ignore[method-assign]
        stager._schedule()
        assert started and started[0] == [1]  # the unit after the kept one, in the same round
    finally:
        area.remove()


def test_pick_call_rejects_a_sample_larger_than_the_budget() -> None:
    with pytest.raises(BudgetError, match="s3://b/k1"):
        pick_call([0, 1], _samples(5, 50), _budget(20), 0, 2, [], [], None, lambda pos: None)


def test_outstanding_counts_fields_per_sample() -> None:
    out = Outstanding()
    out.start(0, 2)
    out.start(1, 1)
    assert out.objects == 3 and 0 in out
    assert not out.done(0) and out.done(0) and 0 not in out
    assert not out.done(0)  # a late answer counts for nothing
    out.start(1, 3)  # a retry starts the sample again
    assert out.objects == 3
    out.forget(1)
    assert out.objects == 0 and not out.done(1)


def test_a_shard_sample_read_is_punched_out_and_the_engine_counts_what_that_freed(tmp_path: Path) -> None:
    import os

    from s5loader._staging.holes import SampleSpans
    from s5loader._staging.layout import StagingLayout
    from s5loader._staging.release_events import ReleaseEvents
    from s5loader._util.platform import punches_holes

    if not punches_holes(str(tmp_path)):
        pytest.skip("this file system does not punch holes")
    layout = StagingLayout(str(tmp_path))
    events = ReleaseEvents(layout).open()
    try:
        os.makedirs(layout.sample_dir(7))
        path = f"{layout.sample_dir(7)}/tar"
        parts = [bytes([k + 1]) * 65536 for k in range(3)]  # three samples' data, 64 KiB each, after a header
        with open(path, "wb") as fh:
            fh.write(b"h" * 512 + b"".join(parts))
        layout.claim_shard(7, [0, 1, 2])
        size = os.path.getsize(path)
        budget = Budget(
            10 * size, threading.Condition(), lambda i: not os.path.isdir(layout.sample_dir(i)), events
        )
        budget.hold_on_disk(7, size)
        before = os.stat(path).st_blocks * 512

        spans = SampleSpans(lambda k: 512 + (k + 1) * 65536, 3, 3, size)
        with open(path, "r+b") as fh:  # sample 1 read: its whole blocks go at once, the others stay
            assert layout.release_shard_sample(7, 1, fh.fileno(), spans) is False
        freed = before - os.stat(path).st_blocks * 512
        assert 65536 - 8192 <= freed <= 65536
        with open(path, "rb") as fh:
            data = fh.read()
        assert data[512 : 512 + 65536] == parts[0] and data[512 + 2 * 65536 :] == parts[2]
        budget.on_events()
        assert budget.reserved == size - freed and budget.held[7] == size - freed

        for j in (0, 2):  # the last claim deletes the shard: everything it held comes back
            with open(path, "r+b") as fh:
                layout.release_shard_sample(7, j, fh.fileno(), spans)
        assert not os.path.exists(path)
        budget.on_events()
        assert budget.reserved == 0 and 7 not in budget.held
    finally:
        events.close()


def test_a_call_the_budget_cuts_short_waits_until_a_quarter_is_free() -> None:
    b = _budget(100)
    ready = Readiness(10, Stats())
    b.reserve(1, 80)  # 20 free: a call of what fits would be a sliver
    assert b.put_off(1, 10, [], ready) and b.blocked  # waits for releases, and counts as blocked
    b.free(1)
    b.reserve(1, 75)  # a quarter free: worth a call
    assert not b.put_off(1, 10, [], ready)
    b.reserve(2, 5)
    ready.consumer_waiting = 1.0  # a consumer waits for a sample not staged: start now
    assert not b.put_off(1, 10, [], ready)
    ready.consumer_waiting = 0.0
    b.last_release -= 60  # no release for a minute: nothing would free the room
    assert not b.put_off(1, 10, [], ready)
    b.last_release += 60
    assert b.put_off(1, 10, [], ready)
    assert b.put_off(4, 10, ["a call in flight"], ready) and not b.put_off(5, 10, ["a call in flight"], ready)
    nothing = _budget(100)  # nothing held: nothing would free room
    assert not nothing.put_off(1, 10, [], ready)


def _pairs(n: int, fields: int = 2, size: int = 10) -> list[Sample]:
    return [
        Sample(f"t/{i:03d}", tuple(Field(f"f{k}", f"s3://b/t/{i:03d}.f{k}", size, "") for k in range(fields)))
        for i in range(n)
    ]


def test_line_shapes_cost_no_list_per_sample_and_count_their_requests() -> None:
    from s5loader._engine.callplan import plan_call
    from s5loader._index.blocks import plan_blocks
    from s5loader._s5cmd import WILDCARD_MIN_OBJECTS

    samples = _pairs(40)  # blocks t/00*, t/01*, ... of 10 samples: 20 objects each
    listing = [f.uri[len("s3://b/") :] for s in samples for f in s.fields]
    blocks = plan_blocks(samples, 10, listing)
    order = list(range(40))
    # a whole block: one wildcard line (a LIST and its 20 GETs); half a block: a cp --raw line
    # per object (a HEAD and a GET each), never a wildcard per sample (a LIST per sample)
    plan = plan_call(samples, order, list(range(15)), lambda i: f"/s/{i}", blocks, "/s/.c1")
    assert sum("*' " in line for line in plan.lines) == 1
    assert sum(line.startswith("cp --raw") for line in plan.lines) == 10
    assert plan.requests == {"LIST": 1, "GET": 20 + 10, "HEAD": 10}
    # blocks of fewer objects than a LIST is worth: a cp --raw line per object
    small = plan_blocks(_pairs(40, fields=1), 10, [f"t/{i:03d}.f0" for i in range(40)])
    assert small.blocks and all(b.objects < WILDCARD_MIN_OBJECTS for b in small.blocks)
    plan = plan_call(_pairs(40, fields=1), order, order, lambda i: f"/s/{i}", small, "/s/.c1")
    assert all(line.startswith("cp --raw") for line in plan.lines) and plan.requests == {
        "HEAD": 40,
        "GET": 40,
    }
    # a sample of 13 objects under a prefix of its own: one wildcard line is cheaper than 13 HEADs
    big = _pairs(3, fields=WILDCARD_MIN_OBJECTS)
    plan = plan_call(
        big,
        [0, 1, 2],
        [1],
        lambda i: f"/s/{i}",
        plan_blocks(big, 10, [f.uri[len("s3://b/") :] for s in big for f in s.fields]),
        "/s/.c1",
    )
    assert plan.lines == ["cp --exclude '*..*' 's3://b/t/001.f*' /s/.c1/.s1/\n"]
    assert plan.requests == {"LIST": 1, "GET": WILDCARD_MIN_OBJECTS}


def test_request_counts_of_each_line_kind() -> None:
    from s5loader._engine.side import download_requests
    from s5loader._s5cmd import copy_requests, wildcard_requests

    mib = 1024**2
    assert copy_requests(100) == {"HEAD": 1, "GET": 1}
    assert copy_requests(120 * mib) == {"HEAD": 1, "GET": 3}  # 50 MiB parts
    assert wildcard_requests([10] * 2500) == {"LIST": 3, "GET": 2500}  # 1,000 keys a page
    assert wildcard_requests([0, 10]) == {"LIST": 1, "GET": 2, "HEAD": 1}  # s5cmd asks again for an empty one
    assert download_requests(10) == {"HEAD": 1, "GET": 1}
    assert download_requests(20 * mib) == {"HEAD": 1, "GET": 3}  # boto3's 8 MiB parts


def test_an_engine_error_of_a_full_file_system_is_a_staging_space_error() -> None:
    import errno

    from s5loader._engine.stager import _no_space
    from s5loader.exceptions import StagingSpaceError

    got = _no_space(OSError(errno.ENOSPC, "No space left on device"), "/stage")
    assert isinstance(got, StagingSpaceError) and "/stage ran out of space" in str(got)
    other = OSError(errno.EIO, "I/O error")
    assert _no_space(other, "/stage") is other
