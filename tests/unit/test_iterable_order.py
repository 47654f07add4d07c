"""S5IterableDataset without a server: how its workers take turns along the rank order, the
order through a shuffle buffer, the buffer draw itself, and its option and state checks.

Private modules (``s5loader._index``, ``s5loader._sampling``) are imported on purpose: their own
behaviour is what these tests check."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.stores import only_folder

from s5loader import BudgetError, ConfigError, S5Dataset, S5IterableDataset, StateError
from s5loader._index.sample import Field, Sample
from s5loader._sampling.iterparts import Drawn, owner, rank_order, remaining, worker_position
from s5loader._sampling.order import Order
from s5loader._sampling.pieces import part_len
from s5loader.iterable import buffer_shuffle, check_state, worker_length


def uneven_units(n: int) -> list[list[int]]:
    """Samples in runs of 1, 3, 2, 5, 1, 3, ... (tar shards of uneven sizes)."""
    units, i, sizes = [], 0, (1, 3, 2, 5)
    while i < n:
        size = sizes[len(units) % 4]
        units.append(list(range(i, min(n, i + size))))
        i += size
    return units


@pytest.mark.parametrize("chunk", [1, 3])
def test_workers_take_turns_along_the_rank_order_and_every_rank_gets_the_same_count(chunk: int) -> None:
    for n in (1, 2, 7, 23, 64):
        for world in (1, 2, 3):
            for drop_last in (False, True):
                length = part_len(n, world, drop_last)
                for nw in (1, 2, 3, 4):
                    owners = [owner(p, nw, chunk) for p in range(length)]
                    lengths = [worker_length(length, w, nw, chunk) for w in range(nw)]
                    assert lengths == [owners.count(w) for w in range(nw)]
                    for w in range(nw):
                        mine = [p for p in range(length) if owners[p] == w]
                        assert [worker_position(y, w, nw, chunk) for y in range(lengths[w])] == mine
                    # what is left when each worker read some of its own: exactly the rest
                    starts = [min(lengths[w], w + 1) for w in range(nw)]
                    rest = remaining(length, starts, chunk)
                    read = {worker_position(y, w, nw, chunk) for w in range(nw) for y in range(starts[w])}
                    assert rest == [p for p in range(length) if p not in read]
                    if chunk > 1 and nw > 1 and length >= chunk * nw:
                        assert owners[:chunk] == [0] * chunk and owners[chunk] == 1  # a batch at a time


def test_the_rank_order_through_a_buffer_is_the_plain_order_reshuffled() -> None:
    from types import SimpleNamespace

    from s5loader._sampling.units import ObjectUnits

    ds = S5Dataset([Sample(f"{i}", (Field("data", f"s3://b/{i}", 10, ""),)) for i in range(23)])
    units, blocks = (
        ObjectUnits(ds),
        SimpleNamespace(units=uneven_units(23)),
    )  # the blocks a block order permutes
    for shuffle in (True, False, "block"):
        o = Order(shuffle, 7, 2, 1, False)
        plain, _ = rank_order(units, o, 2, 0, blocks, 4)
        buffered, windows = rank_order(units, o, 2, 5, blocks, 4)
        assert sorted(buffered) == sorted(plain) and windows is None
        assert rank_order(units, o, 2, 5, blocks, 4)[0] == buffered  # seeded


def test_shuffle_buffer_is_webdatasets_draw() -> None:
    rng = np.random.default_rng(3)
    out = buffer_shuffle(list(range(100)), 10, rng)
    assert sorted(out) == list(range(100)) and out != list(range(100))
    # a sample comes out at most k - 1 places early
    assert all(pos >= x - 9 for pos, x in enumerate(out))
    assert buffer_shuffle(list(range(10)), 1, rng) == list(range(10))


def test_bad_options_and_states_are_config_and_state_errors(staging_root: str) -> None:
    ds = S5Dataset([Sample(f"{i}", (Field("data", f"s3://b/{i}", 10, ""),)) for i in range(5)])
    for bad in (
        {"shuffle": "yes"},
        {"shuffle_buffer": -1},
        {"seed": 1.5},
        {"drop_last": 1},
        {"num_replicas": 2, "rank": 2},
        {"calls_in_flight": 0},
        {"on_error": "ignore"},
        {"budget": "lots"},
    ):
        with pytest.raises(ConfigError):
            S5IterableDataset(ds, staging_dir=staging_root, **bad)
    with pytest.raises(ConfigError, match="S5Dataset"):
        S5IterableDataset([1, 2], staging_dir=staging_root)  # type: ignore[arg-type]
    with pytest.raises(BudgetError, match="s3://b/0"):
        S5IterableDataset(ds, staging_dir=staging_root, budget=5)
    with S5IterableDataset(ds, staging_dir=staging_root) as it:
        state = it.state_dict()
        assert check_state(state, 5)["yielded"] == 0
        for broken, match in (
            ({**state, "dataset_len": 6}, "6 samples"),
            ({**state, "worker": 3}, "worker"),
            ({k: v for k, v in state.items() if k != "epoch"}, "epoch"),
            ([], "dict"),
        ):
            with pytest.raises(StateError, match=match):
                it.load_state_dict(broken)  # type: ignore[arg-type]
        it.load_state_dict({**state, "num_replicas": 2})
        with pytest.raises(
            StateError,
            match="saved mid-epoch by rank 0 of 2, worker 0 of 1, chunk 1 cannot resume rank 0 of 1",
        ):
            iter(it)
        area = only_folder(staging_root)  # the dataset's staging directory
        assert os.path.isdir(area)
    assert not os.path.exists(area)


def test_an_order_is_drawn_once_handed_out_as_copies_and_old_epochs_forgotten() -> None:
    drawn, draws = Drawn(), []

    def draw(epoch: int):
        def make() -> tuple[list[int], list[int] | None]:
            draws.append(epoch)
            return [epoch, 1, 2], None

        return make

    first = drawn.get(("o", 3, 0), draw(3))[0]
    first.append(99)  # a caller's copy: the memo keeps its own
    assert drawn.get(("o", 3, 0), draw(3)) == ([3, 1, 2], None) and draws == [3]
    drawn.get(("o", 4, 0), draw(4))  # the next epoch: epoch 3 is kept
    drawn.get(("o", 3, 0), draw(3))
    assert draws == [3, 4]
    drawn.get(("o", 5, 0), draw(5))  # an epoch two on forgets epoch 3
    drawn.get(("o", 3, 0), draw(3))
    assert draws == [3, 4, 5, 3]
