"""An epoch of an :class:`~s5loader.S5IterableDataset` resumed mid-way with another number of
ranks, DataLoader workers or batch size.

A worker's state says how far that worker got in its rank's order (``yielded`` of its share, the
positions it owns ``chunk`` at a time: see :mod:`.iterparts`); a ``StatefulDataLoader``'s state
holds one per worker, so together they say which positions of the rank's order were read. Under
DDP the ranks move in lockstep, so every rank had read the same positions of its own order: one
rank's loader state says what the whole epoch has left (:class:`RankRest`). That rest is laid end
to end (old rank 0's first) and cut into equal contiguous parts for the new ranks, padded by
repetition from its start (or cut, with ``drop_last``) as a first cut is (see :mod:`.elastic`);
the new rank's workers share its part as they share an order. A state taken during such a rest
records the rest it came from (``"elastic"``) and resumes with the same ranks, workers and batch
size; on yet other ones it is a :class:`~s5loader.StateError` (resume it from the epoch's end).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..exceptions import StateError
from .elastic import split
from .order import Order
from .pieces import part_len


@dataclass(frozen=True)
class RankRest:
    """What one epoch had left when a rank's loader state was taken: the order's settings, the
    layout it ran on (``ranks``, ``workers``, ``chunk``) and how far each worker got."""

    epoch: int
    shuffle: bool | str
    seed: int
    shuffle_buffer: int
    drop_last: bool
    ranks: int
    workers: int
    chunk: int
    yielded: tuple[int, ...]  # per worker: samples of its share read
    pin: tuple[int, int] | None = None

    def first_order(self, rank: int) -> Order:
        """The order old ``rank`` read the epoch in."""
        return Order(self.shuffle, self.seed, self.ranks, rank, self.drop_last, self.pin)

    def left(self, n: int) -> list[int]:
        """The positions of each old rank's order (of ``n`` samples) not read."""
        length = part_len(n, self.ranks, self.drop_last)
        k, chunk = self.workers, self.chunk
        return [
            p
            for p in range(length)
            if (p // (chunk * k)) * chunk + p % chunk >= self.yielded[(p // chunk) % k]
        ]

    def part_length(self, n: int, world: int, drop_last: bool) -> int:
        """Samples in each new rank's part of the rest (of ``n`` samples, ``world`` new ranks)."""
        total = self.ranks * len(self.left(n))
        return total // world if drop_last else math.ceil(total / world)

    def part(
        self, n: int, order_of: Callable[[Order], list[int]], world: int, rank: int, drop_last: bool
    ) -> list[int]:
        """New ``rank`` of ``world``'s part of the rest; ``order_of`` gives an old rank's whole
        order of the epoch (its shuffle buffer included)."""
        left = self.left(n)
        rest = [i for r in range(self.ranks) for i in _at(order_of(self.first_order(r)), left)]
        return split(rest, world, drop_last)[rank]

    def key(self) -> str:
        """An identity the new rank's workers compare (they must resume one rest)."""
        return repr(self.to_plain())

    def to_plain(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "shuffle_buffer": self.shuffle_buffer,
            "drop_last": self.drop_last,
            "ranks": self.ranks,
            "workers": self.workers,
            "chunk": self.chunk,
            "yielded": list(self.yielded),
            "pin": list(self.pin) if self.pin is not None else None,
        }

    @classmethod
    def from_plain(cls, raw: Any) -> RankRest:
        """Read :meth:`to_plain`'s dict back.

        Raises:
            StateError: anything else.
        """
        try:
            pin = raw["pin"]
            rest = cls(
                _int(raw["epoch"]),
                raw["shuffle"] if raw["shuffle"] == "block" else bool(raw["shuffle"]),
                _int(raw["seed"], negative=True),
                _int(raw["shuffle_buffer"]),
                bool(raw["drop_last"]),
                _int(raw["ranks"], 1),
                _int(raw["workers"], 1),
                _int(raw["chunk"], 1),
                tuple(_int(y) for y in raw["yielded"]),
                (_int(pin[0], 1), _int(pin[1], 1)) if pin is not None else None,
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise StateError(f"state['elastic'] is not the rest of an epoch: {raw!r} ({exc})") from exc
        if rest.pin is not None and rest.pin[1] % rest.pin[0]:
            raise StateError(f"state['elastic'] has a pin whose nodes do not divide its ranks: {rest.pin}")
        if len(rest.yielded) != rest.workers:
            raise StateError(
                f"state['elastic'] says {rest.workers} workers and has {len(rest.yielded)} counts"
            )
        return rest


def _int(v: Any, least: int = 0, negative: bool = False) -> int:
    if type(v) is not int or (not negative and v < least):
        raise ValueError(f"{v!r} is not an int >= {least}")
    return v


def _at(order: list[int], positions: list[int]) -> list[int]:
    return [order[p] for p in positions if p < len(order)]


def worker_states(state: Any) -> list[dict[str, Any]] | None:
    """The dataset states of each DataLoader worker in a ``StatefulDataLoader``'s ``state_dict()``
    (in worker order; with ``num_workers=0``, the one), or None when ``state`` is not one."""
    if not isinstance(state, dict):
        return None
    if state.get("_steps_since_snapshot"):
        raise StateError(
            f"the loader state was taken {state['_steps_since_snapshot']} batches after its last "
            "snapshot (snapshot_every_n_steps > 1), so it does not say where each worker was: take "
            "the state with snapshot_every_n_steps=1 to resume it on another layout"
        )
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, dict) and isinstance(snapshot.get("_worker_snapshots"), dict):
        workers = snapshot["_worker_snapshots"]
        out = []
        for w in range(len(workers)):
            one = workers.get(f"worker_{w}")
            if not isinstance(one, dict) or not isinstance(one.get("dataset_state"), dict):
                raise StateError(f"the loader state has no dataset state for worker {w}")
            out.append(one["dataset_state"])
        return out
    if "_num_yielded" in state and isinstance(state.get("dataset_state"), dict):
        return [state["dataset_state"]]
    return None


def resumed_epoch(loaded: dict[str, Any], epoch: int, epoch_set: bool) -> int:
    """The epoch after loading the state ``loaded``: a state saved mid-epoch resumes its epoch;
    one saved after its epoch ended, the epoch ``set_epoch`` named (``epoch_set``), else the next."""
    if not loaded["complete"]:
        return int(loaded["epoch"])
    return epoch if epoch_set else int(loaded["epoch"]) + 1


def read_state(
    state: Any, check: Callable[[Any], dict[str, Any]], epoch: int, epoch_set: bool
) -> tuple[dict[str, Any] | None, RankRest | None, int]:
    """A state given to ``S5IterableDataset.load_state_dict``: a worker's (``check``-ed), or a
    whole loader's, whose rank's rest of the epoch (on any layout) it gives instead, or its first
    worker's state where every worker had ended the epoch; and the epoch the next pass runs
    (see :func:`resumed_epoch`; ``epoch`` and ``epoch_set`` as the dataset has them)."""
    workers = worker_states(state)
    checked = [check(state)] if workers is None else [check(s) for s in workers]
    rest = rest_of(checked) if workers is not None else None
    if rest is not None:
        return None, rest, rest.epoch
    if workers is not None:  # the epoch was over: the next pass is a whole epoch, nothing to apply
        return None, None, resumed_epoch(checked[0], epoch, epoch_set)
    return checked[0], None, resumed_epoch(checked[0], epoch, epoch_set)


def rest_of(states: list[dict[str, Any]]) -> RankRest | None:
    """What the epoch has left after the checked worker ``states`` of one rank's loader, or None
    when every worker had ended its share (the epoch is over).

    Raises:
        StateError: states of different epochs, orders or layouts; a state itself taken in such
            a rest (resume it with the same ranks, workers and batch size, or from the epoch's end).
    """
    first = states[0]
    if all(s["complete"] for s in states):
        return None
    for s in states:
        if s.get("elastic") is not None:
            raise StateError(
                "the state was taken in the rest of an epoch resumed on another layout: resume it with "
                "the same number of ranks, DataLoader workers and batch_size, or from the epoch's end"
            )
        same = ("epoch", "shuffle", "seed", "shuffle_buffer", "drop_last", "num_replicas", "rank", "chunk")
        if any(s[k] != first[k] for k in same) or s["num_workers"] != len(states):
            raise StateError("the worker states are not those of one StatefulDataLoader's workers")
    pin = first.get("pin")
    return RankRest(
        first["epoch"],
        first["shuffle"],
        first["seed"],
        first["shuffle_buffer"],
        first["drop_last"],
        first["num_replicas"],
        len(states),
        first["chunk"],
        tuple(s["yielded"] for s in sorted(states, key=lambda s: s["worker"])),
        (pin[0], pin[1]) if pin else None,
    )
