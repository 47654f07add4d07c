"""The parts of :class:`~s5loader.S5IterableDataset`: the rank's order of an epoch (its layout,
the shuffle buffer), how the rank's DataLoader workers share its positions, one worker's walk
through an epoch (:class:`_Pass`) and its resume state. The checks of its options are in
:mod:`.iterchecks`.

A rank stages its order once (see :mod:`.feed` and :mod:`.rankhost`); its workers take turns
along it, ``chunk`` positions at a time: worker ``w`` of ``k`` reads the positions ``p`` with
``(p // chunk) % k == w``. With ``chunk`` the DataLoader's batch size, worker ``w``'s ``b``-th
batch is the rank's ``(b * k + w)``-th run of ``chunk`` samples, so the loader yields the rank's
order exactly.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import get_worker_info

from .._shards.holding import Freeing
from ..dataset import S5Dataset
from ..exceptions import StateError
from .feed import END, ERROR, INDEX, SKIP
from .iterrest import RankRest
from .order import Order
from .pieces import part_len
from .resume import check_fields

# 2: the rank's workers share one order, a chunk at a time ("chunk"); 1 (each worker an order of
# its own) is read for states taken at an epoch's end only
STATE_VERSION = 2
# 3: a state of an order pinned to nodes ("pin") or of a rest resumed on another layout
# ("elastic"), which an s5loader that reads only version 2 would resume in another order
PINNED_VERSION = 3
_STATE_KEYS = (
    "version",
    "epoch",
    "seed",
    "shuffle",
    "shuffle_buffer",
    "drop_last",
    "num_replicas",
    "rank",
    "num_workers",
    "worker",
    "dataset_len",
    "yielded",
    "complete",
)


def freeze_inherited() -> None:
    """In a DataLoader worker, once per process (its first ``iter()``): take the objects it
    holds, those inherited from the loader's process (torch's among them, a few hundred
    thousand) and any made before, out of the cycle collector's walks (``gc.freeze``), so that the
    full collections a worker's shard tables and a host's staging set off walk only what the
    worker made since. Objects made after are collected as before; the loader's own process is
    left alone."""
    global _frozen_in
    if get_worker_info() is None or _frozen_in == os.getpid():
        return
    _frozen_in = os.getpid()
    gc.freeze()


_frozen_in = 0  # the process that froze what it inherited (see freeze_inherited)


# -- how the rank's workers share its positions -------------------------------------------------
def owner(pos: int, num_workers: int, chunk: int) -> int:
    """The worker that reads position ``pos`` of the rank's order."""
    return (pos // chunk) % num_workers


def worker_length(length: int, worker: int, num_workers: int, chunk: int = 1) -> int:
    """How many of the rank's ``length`` positions worker ``worker`` reads."""
    rounds, rest = divmod(length, chunk * num_workers)
    return rounds * chunk + min(max(rest - worker * chunk, 0), chunk)


def worker_position(y: int, worker: int, num_workers: int, chunk: int = 1) -> int:
    """The position in the rank's order of worker ``worker``'s ``y``-th sample."""
    k, off = divmod(y, chunk)
    return (k * num_workers + worker) * chunk + off


def remaining(length: int, starts: list[int], chunk: int) -> list[int]:
    """The rank's positions still to read when worker ``w`` has read ``starts[w]`` of its own."""
    k = len(starts)
    if not any(starts):
        return list(range(length))
    return [p for p in range(length) if (p // (chunk * k)) * chunk + p % chunk >= starts[owner(p, k, chunk)]]


def rank_order(
    units: Any,
    order: Order,
    epoch: int,
    shuffle_buffer: int,
    blocks: Any,
    window: int,
    cost: Freeing | None = None,
) -> tuple[list[int], list[int] | None]:
    """The rank's whole order of ``epoch`` (the sampler's: :meth:`ObjectUnits.plan
    <s5loader._sampling.units.ObjectUnits.plan>` of the data set's ``units``), through the
    shuffle buffer when there is one, and where its ``shuffle="block"`` windows begin (None
    through a buffer, which mixes across them). Through a buffer, a shard order keeps
    ``window`` shards open whatever ``cost`` says: a sample the buffer holds back keeps its
    shard staged, which an order that opens shards as read samples make room would not leave
    room for."""
    mine, windows = units.plan(order, epoch, 0, blocks, window, cost if shuffle_buffer <= 1 else None)
    if shuffle_buffer > 1:
        rng = np.random.default_rng([order.seed & (2**64 - 1), epoch, order.rank])
        return buffer_shuffle(mine, shuffle_buffer, rng), None
    return mine, windows


class Drawn:
    """Rank orders drawn once, by what draws them (``(order, epoch, shuffle_buffer)``; a pass and
    the epoch cache's plan ask for the same ones): kept as arrays for the epochs of the latest
    pass and the one after (an order of epoch ``e`` drawn forgets those before ``e - 1``), a list
    copy of each handed out each time."""

    def __init__(self) -> None:
        self._found: dict[Any, tuple[np.ndarray, list[int] | None]] = {}

    def get(
        self, key: tuple[Any, int, int], draw: Callable[[], tuple[list[int], list[int] | None]]
    ) -> tuple[list[int], list[int] | None]:
        found = self._found.get(key)
        if found is None:
            order, windows = draw()
            kept = {k: v for k, v in self._found.items() if k[1] >= key[1] - 1}
            found = kept[key] = (np.asarray(order, dtype=np.int64), windows)
            self._found = kept
        return found[0].tolist(), None if found[1] is None else list(found[1])


def predraw(host: Any, p: _Pass) -> None:
    """Draw the orders of pass ``p`` (and the next epoch's, which the epoch cache plans on) in
    the hosting worker's main thread while its feed waits for the other workers' hellos; with
    one worker there is no wait, and the feed draws them. What fails here fails again in the
    feed, which tells every worker."""
    if p.num_workers < 2:
        return
    with contextlib.suppress(Exception):
        host.pass_order(p, p.order)
        if host.cache is not None:
            host.cache_orders(p)(p.epoch + 1)


def buffer_shuffle(seq: list[int], k: int, rng: np.random.Generator) -> list[int]:
    """``seq`` through a shuffle buffer of ``k`` (see :class:`S5IterableDataset`)."""
    if k <= 1 or len(seq) <= 1:
        return list(seq)
    draws = rng.random(len(seq))
    buf: list[int] = []
    out: list[int] = []
    t = 0
    for x in seq:
        if len(buf) < k:
            buf.append(x)
            continue
        j = int(draws[t] * k)
        t += 1
        out.append(buf[j])
        buf[j] = x
    while buf:
        j = int(draws[t] * len(buf))
        t += 1
        buf[j], buf[-1] = buf[-1], buf[j]
        out.append(buf.pop())
    return out


# -- a worker's pass and its state -------------------------------------------------------------
@dataclass
class _Pass:
    """One worker's walk through (the rest of) one epoch."""

    epoch: int
    order: Order
    shuffle_buffer: int
    rank: int
    num_replicas: int
    worker: int
    num_workers: int
    chunk: int
    length: int  # samples of this worker's share of the epoch
    yielded: int  # position in that share: samples handed out (or skipped) so far
    rest: RankRest | None = None  # an epoch resumed on another layout: what it had left (.iterrest)

    @property
    def complete(self) -> bool:
        return self.yielded >= self.length

    @property
    def plan(self) -> tuple[Any, ...]:
        """What every worker of the rank must agree on to share one order."""
        o = self.order
        rest = self.rest.key() if self.rest is not None else ""
        return (
            o.shuffle,
            o.seed,
            self.shuffle_buffer,
            o.drop_last,
            self.chunk,
            self.num_replicas,
            self.rank,
            rest,
        )

    def state(self, dataset_len: int) -> dict[str, Any]:
        """The resume state of this pass (see :meth:`S5IterableDataset.state_dict
        <s5loader.S5IterableDataset.state_dict>`)."""
        o = self.order
        extra: dict[str, Any] = {}
        if self.rest is not None:
            extra["elastic"] = self.rest.to_plain()
        if o.pin is not None:
            extra["pin"] = list(o.pin)
        return {
            "version": PINNED_VERSION if extra else STATE_VERSION,
            "epoch": self.epoch,
            "seed": o.seed,
            "shuffle": o.shuffle,
            "shuffle_buffer": self.shuffle_buffer,
            "drop_last": o.drop_last,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "num_workers": self.num_workers,
            "worker": self.worker,
            "chunk": self.chunk,
            "dataset_len": dataset_len,
            "yielded": self.yielded,
            "complete": self.complete,
            **extra,
        }


def start_pass(
    loaded: dict[str, Any] | None,
    order: Order,
    shuffle_buffer: int,
    epoch: int,
    n: int,
    worker: int,
    num_workers: int,
    chunk: int,
    source: str,
    rest: RankRest | None = None,
) -> _Pass:
    """Worker ``worker``'s pass: epoch ``epoch`` of ``order`` (over ``n`` samples) from its
    start, the rest of the epoch a ``loaded`` state was saved in, or this rank's part of the
    ``rest`` of an epoch saved on another layout (see :mod:`.iterrest`).

    Raises:
        StateError: a state saved mid-epoch by another rank, worker or chunk (of ``source``).
    """
    rank, world = order.rank, order.num_replicas
    if rest is not None:
        first = Order(rest.shuffle, rest.seed, world, rank, rest.drop_last, order.pin)
        length = worker_length(rest.part_length(n, world, rest.drop_last), worker, num_workers, chunk)
        return _Pass(
            rest.epoch, first, rest.shuffle_buffer, rank, world, worker, num_workers, chunk, length, 0, rest
        )
    buffer, start = shuffle_buffer, 0
    if loaded is not None and not loaded["complete"]:
        where = f"rank {rank} of {world}, worker {worker} of {num_workers}, chunk {chunk}"
        saved = (
            f"rank {loaded['rank']} of {loaded['num_replicas']}, worker {loaded['worker']} of "
            f"{loaded['num_workers']}, chunk {loaded['chunk']}"
        )
        if saved != where:
            raise StateError(
                f"a state of {source} saved mid-epoch by {saved} cannot resume {where}: resume with "
                "the same number of ranks and DataLoader workers, and the same batch_size, or give "
                "the dataset the whole StatefulDataLoader state of a rank (its load_state_dict) and "
                "iterate a new loader without loading it"
            )
        pin = loaded.get("pin")
        order = Order(
            loaded["shuffle"], loaded["seed"], world, rank, loaded["drop_last"], pin and (pin[0], pin[1])
        )
        buffer, epoch, start = loaded["shuffle_buffer"], loaded["epoch"], loaded["yielded"]
        if loaded.get("elastic") is not None:  # taken in a rest: it goes on with the same layout
            rest = RankRest.from_plain(loaded["elastic"])
    part = (
        rest.part_length(n, world, order.drop_last)
        if rest is not None
        else part_len(n, world, order.drop_last)
    )
    length = worker_length(part, worker, num_workers, chunk)
    if loaded is not None and loaded["complete"]:
        # The saved epoch is over for this worker: this pass yields nothing (its remainder)
        # and the next one is the epoch after it (or the one set_epoch named).
        epoch, start = loaded["epoch"], length
    return _Pass(
        epoch, order, buffer, rank, world, worker, num_workers, chunk, length, min(start, length), rest
    )


def check_state(state: Any, dataset_len: int) -> dict[str, Any]:
    """Check an :meth:`S5IterableDataset.state_dict` for a data set of ``dataset_len`` samples.

    Raises:
        StateError: not such a state, another data set size, a value out of range, or a state
            of an earlier s5loader taken mid-epoch (its workers split the epoch another way).
    """
    check_fields(
        state,
        "S5IterableDataset.state_dict()",
        _STATE_KEYS,
        (1, STATE_VERSION, PINNED_VERSION),
        (
            "epoch",
            "yielded",
            "num_replicas",
            "rank",
            "num_workers",
            "worker",
            "dataset_len",
            "seed",
            "shuffle_buffer",
        ),
        ("drop_last", "complete"),
        dataset_len,
    )
    if state["num_replicas"] < 1 or state["rank"] >= state["num_replicas"]:
        raise StateError(f"state has rank {state['rank']} of {state['num_replicas']}")
    if state["num_workers"] < 1 or state["worker"] >= state["num_workers"]:
        raise StateError(f"state has worker {state['worker']} of {state['num_workers']}")
    if state["version"] == 1 and not state["complete"]:
        raise StateError(
            "the state was taken mid-epoch by an earlier s5loader, whose DataLoader workers each "
            "staged an order of their own; resume from a state taken at an epoch's end, or restart the epoch"
        )
    chunk = state.get("chunk", 1)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise StateError(f"state['chunk'] must be an int >= 1, got {chunk!r}")
    out = {k: state[k] for k in _STATE_KEYS}
    out["shuffle"] = "block" if state["shuffle"] == "block" else bool(state["shuffle"])
    out["chunk"] = chunk
    out["version"] = STATE_VERSION
    if state.get("elastic") is not None:
        out["elastic"] = RankRest.from_plain(state["elastic"]).to_plain()
    pin = state.get("pin")
    if pin is not None:
        ok = isinstance(pin, list) and len(pin) == 2 and all(type(v) is int and v >= 1 for v in pin)
        if not ok or pin[1] % pin[0]:
            raise StateError(f"state['pin'] must be [nodes, ranks], got {pin!r}")
        out["pin"] = list(pin)
    if "elastic" in out or "pin" in out:
        out["version"] = PINNED_VERSION
    return out


def read_feed(dataset: S5Dataset, p: _Pass, messages: Iterator[tuple[str, Any]]) -> Iterator[Any]:
    """The samples of a worker's pass ``p``: each staged index its host sends (see :mod:`.feed`)
    read from ``dataset``, counted in ``p.yielded`` as it goes out, a skipped one counted only;
    the engine's error raised; closes ``messages`` at the end."""
    try:
        for kind, payload in messages:
            if kind == INDEX:
                sample = dataset[payload]
                p.yielded += 1  # before the yield: a state taken now counts this sample
                yield sample
            elif kind == SKIP:
                p.yielded += 1  # skipped (on_error="skip"): counted, so a resumed pass lines up
            elif kind == ERROR:
                raise payload
            elif kind == END:
                break
    finally:
        close = getattr(messages, "close", None)
        if close is not None:
            close()
