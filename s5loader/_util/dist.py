"""Who we are in a distributed job: rank, world size, DataLoader worker."""

from __future__ import annotations

import os

from ..exceptions import ConfigError


def rank_info(num_replicas: int | None = None, rank: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: the arguments, else torch.distributed, else ``RANK`` and
    ``WORLD_SIZE``, else a single process."""
    world, r = num_replicas, rank
    if world is None or r is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size() if world is None else world
            r = dist.get_rank() if r is None else r
        else:
            world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
            r = int(os.environ.get("RANK", "0")) if r is None else r
    if world < 1:
        raise ConfigError(f"num_replicas must be >= 1, got {world}")
    if not 0 <= r < world:
        raise ConfigError(f"rank must be in [0, {world - 1}] for num_replicas={world}, got {r}")
    return r, world


def pytorch_worker_info(num_replicas: int | None = None, rank: int | None = None) -> tuple[int, int, int, int]:
    """``(rank, world_size, worker, num_workers)`` of the calling process."""
    from torch.utils.data import get_worker_info

    r, world = rank_info(num_replicas, rank)
    info = get_worker_info()
    if info is None:
        return r, world, 0, 1
    return r, world, info.id, info.num_workers
