"""What a sampler state says: the checks on a loaded ``S5Sampler.state_dict()`` and the
arithmetic of where it resumes (samples consumed, whether the epoch was complete)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from .exceptions import StateError

# 2 added "complete": the state was taken after the epoch's last sample (1 is still read)
STATE_VERSION = 2


class SavedPosition(NamedTuple):
    """A checked state: its order, the epoch, and how far that epoch got."""

    shuffle: bool | str  # True, False or "block"
    seed: int
    num_replicas: int
    drop_last: bool
    epoch: int
    consumed: int  # block order: a position in the rank's slice; otherwise in the global order
    complete: bool


def check_state(state: Any, dataset_len: int) -> SavedPosition:
    """Check a state for a data set of ``dataset_len`` samples and say where it resumes.

    Raises:
        StateError: the state does not fit (another data set size, negative counts, an
            unknown version, a missing key).
    """
    if not isinstance(state, dict):
        raise StateError(f"expected a dict from S5Sampler.state_dict(), got {type(state).__name__}")
    need = ["version", "epoch", "seed", "shuffle", "drop_last", "num_replicas", "dataset_len", "start", "yielded"]
    if state.get("version") == STATE_VERSION:
        need.append("complete")
    missing = [k for k in need if k not in state]
    if missing:
        raise StateError(f"the state lacks {', '.join(missing)}; was it made by S5Sampler.state_dict()?")
    if state["version"] not in (1, STATE_VERSION):
        raise StateError(f"unknown state version {state['version']!r} (this s5loader writes {STATE_VERSION})")
    for k in ("epoch", "start", "yielded", "num_replicas", "dataset_len", "seed"):
        v = state[k]
        if not isinstance(v, int) or isinstance(v, bool) or (k != "seed" and v < 0):
            raise StateError(f"state[{k!r}] must be a non-negative int, got {v!r}")
    if state["shuffle"] not in (True, False, "block"):
        raise StateError(f"state['shuffle'] must be True, False or 'block', got {state['shuffle']!r}")
    if not isinstance(state.get("complete", False), bool):
        raise StateError(f"state['complete'] must be a bool, got {state['complete']!r}")
    if state["num_replicas"] < 1:
        raise StateError(f"state['num_replicas'] must be >= 1, got {state['num_replicas']}")
    n = dataset_len
    if state["dataset_len"] != n:
        raise StateError(f"the state is for a data set of {state['dataset_len']} samples; this one has {n}")
    if state["start"] > n:
        raise StateError(f"state['start']={state['start']} is past the data set's {n} samples")
    block = state["shuffle"] == "block"
    w, drop_last = state["num_replicas"], bool(state["drop_last"])
    consumed = state["start"] + state["yielded"] * (1 if block else w)
    if block:
        end = n // w if drop_last else math.ceil(n / w)
    else:
        end = n - n % w if drop_last else n
    # version 1 did not say whether the epoch was complete: all of it consumed means it was
    complete = state["complete"] if "complete" in state else consumed >= end
    shuffle: bool | str = "block" if block else bool(state["shuffle"])
    return SavedPosition(shuffle, state["seed"], w, drop_last, state["epoch"], consumed, complete)
