"""What a sampler state says: the checks on a loaded ``S5Sampler.state_dict()`` and the
arithmetic of where it resumes (samples consumed, whether the epoch was complete), and the
position a sampler keeps in its epoch."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from .._index.blocks import GROW
from ..config import StagingOptions
from ..exceptions import StateError
from .elastic import check_chain
from .order import Order, check_shuffle
from .pieces import part_len

log = logging.getLogger(__name__)

# 2 added "complete": the state was taken after the epoch's last sample (1 is still read)
STATE_VERSION = 2
# a state taken in the rest of an epoch resumed on other ranks ("elastic"): its positions count in
# that rest, which an s5loader that reads only version 2 would take for the whole part: it refuses;
# likewise a state of an order pinned to nodes ("pin"), whose global order version 2 would not know
ELASTIC_VERSION = 3


class SavedPosition(NamedTuple):
    """A checked state: its order, the epoch, and how far that epoch got."""

    shuffle: bool | str  # True, False or "block"
    seed: int
    num_replicas: int
    drop_last: bool
    epoch: int
    consumed: int  # a per-rank order (block, shards): a position in the rank's part; else in the global order
    complete: bool
    units: str = "sample"  # the kind of units the saving sampler staged (its units' name)
    room: int = 0  # a shard order that counted what its samples give back: the bytes it kept open
    chain: tuple[tuple[int, int], ...] = ()  # a per-rank epoch resumed on other ranks: see .elastic
    pin: tuple[int, int] | None = None  # the order kept samples on their nodes: see Order.pin


def check_fields(
    state: Any,
    made_by: str,
    keys: Sequence[str],
    versions: Sequence[int],
    ints: Sequence[str],
    bools: Sequence[str],
    dataset_len: int,
) -> dict[str, Any]:
    """The checks every saved state gets (a sampler's, an iterable dataset's worker's): a dict
    from ``made_by`` with ``keys``, a known version, the ``ints`` non-negative (a seed may be
    any int), the ``bools`` bools, a valid ``shuffle``, and the same data set size.

    Raises:
        StateError: naming the key and the value that do not fit.
    """
    if not isinstance(state, dict):
        raise StateError(f"expected a dict from {made_by}, got {type(state).__name__}")
    missing = [k for k in keys if k not in state]
    if missing:
        raise StateError(f"the state lacks {', '.join(missing)}; was it made by {made_by}?")
    if state["version"] not in versions:
        raise StateError(f"unknown state version {state['version']!r} (this s5loader writes {max(versions)})")
    for k in ints:
        v = state[k]
        if not isinstance(v, int) or isinstance(v, bool) or (k != "seed" and v < 0):
            raise StateError(f"state[{k!r}] must be a non-negative int, got {v!r}")
    check_shuffle(state["shuffle"], "state['shuffle']", StateError)
    for k in bools:
        if k in state and not isinstance(state[k], bool):
            raise StateError(f"state[{k!r}] must be a bool, got {state[k]!r}")
    if state["dataset_len"] != dataset_len:
        raise StateError(
            f"the state is for a data set of {state['dataset_len']} samples; this one has {dataset_len}"
        )
    return state


def check_state(state: Any, dataset_len: int, units: Any) -> SavedPosition:
    """Check a state for a data set of ``dataset_len`` samples whose ``units`` (its
    :func:`~s5loader._sampling.units.units_of`) say how positions count, and say where it
    resumes.

    Raises:
        StateError: the state does not fit (another data set size, negative counts, an
            unknown version, a missing key).
    """
    need = [
        "version",
        "epoch",
        "seed",
        "shuffle",
        "drop_last",
        "num_replicas",
        "dataset_len",
        "start",
        "yielded",
    ]
    if isinstance(state, dict) and state.get("version") in (STATE_VERSION, ELASTIC_VERSION):
        need.append("complete")
    check_fields(
        state,
        "S5Sampler.state_dict()",
        need,
        (1, STATE_VERSION, ELASTIC_VERSION),
        ("epoch", "start", "yielded", "num_replicas", "dataset_len", "seed"),
        ("complete",),
        dataset_len,
    )
    if state["num_replicas"] < 1:
        raise StateError(f"state['num_replicas'] must be >= 1, got {state['num_replicas']}")
    n = dataset_len
    if state["start"] > n:
        raise StateError(f"state['start']={state['start']} is past the data set's {n} samples")
    # "sharded": True is how states of version 2 said "tar shard"
    kind = state.get("units", "tar shard" if state.get("sharded") is True else "sample")
    if not isinstance(kind, str):
        raise StateError(f"state['units'] must be a str, got {kind!r}")
    block = units.per_rank(state["shuffle"])
    w, drop_last = state["num_replicas"], bool(state["drop_last"])
    consumed = state["start"] + state["yielded"] * (1 if block else w)
    if block:
        end = part_len(n, w, drop_last)
    else:
        end = n - n % w if drop_last else n
    # version 1 did not say whether the epoch was complete: all of it consumed means it was
    complete = state["complete"] if "complete" in state else consumed >= end
    shuffle: bool | str = "block" if state["shuffle"] == "block" else bool(state["shuffle"])
    room = state.get("room", 0)
    if not isinstance(room, int) or isinstance(room, bool) or room < 0:
        raise StateError(f"state['room'] must be a non-negative int, got {room!r}")
    chain = tuple(check_chain(state["elastic"])) if state.get("elastic") else ()
    return SavedPosition(
        shuffle,
        state["seed"],
        w,
        drop_last,
        state["epoch"],
        consumed,
        complete,
        kind,
        room,
        chain,
        _pin(state),
    )


def _pin(state: dict[str, Any]) -> tuple[int, int] | None:
    """A state's ``"pin"``: ``[nodes, ranks]``, the nodes dividing the ranks (see :attr:`Order.pin`)."""
    pin = state.get("pin")
    if pin is None:
        return None
    ok = isinstance(pin, list) and len(pin) == 2 and all(type(v) is int and v >= 1 for v in pin)
    if not ok or pin[1] % pin[0]:
        raise StateError(f"state['pin'] must be [nodes, ranks], the nodes dividing the ranks; got {pin!r}")
    return (pin[0], pin[1])


@dataclass
class Position:
    """Where a sampler is in its epoch, the part of it a state records.

    ``start`` is the position the next pass starts at (a resumed epoch), ``yielded`` the
    indices the current pass handed out (skipped samples included), ``pass_len`` that pass's
    length once it began, ``epoch_done`` whether the last pass ran to the end of its epoch,
    and ``epoch_set`` whether ``set_epoch`` was called (a loaded end-of-epoch state defers to it).
    """

    start: int = 0
    yielded: int = 0
    pass_len: int | None = None
    epoch_done: bool = False
    epoch_set: bool = False

    def restart(self, start: int = 0) -> None:
        """Forget the current pass; the next one starts at ``start``."""
        self.start, self.yielded, self.pass_len, self.epoch_done = start, 0, None, False

    @property
    def complete(self) -> bool:
        """The epoch's last sample was handed out."""
        return self.epoch_done or (self.pass_len is not None and self.yielded >= self.pass_len)


def make_state(
    order: Order,
    epoch: int,
    dataset_len: int,
    position: Position,
    window: int,
    units: str,
    room: int = 0,
    chain: Sequence[tuple[int, int]] = (),
) -> dict[str, Any]:
    """The dict ``S5Sampler.state_dict()`` returns (read back by :func:`check_state`); ``units``
    names the kind of units staged, ``room`` the bytes a shard order that counts what its
    samples give back keeps open (0: it counts nothing), ``chain`` the ranks an epoch resumed
    on other ranks came through (see :mod:`.elastic`; then ``start`` and ``yielded`` count in
    its rest)."""
    return {
        "version": ELASTIC_VERSION if chain else STATE_VERSION,
        "epoch": epoch,
        "seed": order.seed,
        "shuffle": order.shuffle,
        "drop_last": order.drop_last,
        "num_replicas": order.num_replicas,
        "dataset_len": dataset_len,
        "start": position.start,
        "yielded": position.yielded,
        "complete": position.complete,
        "window": window,  # shuffle="block" and shard orders: the order depends on it
        "units": units,
        "room": room,  # and a shard order that counts what its samples give back, on this
        **({"elastic": [list(p) for p in chain]} if chain else {}),
        **({"pin": list(order.pin), "version": ELASTIC_VERSION} if order.pin is not None else {}),
    }


def block_stamp(block_size: int) -> dict[str, int]:
    """What a state of a ``shuffle="block"`` order records of how its blocks were cut: the
    ``block_size`` and the rule (:data:`~s5loader._index.blocks.GROW`)."""
    return {"block_size": block_size, "block_rule": GROW}


def check_blocks(
    state: dict[str, Any], shuffle: bool | str, done: bool, block_size: int, grown: Callable[[], bool]
) -> None:
    """A ``shuffle="block"`` epoch resumed mid-way goes on in its saved order only over blocks
    cut as they were: the same ``block_size`` and rule (:func:`block_stamp`). A state without
    them comes from an s5loader that made no block of more than ``block_size`` samples, so it
    goes on unless this data set has such a block (``grown()``, asked only then).

    Raises:
        StateError: the data set's blocks are cut otherwise than the state's.
    """
    if shuffle != "block" or done:
        return
    if "block_rule" in state:
        saved = (state.get("block_size"), state["block_rule"])
        if saved == (block_size, GROW):
            return
        cut = f"blocks of at most {saved[0]} samples (rule {saved[1]})"
    elif grown():
        cut = "blocks of at most block_size samples (an s5loader before blocks could grow)"
    else:
        return
    raise StateError(
        f'the state\'s shuffle="block" epoch was cut into {cut}, this run into blocks of at most '
        f"{block_size} (rule {GROW}; up to {GROW}x where parts would not pay): its order cannot go "
        "on here; resume with the block_size and version that saved it, or start the epoch again"
    )


def check_window(state: dict[str, Any], default: int) -> int:
    """The saved ``shuffle="block"`` window or open shards (``default`` for a state without one)."""
    window = state.get("window", default)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise StateError(f"state['window'] must be a positive int, got {window!r}")
    return window


def resume_window(
    saved: SavedPosition, window: int, current: int, options: StagingOptions, units: Any
) -> tuple[int, StagingOptions]:
    """The ``shuffle="block"`` window (or a shard order's open shards) a resumed epoch uses:
    the saved order's, whatever this job's budget gives, with a block order's
    ``samples_per_call`` raised to hold it."""
    if not units.per_rank(saved.shuffle) or window == current:
        return current, options
    if saved.shuffle != "block":
        log.info(
            "resuming a shard order with the saved %d open shard(s) (this budget gives %d)", window, current
        )
        return window, options
    log.info(
        "shuffle='block': resuming with the saved window of %d samples (this budget gives %d)",
        window,
        current,
    )
    if options.samples_per_call < window:
        options = replace(options, samples_per_call=window)
    return window, options


def resume(
    saved: SavedPosition, order: Order, epoch: int, position: Position, dataset_len: int, units: Any
) -> tuple[Order, int]:
    """The order and epoch a sampler with ``order`` (this job's ranks) continues ``saved`` with,
    setting ``position`` to where the next pass starts.

    Raises:
        StateError: a ``shuffle="block"`` or shard-order epoch saved mid-way with another
            number of ranks, or by a sampler over other data (tar shards or not).
    """
    w, n, here = saved.num_replicas, dataset_len, order.num_replicas
    what = "a shuffle='block'" if saved.shuffle == "block" else "a shard-order"
    if saved.units != units.name and not saved.complete:
        raise StateError(
            f"the state was saved mid-epoch by a sampler that staged {saved.units}s; "
            f"this one stages {units.name}s"
        )
    if units.per_rank(saved.shuffle) and w != here and not saved.complete:  # see resume_elsewhere
        raise StateError(
            f"{what} epoch resumes only with the same number of ranks: the state has {w}, this job {here}"
        )
    if w != here and not saved.complete:
        log.warning(
            "resuming with %d rank(s) from a state saved with %d: continuing the global "
            "order at position %d of %d",
            here,
            w,
            min(saved.consumed, n),
            n,
        )
    resumed = Order(saved.shuffle, saved.seed, here, order.rank, saved.drop_last, order.pin)
    if saved.complete:
        position.restart(0)
        return resumed, epoch if position.epoch_set else saved.epoch + 1
    position.restart(min(saved.consumed, n))
    return resumed, saved.epoch


def resume_cost(saved: SavedPosition, cost: Any, possible: bool, units: Any, source: str) -> Any:
    """What a resumed shard order counts what its samples give back with (see
    :meth:`ShardUnits.order_cost <s5loader._sampling.units.ShardUnits.order_cost>`): for an
    epoch saved mid-way, the saved order's (``saved.room`` bytes kept open, or nothing counted),
    whatever this job's budget gives; else ``cost``. ``possible``: this sampler's readers can
    give bytes back (no ``keep_staged``, a file system that punches holes).

    Raises:
        StateError: the saved order counted what its samples give back and this sampler's
            readers cannot give it back.
    """
    if saved.complete or saved.units != units.name or saved.shuffle is not True or not units.per_rank(True):
        return cost
    if not saved.room:
        return None
    if not possible:
        raise StateError(
            f"the state of {source or 'the data set'} was saved mid-epoch by a shard order that counts "
            "the bytes its samples give back as they are read; this sampler's readers cannot "
            "(keep_staged keeps shards whole, or the staging directory's file system cannot punch "
            "holes): resume with the same options and staging_dir, or from a state taken at an "
            "epoch's end"
        )
    resumed = units.order_cost()
    resumed.room = saved.room
    if cost is None or cost.room != saved.room:
        log.info(
            "resuming a shard order with the saved %d bytes open (this budget gives %s)",
            saved.room,
            cost.room if cost is not None else "none",
        )
    return resumed


def sampler_state(state: Any) -> Any:
    """A sampler's own state in ``state``: ``state`` itself, or the sampler's part of a
    ``StatefulDataLoader.state_dict()`` (``sampler=`` or ``batch_sampler=``, with or without
    workers).

    Raises:
        StateError: a loader state that holds no sampler state.
    """
    if not isinstance(state, dict) or not ("_snapshot" in state or "_sampler_iter_state" in state):
        return state
    if state.get("_steps_since_snapshot"):
        raise StateError(
            "the loader state was taken batches after its last snapshot (snapshot_every_n_steps > 1): "
            "load it with StatefulDataLoader.load_state_dict, or take it with snapshot_every_n_steps=1"
        )
    main = state.get("_snapshot", {}).get("_main_snapshot", state) if "_snapshot" in state else state
    if isinstance(main.get("_index_sampler_state"), dict):
        return main["_index_sampler_state"]  # batch_sampler=sampler.batches(n)
    it = main.get("_sampler_iter_state")
    if isinstance(it, dict) and isinstance(it.get("sampler_state"), dict):
        return it["sampler_state"]
    raise StateError("the StatefulDataLoader state holds no sampler state: was its sampler an S5Sampler?")
