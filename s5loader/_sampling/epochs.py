"""A sampler rank's order of each epoch: the :class:`~s5loader._sampling.order.Order` (shuffle,
seed, ranks), the ``shuffle="block"`` window and, over tar shards, what a shard order counts the
bytes its read samples give back with, laid out over the run's units; the pass that stages it;
and everything read off it: the orders of the node's ranks (for the epoch cache), how well an
order mixes, the command files it would run, and its saved state."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any, cast

from .._shards.holding import Freeing
from .._staging.reader import StagedIndex
from .cacheplan import node_ranks
from .elastic import Chain, rest_of_epoch
from .mixing import few_shards
from .order import Order, ShuffleQuality, shuffle_quality
from .passes import write_command_files
from .resume import (
    Position,
    SavedPosition,
    block_stamp,
    check_blocks,
    check_state,
    check_window,
    make_state,
    resume,
    resume_cost,
    resume_window,
)
from .run import StagingRun

log = logging.getLogger(__name__)


class EpochOrders:
    """The orders of the epochs of one rank of an :class:`~s5loader.S5Sampler` over ``run``.

    Args:
        order: the checked order options and this rank's place among the ranks.
        window: the most samples of a ``shuffle="block"`` window (over tar shards with
            ``shuffle`` True or False: the shards open at once).
        run: the staging run whose units and blocks the orders are laid out over.
        cost: over tar shards, what a ``shuffle=True`` order counts the bytes its read samples
            give back with (``None``: it counts nothing).
        can_free: whether this sampler's readers can give bytes back (for a resumed state).
    """

    def __init__(
        self, order: Order, window: int, run: StagingRun, cost: Freeing | None, can_free: bool
    ) -> None:
        self.order = order
        self.window = window
        self.run = run
        self.cost = cost
        self.can_free = can_free
        # an epoch resumed mid-way on another number of ranks (see .elastic): the epoch, the
        # chain of ranks it came through, how its first order was laid out, and its rest here
        self._elastic: tuple[int, Chain, int, Freeing | None, tuple[int, int] | None] | None = None
        self._rest: list[int] | None = None
        # an epoch resumed mid-way whose global order kept samples on the nodes of the job that
        # saved it (see Order.pin), another layout than this job's: the epoch and that layout
        self._pinned: tuple[int, tuple[int, int] | None] | None = None

    def order_of(self, epoch: int) -> Order:
        """The order ``epoch`` is laid out by: this job's, or for an epoch resumed mid-way, the
        nodes of the job that saved it."""
        if self._pinned is not None and epoch == self._pinned[0]:
            return dataclasses.replace(self.order, pin=self._pinned[1])
        return self.order

    def plan(self, epoch: int, start: int = 0) -> tuple[list[int], list[int] | None]:
        """This rank's order of ``epoch`` from ``start`` on, and (``shuffle="block"``) where its
        windows begin (an epoch resumed on other ranks: this rank's part of its rest)."""
        run = self.run
        if self._elastic is not None and epoch == self._elastic[0]:
            return self._rest_part()[start:], None
        return run.units.plan(self.order_of(epoch), epoch, start, run.blocks, self.window, self.cost)

    def _rest_part(self) -> list[int]:
        if self._rest is None:
            self._rest = self._rest_of(self.order.rank)
        return self._rest

    def _rest_of(self, rank: int) -> list[int]:
        """Rank ``rank``'s part of the rest of the epoch resumed on other ranks."""
        assert self._elastic is not None
        epoch, chain, window, cost, pin = self._elastic
        o, run = self.order, self.run

        def part_of(ranks: int, r: int) -> list[int]:
            first = dataclasses.replace(o, num_replicas=ranks, rank=r, pin=pin)
            return run.units.plan(first, epoch, 0, run.blocks, window, cost)[0]

        return rest_of_epoch(part_of, chain, o.num_replicas, rank, o.drop_last)

    def resumed_elsewhere(self, epoch: int) -> bool:
        """Whether ``epoch`` is an epoch resumed mid-way on another number of ranks."""
        return self._elastic is not None and epoch == self._elastic[0]

    def stage(
        self, epoch: Callable[[], int], position: Position, batch: int | None, budget: int
    ) -> Iterator[StagedIndex]:
        """Stage this rank's order of ``epoch()`` from where ``position`` stands (an epoch
        done is staged again from its start) in a new pass, replacing the running one, and
        yield each index once staged; with the ``batch`` size of the DataLoader that cuts the
        indices, at once (its readers wait), after checking that a batch's shards fit ``budget``."""
        run = self.run
        run.passes.close_active()
        if position.epoch_done:
            position.start, position.epoch_done = 0, False  # the same epoch again, from its start
        order, windows = self.plan(epoch(), position.start)
        shuffle, cost = self.order.shuffle, self.cost
        if self.resumed_elsewhere(epoch()):  # a rest: its shards held whole, no windows
            shuffle, cost = (True if shuffle == "block" else shuffle), None
        if batch is not None:  # over tar shards: the shards of one batch must fit at once
            run.units.check_batch(order, batch, budget, cost)
        # without skips=True the run yields staged indices only
        stream = run.stage(order, windows, shuffle, epoch, early=batch is not None)
        yield from cast(Iterator[StagedIndex], stream)

    def few_shards(self, budget: int, who: str = "S5Sampler") -> str | None:
        """The warning for a budget that holds too few tar shards to mix them, if it does."""
        return few_shards(self.run.dataset, budget, self.cost, self.order.shuffle, who)

    def local_orders(self, epoch: int) -> list[list[int]]:
        """The whole order of ``epoch`` of each rank of this node (the epoch cache plans on them)."""
        o, run = self.order, self.run
        if self.resumed_elsewhere(epoch):  # what they stage of it: their parts of its rest
            return [self._rest_of(r) for r in node_ranks(o.rank, o.num_replicas)]
        at = self.order_of(epoch)
        return [
            run.units.plan(dataclasses.replace(at, rank=r), epoch, 0, run.blocks, self.window, self.cost)[0]
            for r in node_ranks(o.rank, o.num_replicas)
        ]

    def quality(self, epoch: int, span: int) -> ShuffleQuality:
        """How well the order of ``epoch`` mixes the blocks ``shuffle="block"`` permutes (tar
        shards, else key-prefix blocks); see :meth:`S5Sampler.shuffle_quality
        <s5loader.S5Sampler.shuffle_quality>`."""
        order = self.plan(epoch)[0]
        unit_of = [0] * len(self.run.dataset)
        for u, members in enumerate(self.run.units.order_units(self.run.blocks)):
            for i in members:
                unit_of[i] = u
        return shuffle_quality(order, unit_of, span)

    def command_files(self, directory: str, epoch: int) -> list[str]:
        """Write the s5cmd command files of the order of ``epoch`` into ``directory``; see
        :meth:`S5Sampler.write_command_files <s5loader.S5Sampler.write_command_files>`."""
        run = self.run
        order, windows = self.plan(epoch)
        return write_command_files(run.dataset, order, windows, run.blocks, run.options, directory)

    def state(self, epoch: int, position: Position) -> dict[str, Any]:
        """The saved state of this rank at ``position`` of ``epoch``."""
        n = len(self.run.dataset)
        if self.resumed_elsewhere(epoch):
            assert self._elastic is not None
            _, chain, window, cost, pin = self._elastic
            room = (cost.room or 0) if cost is not None else 0
            first = dataclasses.replace(self.order, pin=pin)
            state = make_state(first, epoch, n, position, window, self.run.units.name, room, chain)
        else:
            room = (self.cost.room or 0) if self.cost is not None else 0
            order, name = self.order_of(epoch), self.run.units.name
            state = make_state(order, epoch, n, position, self.window, name, room)
        if state["shuffle"] == "block":  # the order depends on how its blocks were cut too
            state.update(block_stamp(self.run.units.block_size(self.run.options)))
        return state

    def load(self, state: dict[str, Any], epoch: int, position: Position) -> int:
        """Continue from a saved ``state``: the order, the window, the run's options and the
        shard order's count as it says, ``position`` moved to where it stopped. Returns the
        epoch of the next pass.

        Raises:
            StateError: the state does not fit (see :func:`~s5loader._sampling.resume.check_state`).
        """
        run, units, n = self.run, self.run.units, len(self.run.dataset)
        saved = check_state(state, n, units)
        size = units.block_size(run.options)
        grown = lambda: any(len(b) > size for b in run.blocks.blocks)  # noqa: E731
        check_blocks(state, saved.shuffle, saved.complete, size, grown)
        window = check_window(state, self.window)
        self._elastic, self._rest, self._pinned = None, None, None
        if (
            units.per_rank(saved.shuffle)
            and not saved.complete
            and saved.units == units.name
            and (saved.num_replicas != self.order.num_replicas or saved.chain)
        ):
            return self._resume_elsewhere(saved, window, position)
        self.order, epoch = resume(saved, self.order, epoch, position, n, units)
        if not saved.complete and saved.pin != self.order.pin:
            self._pinned = (saved.epoch, saved.pin)
        self.window, run.options = resume_window(saved, window, self.window, run.options, units)
        self.cost = resume_cost(saved, self.cost, self.can_free, units, run.dataset.source)
        run.passes.frees = run.passes.frees or self.cost is not None
        return epoch

    def _resume_elsewhere(self, saved: SavedPosition, window: int, position: Position) -> int:
        """Continue an epoch of a per-rank order saved mid-way on ``saved.num_replicas`` ranks
        (or resumed so before) on this job's: this rank's part of its rest (see :mod:`.elastic`)."""
        here, units = self.order.num_replicas, self.run.units
        cost: Freeing | None = None
        if saved.room and saved.shuffle is True:  # the first order counted what samples give back
            cost = units.order_cost()
            if cost is not None:
                cost.room = saved.room
        chain = list(saved.chain)
        if saved.num_replicas == here and chain:  # the same ranks as the rest it was saved in
            position.restart(saved.consumed)
        else:
            chain.append((saved.num_replicas, saved.consumed))
            position.restart(0)
            log.warning(
                "resuming epoch %d of a per-rank order saved mid-way on %d rank(s) with %d: this rank "
                "takes its part of what the epoch had left",
                saved.epoch,
                saved.num_replicas,
                here,
            )
        self.order = Order(saved.shuffle, saved.seed, here, self.order.rank, saved.drop_last, self.order.pin)
        self._elastic = (saved.epoch, chain, window, cost, saved.pin)
        self.window, self.run.options = resume_window(saved, window, self.window, self.run.options, units)
        return saved.epoch
