"""Call planning: which s5cmd command lines fetch a call's samples, what S3 requests they cost,
and how to read the answers to them (reported path -> sample position and field, scratch path
-> final path). Which positions a call takes is :mod:`.schedule`'s."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .._index.blocks import Block, BlockPlan
from .._index.sample import Sample
from .._s5cmd import (
    can_write,
    copy_line,
    copy_requests,
    wildcard_line,
    wildcard_pays,
    wildcard_requests,
    write_command_file,
)
from .._staging.layout import field_names
from .side import download_requests


@dataclass
class CallPlan:
    """The command lines of one call and how to read s5cmd's answers to them."""

    lines: list[str] = field(default_factory=list)
    items: dict[str, tuple[int, int]] = field(default_factory=dict)  # reported path -> (position, field)
    moves: dict[str, str] = field(default_factory=dict)  # reported path -> final path (scratch paths)
    folders: dict[str, list[str]] = field(default_factory=dict)  # wildcard line's folder -> reported paths
    scratch: list[str] = field(default_factory=list)  # folders to remove when the call ends
    aside: list[tuple[int, int, str, str]] = field(default_factory=list)  # keys no command file can carry
    requests: Counter[str] = field(default_factory=Counter)  # what the lines cost s5cmd: GET, HEAD, LIST


def plan_call(
    samples: Sequence[Sample],
    order: Sequence[int],
    positions: Sequence[int],
    sample_dir: Callable[[int], str],
    layout: BlockPlan | None = None,
    scratch_dir: str = "",
    single: set[int] | frozenset[int] = frozenset(),
    via_scratch: bool = False,
) -> CallPlan:
    """Turn the samples at ``positions`` into s5cmd command lines.

    A block (see :mod:`s5loader._index.blocks`) whose samples are all in the call is fetched with one
    wildcard line into a scratch folder below ``scratch_dir``, where that costs no more S3
    requests than a line per object (:func:`~s5loader._s5cmd.wildcard_pays`: the block has
    enough objects that its LIST costs less than the HEADs it saves); its files are renamed
    into their samples' folders as they arrive. So is a sample of that many objects that has a
    key prefix of its own. Every other object gets its own ``cp --raw`` line: a sample of a few
    objects never costs a LIST. :attr:`CallPlan.requests` counts what the lines cost.
    Destinations come from sample indices and field names only, never from a key (block
    scratch paths come from keys that :mod:`s5loader._index.blocks` checked to be plain names).
    Positions in ``single`` (retries) always go one object at a time.
    With ``via_scratch``, ``cp --raw`` lines also download below ``scratch_dir`` (to
    ``.r/POSITION.FIELD``) and their files are renamed into place on arrival, so a copy
    that is given up on while its call runs on can never write into a sample's folder.
    """
    plan = CallPlan()
    wildcards = _wildcard_groups(order, positions, layout, single)
    for blk, ps, tag in wildcards:
        _add_wildcard(plan, samples, order, sample_dir, blk, ps, f"{scratch_dir}/.{tag}")
    in_blocks = {p for _, ps, _ in wildcards for p in ps}
    raw = f"{scratch_dir}/.r"
    for pos in positions:
        if pos not in in_blocks:
            _add_copies(plan, samples, order, sample_dir, pos, raw if via_scratch else None)
    return plan


def _wildcard_groups(
    order: Sequence[int],
    positions: Sequence[int],
    layout: BlockPlan | None,
    single: set[int] | frozenset[int],
) -> list[tuple[Block, list[int], str]]:
    """The wildcard lines of a call: each block whose samples are all at ``positions`` (none in
    ``single``), then each sample with a key prefix of its own, where one LIST costs less than
    the HEADs it saves; with the positions each fetches and a tag naming its scratch folder."""
    if layout is None:
        return []
    whole: dict[int, list[int]] = {}
    if layout.blocks:
        for pos in positions:
            b = layout.block_of[order[pos]]
            if b >= 0 and pos not in single:
                whole.setdefault(b, []).append(pos)
        whole = {
            b: ps
            for b, ps in whole.items()
            if len({order[p] for p in ps}) == len(layout.blocks[b]) == len(ps)
            and wildcard_pays(layout.blocks[b].objects)
        }
    in_blocks = {p for ps in whole.values() for p in ps}
    wildcards = [(layout.blocks[b], ps, f"b{b}") for b, ps in whole.items()]
    if layout.single is not None:
        for pos in positions:
            blk1 = layout.single[order[pos]]
            if (
                pos not in in_blocks
                and pos not in single
                and blk1 is not None
                and wildcard_pays(blk1.objects)
            ):
                wildcards.append((blk1, [pos], f"s{pos}"))
                in_blocks.add(pos)
    return wildcards


def _add_wildcard(
    plan: CallPlan,
    samples: Sequence[Sample],
    order: Sequence[int],
    sample_dir: Callable[[int], str],
    blk: Block,
    ps: list[int],
    scratch: str,
) -> None:
    """One wildcard line that fetches the samples at ``ps`` into ``scratch``, each file renamed
    into its sample's folder as it arrives."""
    plan.scratch.append(scratch)
    plan.lines.append(wildcard_line(blk.wildcard, scratch + "/"))
    reported = plan.folders.setdefault(scratch + "/", [])
    sizes: list[int] = []
    for pos in ps:
        idx = order[pos]
        sample = samples[idx]
        sizes.extend(f.size for f in sample.fields)
        names = field_names(sample)
        for j, rel in enumerate(blk.rels[idx - blk.start]):
            where = f"{scratch}/{rel}"
            plan.items[where] = (pos, j)
            plan.moves[where] = f"{sample_dir(idx)}/{names[j]}"
            reported.append(where)
    plan.requests += wildcard_requests(sizes)


def _add_copies(
    plan: CallPlan,
    samples: Sequence[Sample],
    order: Sequence[int],
    sample_dir: Callable[[int], str],
    pos: int,
    raw: str | None,
) -> None:
    """A ``cp --raw`` line per object of the sample at ``pos`` (downloading below ``raw``, then
    renamed into place, where given); a key no command file can carry goes aside."""
    idx = order[pos]
    sample = samples[idx]
    folder = sample_dir(idx)
    for j, (f, name) in enumerate(zip(sample.fields, field_names(sample), strict=True)):
        dest = f"{folder}/{name}"
        if not can_write(f.uri):
            plan.aside.append((pos, j, f.uri, dest))
            plan.requests += download_requests(f.size)  # fetched with boto3 instead
            continue
        if raw is not None:
            if not plan.scratch or plan.scratch[-1] != raw:
                plan.scratch.append(raw)
            plan.moves[f"{raw}/{pos}.{j}"] = dest
            dest = f"{raw}/{pos}.{j}"
        plan.lines.append(copy_line(f.uri, dest))
        plan.requests += copy_requests(f.size)
        plan.items[dest] = (pos, j)


def write_plan_files(
    samples: Sequence[Sample],
    order: Sequence[int],
    windows: Sequence[int] | None,
    layout: BlockPlan | None,
    samples_per_call: int,
    stage: str,
) -> list[str]:
    """Write the command files that stage ``order`` into ``stage`` as the engine's calls would:
    ``samples_per_call`` samples per file, cut at the last window start inside (whole windows
    per file), without the engine's small first calls. Returns their paths, in order."""
    paths = []
    cuts = [0]
    while cuts[-1] < len(order):
        end = min(cuts[-1] + samples_per_call, len(order))
        inside = [w for w in windows or () if cuts[-1] < w <= end]
        cuts.append(inside[-1] if inside and end < len(order) else end)
    for n, (first, last) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
        plan = plan_call(
            samples, order, range(first, last), lambda i: f"{stage}/{i}", layout, f"{stage}/.c{n}"
        )
        path = os.path.join(stage, f"call-{n:05d}.txt")
        write_command_file(path, plan.lines)
        paths.append(path)
    return paths
