"""A torchrun node of a test's job on this machine (rendezvous on loopback)."""

from __future__ import annotations

import os
import subprocess
import sys


def torchrun(script: str, nodes: int, node_rank: int, port: int, args: list[str]) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        "--nproc_per_node=2",
        f"--node_rank={node_rank}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        script,
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
