"""Ranks of a job as samplers in one process, in lockstep (as under DDP)."""

from __future__ import annotations

from typing import Any

from s5loader import S5Dataset, S5Sampler


def run_ranks(
    ds: S5Dataset, root: str, world: int, state: dict[str, Any] | None, stop_at: int | None, **kw: Any
) -> tuple[list[int], dict[str, Any] | None]:
    """The ranks of ``world`` in lockstep: each hands out ``stop_at`` indices (all, with None) of
    the epoch (resumed from ``state``); their indices, and rank 0's state at the stop."""
    samplers = [
        S5Sampler(ds, num_replicas=world, rank=r, seed=4, staging_dir=root, **kw) for r in range(world)
    ]
    got: list[int] = []
    saved: dict[str, Any] | None = None
    try:
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
        its = [iter(s) for s in samplers]
        parts: list[list[int]] = [[] for _ in samplers]
        for r, it in enumerate(its):
            for i in it:
                parts[r].append(int(i))
                if stop_at is not None and len(parts[r]) == stop_at:
                    break
        if stop_at is not None:
            saved = samplers[0].state_dict()
            assert all(len(p) == stop_at for p in parts)
        for it in its:
            it.close()
        got = [i for p in parts for i in p]
    finally:
        for s in samplers:
            s.close()
    return got, saved
