"""Resume without a server: the order promise (identical to
``torch.utils.data.DistributedSampler``), positions and resume arithmetic, and a staged index
that survives pickling.

Private modules (``s5loader._sampling``) are imported on purpose: their own behaviour is what
these tests check."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from s5loader._sampling.order import Order


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_order_is_distributed_samplers(shuffle: bool, drop_last: bool) -> None:
    for n in (1, 2, 7, 16, 33, 100):
        for world in (1, 2, 3, 4, 8):
            for epoch in (0, 1, 5):
                for rank in range(world):
                    ref = DistributedSampler(
                        range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=11, drop_last=drop_last
                    )
                    ref.set_epoch(epoch)
                    ours = Order(shuffle, 11, world, rank, drop_last).indices(n, epoch)
                    assert ours == list(ref), (n, world, rank, epoch)


def test_staged_index_survives_pickling() -> None:
    import pickle

    from s5loader.dataset import StagedIndex

    i = StagedIndex(5, "/x/p1", True)
    j = pickle.loads(pickle.dumps(i))
    assert (j, j.folder, j.keep, type(j)) == (5, "/x/p1", True, StagedIndex)
    assert torch.tensor([j]).tolist() == [5]


def test_position_and_resume_arithmetic_without_a_server() -> None:
    from s5loader._sampling.resume import Position, check_state, make_state, resume
    from s5loader._sampling.units import ObjectUnits

    units = ObjectUnits(None)  # type: ignore[arg-type]
    order = Order(True, 7, 2, 1, False)
    mid = Position(start=3, yielded=5, pass_len=10)
    saved = check_state(make_state(order, 4, 20, mid, 100, units.name), 20, units)
    assert (saved.consumed, saved.complete) == (3 + 5 * 2, False)
    here = Position(yielded=2, epoch_done=True)
    resumed, epoch = resume(saved, Order(False, 0, 4, 3, False), 9, here, 20, units)  # now 4 ranks
    assert (resumed.shuffle, resumed.seed, resumed.num_replicas, resumed.rank, epoch) == (True, 7, 4, 3, 4)
    assert (here.start, here.yielded, here.epoch_done) == (13, 0, False)
    done = check_state(
        make_state(order, 4, 20, Position(start=3, yielded=10, pass_len=10), 100, units.name), 20, units
    )
    assert done.complete
    assert resume(done, order, 0, Position(), 20, units)[1] == 5  # the epoch after the saved one
    assert resume(done, order, 8, Position(epoch_set=True), 20, units)[1] == 8  # unless set_epoch said
