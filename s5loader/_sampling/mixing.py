"""A shard order that uses the budget as a shuffle buffer uses memory (see
:meth:`Order.shard_order <s5loader._sampling.order.Order.shard_order>` with a ``cost``).

The staged samples not yet read are the buffer. A rank's shards open one after another as soon
as what the open ones still hold (:class:`~s5loader._shards.holding.Holding`: each its bytes
less what its read samples gave back) leaves room for the next, and each next sample comes from
an open shard drawn with a weight of its unread samples to the power :data:`WEIGHT`: a shard's
first samples go out soon after it opens, its last ones spread over many batches (as in a
shuffle buffer, where a sample drawn late waited long), so many shards feed every batch. A
shard's samples are read from both of its ends toward its middle (the first shard of the order,
read while it downloads, from its front): what its read samples give back is then two runs,
whose blocks come back whole, and samples whose sizes grow or shrink along the shard weigh on
both runs alike.

Also here: how well a budget mixes, and the budget that mixes like a shuffle buffer of
:data:`REFERENCE_BUFFER` samples (:func:`mixing_budget`), for the warning a loader gives at
``iter()`` when its budget holds few shards.
"""

from __future__ import annotations

import math

import numpy as np

from .._shards.holding import Freeing, Shape, run_credit
from .._util.platform import HOLE_BLOCK
from .._util.uri import format_size
from ..dataset import S5Dataset

WEIGHT = 1.5  # a shard's draw weight: its unread samples to this power (draw_open keeps a token with sqrt)
REFERENCE_BUFFER = 1000  # the shuffle buffer (samples) a budget's mixing is compared with
SPAN = 64  # the run of consecutive samples whose distinct shards are counted
_BATCH = 1 << 14


def draw_open(pieces: list[list[int]], room: float, cost: Freeing, rng: np.random.Generator) -> list[int]:
    """The samples of ``pieces`` (each a run of consecutive samples of one shard) in the order
    the module docstring describes: pieces open in order while the bytes they hold leave
    ``room``, one at least.

    What an open piece holds is counted as :class:`~s5loader._shards.holding.Holding` counts a
    visit (its samples done are two runs: the shard's start up to its front, and from its back
    to the shard's end, the samples of the shard outside the piece included)."""
    parts = [(cost.locate(p[0]), len(p), p[0]) for p in pieces if p]
    if not parts:
        return []
    block = HOLE_BLOCK
    batch: list[float] = []  # uniform draws, made _BATCH at a time
    at = _BATCH
    most = max(n for _, n, _ in parts)
    shapes: dict[int, Shape] = {}
    left = [n for _, n, _ in parts]
    front = [0] * len(parts)
    back = [0] * len(parts)
    heads = [0.0] * len(parts)  # what the run from the shard's start gives back
    tails = [0.0] * len(parts)  # and the run to its end
    # one per unread sample of the open pieces: a uniform token is a piece by its count
    tokens: list[int] = []
    out: list[int] = []
    held = 0.0
    queued = opened = 0
    first = -1  # the piece of the order's first sample: read while it downloads, from its front
    total = sum(left)
    while len(out) < total:
        while queued < len(parts):
            (s, j), n, _ = parts[queued]
            shape = shapes.get(s) or shapes.setdefault(s, cost.shape(s))
            if opened and held + shape.disk > room:
                break
            # the samples of the shard outside the piece: given back as the shard opens
            heads[queued] = run_credit(shape, 0, j, block) if j else 0.0
            tails[queued] = run_credit(shape, j + n, shape.count, block) if j + n < shape.count else 0.0
            held += shape.disk - heads[queued] - tails[queued]
            tokens += [queued] * n
            queued += 1
            opened += 1
        while True:  # a token at random, kept with probability sqrt(left / most): weight left ** WEIGHT
            if at == _BATCH:
                batch, at = rng.random(_BATCH).tolist(), 0
            x = batch[at] * len(tokens)
            at += 1
            k = int(x)
            p = tokens[k]
            if left[p] >= most or (x - k) ** 2 * most < left[p]:  # x - k: uniform, apart from k
                break
        tokens[k] = tokens[-1]
        tokens.pop()
        (s, j), n, head = parts[p]
        shape = shapes[s]
        if first < 0:
            first = p
        if at == _BATCH:
            batch, at = rng.random(_BATCH).tolist(), 0
        at += 1
        if p == first or batch[at - 1] < 0.5:
            out.append(head + front[p])
            front[p] += 1
            credit = run_credit(shape, 0, j + front[p], block)
            held -= credit - heads[p]
            heads[p] = credit
        else:
            back[p] += 1
            out.append(head + n - back[p])
            credit = run_credit(shape, j + n - back[p], shape.count, block)
            held -= credit - tails[p]
            tails[p] = credit
        left[p] -= 1
        if not left[p]:  # read: deleted
            held -= shape.disk - heads[p] - tails[p]
            opened -= 1
    return out


def split_by_shard(pieces: list[list[int]], cost: Freeing) -> list[list[int]]:
    """``pieces`` cut where their samples stop being consecutive samples of one shard (the
    padding that repeats a rank's head may run over several shards)."""
    out = []
    for p in pieces:
        if not p:
            continue
        if p[-1] - p[0] == len(p) - 1 and cost.locate(p[0])[0] == cost.locate(p[-1])[0]:
            out.append(p)  # the usual piece: a run of one shard
            continue
        run: list[int] = []
        for i in p:
            if run and (i != run[-1] + 1 or cost.locate(i)[0] != cost.locate(run[-1])[0]):
                out.append(run)
                run = []
            run.append(i)
        out.append(run)
    return out


# -- how well a budget mixes ----------------------------------------------------------------
def buffer_units(shard_samples: float, buffer: int = REFERENCE_BUFFER, span: int = SPAN) -> float:
    """The distinct shards among ``span`` consecutive samples drawn from a shuffle buffer of
    ``buffer`` samples fed shard after shard (``shard_samples`` each), once it is full: a sample
    stays for each draw with probability ``1 - 1/buffer``, so the buffer holds the shard fed
    ``i`` shards ago in proportion to ``q ** i``, ``q = exp(-shard_samples / buffer)``."""
    q = math.exp(-max(1.0, shard_samples) / buffer)
    out, i = 0.0, 0
    while True:
        p = (1 - q) * q**i
        out += 1 - (1 - p) ** span
        if p * span < 1e-4 or i > 100_000:
            return out
        i += 1


def whole_units(open_shards: int, span: int = SPAN) -> float:
    """The distinct shards among ``span`` consecutive samples drawn evenly from ``open_shards``
    shards (an order that frees nothing until a shard is read to its end)."""
    k = max(1, open_shards)
    return k * (1 - (1 - 1 / k) ** span)


def mixing_budget(shard_samples: float, sample_bytes: float, largest: int, frees: bool) -> int:
    """The budget at which a shard order mixes at least like a shuffle buffer of
    :data:`REFERENCE_BUFFER` samples fed shard after shard: where samples read give their bytes
    back, room for half as many samples again beside two largest shards (the one set aside, and
    what opening whole shards leaves unused); else one more than the largest shards that must be
    open at once for :func:`whole_units` to pass :func:`buffer_units`. Checked against the orders
    themselves for shards of 20 to 3,000 samples (tests/unit/test_shard_mixing.py)."""
    if frees:
        return int(1.5 * REFERENCE_BUFFER * sample_bytes + 2 * largest)
    target = buffer_units(shard_samples) + 0.5
    k = 1
    while whole_units(k) < target and k < 4096:
        k += 1
    return (k + 1) * largest


def few_shards(
    dataset: S5Dataset, budget: int, cost: Freeing | None, shuffle: bool | str, who: str
) -> str | None:
    """What a loader with ``shuffle=True`` over tar shards that do not fit ``budget`` says at
    ``iter()`` when the budget is below :func:`mixing_budget`, so that a batch draws from fewer
    shards than a :data:`REFERENCE_BUFFER`-sample shuffle buffer would: the shards it holds, the
    budget that would mix like that buffer, and ``s5loader pack --shuffle``. None otherwise, and
    for shards whose index says ``s5loader pack --shuffle`` wrote them."""
    shards = dataset.shards
    if shuffle is not True or shards is None or dataset.total_bytes <= budget or shards.meta.get("shuffled"):
        return None  # a shuffled pack's shards mix their samples already
    samples = max(1, shards.samples)
    sample_bytes = sum(sh.tarsize or sh.size for sh in shards) / samples
    largest = max(sh.disk for sh in shards)
    need = mixing_budget(samples / max(1, len(shards)), sample_bytes, largest, cost is not None)
    if budget >= need:
        return None
    held = (
        ""
        if cost is not None
        else ", each held whole until its last sample is read (keep_staged keeps shards whole, or "
        "the staging directory cannot punch holes)"
    )
    return (
        f"{who}(shuffle=True) over the tar shards of {dataset.source or 'the data set'}: the budget "
        f"of {format_size(budget)} holds about {budget // largest} of its shards "
        f"({format_size(largest)} the largest{held}), so a batch draws from fewer shards than a "
        f"{REFERENCE_BUFFER}-sample shuffle buffer would, and shards that each hold one class mix "
        f"poorly. A budget of {format_size(need)} mixes at least like that buffer "
        "(shuffle_quality(span=64) measures an order); or write shards whose samples are mixed "
        "already with `s5loader pack --shuffle`"
    )
