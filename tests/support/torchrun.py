"""A torchrun node of a test's job on this machine (rendezvous on loopback)."""

from __future__ import annotations

import os
import subprocess
import sys


def torchrun(
    script: str, nodes: int, node_rank: int, port: int, args: list[str], nproc: int = 2
) -> subprocess.Popen[str]:
    """Node ``node_rank`` of ``nodes``, ``nproc`` ranks, running ``script`` with ``args``."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--nproc_per_node={nproc}",
        f"--node_rank={node_rank}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        script,
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
