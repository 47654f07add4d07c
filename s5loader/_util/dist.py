"""Who we are in a distributed job: rank, world size, DataLoader worker, and the ranks that share
this node (whichever launcher started them)."""

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


def pytorch_worker_info(
    num_replicas: int | None = None, rank: int | None = None
) -> tuple[int, int, int, int]:
    """``(rank, world_size, worker, num_workers)`` of the calling process."""
    from torch.utils.data import get_worker_info

    r, world = rank_info(num_replicas, rank)
    info = get_worker_info()
    if info is None:
        return r, world, 0, 1
    return r, world, info.id, info.num_workers


# The launchers' variables for this process's place on its node, (local rank, ranks on the
# node), in the order they are believed: torchrun's describe the processes it started even when
# it runs under srun or mpirun, whose own describe the tasks they started.
LOCAL_VARIABLES = (
    ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),  # torchrun
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI's mpirun
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH's and Intel MPI's Hydra (PMI)
)


def local_rank_info() -> tuple[int | None, int] | None:
    """``(local_rank, local_world_size)`` of this process on its node, from the launcher's
    variables: torchrun's ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, Open MPI's
    ``OMPI_COMM_WORLD_LOCAL_RANK``/``OMPI_COMM_WORLD_LOCAL_SIZE``, MPICH's
    ``MPI_LOCALRANKID``/``MPI_LOCALNRANKS``, or SLURM's (srun) ``SLURM_LOCALID`` with the tasks
    of this node (``SLURM_STEP_TASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE``, at
    ``SLURM_NODEID``; else ``SLURM_NTASKS_PER_NODE``). None when none says; the local rank is
    None where only the size is given (``LOCAL_WORLD_SIZE`` alone)."""
    env = os.environ
    for rank_var, size_var in LOCAL_VARIABLES:
        if rank_var not in env and size_var in env:
            only = _ints("0", env[size_var])
            return None if only is None else (None, only[1])
        found = _ints(env.get(rank_var), env.get(size_var))
        if found is not None:
            return found
    if "SLURM_LOCALID" in env:
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        size = (
            _slurm_tasks(per_node, env.get("SLURM_NODEID", "0"))
            if per_node
            else env.get("SLURM_NTASKS_PER_NODE")
        )
        return _ints(env["SLURM_LOCALID"], size)
    return None


def _ints(rank: str | None, size: str | None) -> tuple[int, int] | None:
    try:
        r, n = int(rank or ""), int(size or "")
    except ValueError:
        return None
    return (r, n) if 0 <= r < n else None


def _slurm_tasks(per_node: str, node: str) -> str | None:
    """The tasks of node ``node`` in SLURM's ``SLURM_TASKS_PER_NODE`` form (``"8(x2),4"``)."""
    counts: list[str] = []
    for part in per_node.split(","):
        count, _, times = part.partition("(x")
        counts += [count] * (int(times.rstrip(")")) if times.rstrip(")").isdigit() else 1)
    try:
        return counts[int(node)]
    except (ValueError, IndexError):
        return None


def nodes_alike() -> bool:
    """Whether nothing says the job's nodes run different numbers of ranks: SLURM's tasks per
    node (``"4,2"`` says so). torchrun runs ``--nproc_per_node`` on every node; for mpirun, whose
    variables give this node's count only, the caller trusts that every node runs as many."""
    per_node = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE")
    if not per_node or "SLURM_LOCALID" not in os.environ:
        return True
    return len({part.partition("(x")[0] for part in per_node.split(",")}) == 1


def node_ranks(rank: int, world: int) -> list[int]:
    """The ranks of this job on this node, which share one staging root: ``local_world_size``
    consecutive ranks from ``rank - local_rank`` (see :func:`local_rank_info`; launchers place
    consecutive ranks on a node by default: torchrun always, srun's block distribution, mpirun's
    ``--map-by slot`` or ``core``). Only this rank when no launcher says, or when what it says
    does not fit ``rank`` of ``world`` (a single process started in a batch script, say). A size
    without a local rank takes ``rank % size``."""
    local = local_rank_info()
    if local is None or local[1] <= 1:
        return [rank]
    local_rank, size = local
    base = rank - (rank % size if local_rank is None else local_rank)
    if base < 0 or base + size > world:
        return [rank]
    return list(range(base, base + size))


def cache_node_ranks(rank: int, world: int) -> list[int]:
    """:func:`node_ranks` for an epoch cache, which the ranks of a node share: in a process
    group of several ranks where no launcher's variables say which ranks share this node, an
    error that names them, instead of a cache per rank that each later epoch mostly refetches.

    Raises:
        ConfigError: ``torch.distributed`` runs ``world`` > 1 ranks and no launcher variable
            gives this process's place on its node.
    """
    if world > 1 and local_rank_info() is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            raise ConfigError(
                f"epoch_cache is shared by the ranks of a node, and nothing says which of the {world} "
                "ranks share this one: none of LOCAL_RANK/LOCAL_WORLD_SIZE (torchrun sets them), "
                "SLURM_LOCALID (srun), OMPI_COMM_WORLD_LOCAL_RANK (Open MPI) or MPI_LOCALRANKID (MPICH) "
                "is set. Set LOCAL_RANK and LOCAL_WORLD_SIZE for each rank (LOCAL_WORLD_SIZE=1 where each "
                "node runs one rank), or start the job with torchrun"
            )
    return node_ranks(rank, world)


def local_world_size() -> int:
    """How many ranks of this job run on this node (1 without a launcher's variables): the
    count torchrun's or mpirun's variables give; srun's only where it fits ``rank_info()`` (a
    batch script's own process sees SLURM's variables of the whole allocation)."""
    local = local_rank_info()
    if local is None:
        return 1
    if any(size_var in os.environ for _, size_var in LOCAL_VARIABLES):
        return local[1]
    try:
        return len(node_ranks(*rank_info()))
    except ConfigError:  # a RANK or WORLD_SIZE that does not fit: the sampler says so itself
        return 1
