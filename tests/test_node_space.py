"""Staging space is checked for the node: its ranks (LOCAL_WORLD_SIZE under torchrun) share one
file system.

A private module (``s5loader._staging``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest
from support.stores import Store, mount_tmpfs

from s5loader import BudgetError
from s5loader._staging.area import choose_root

OBJECT = 32 * 1024  # whole tmpfs pages, so the bytes counted are the bytes used


@pytest.fixture
def node_fs() -> Iterator[str]:
    """A 1 MiB tmpfs made for the test."""
    with mount_tmpfs("1m", "s5loader-nodefs-") as d:
        yield d


RANK_SCRIPT = """
import json, os, sys
from s5loader import BudgetError, S5Dataset, S5Sampler
uri, endpoint, root, shrink = sys.argv[1:5]
ds = S5Dataset.from_prefix(uri, endpoint_url=endpoint, group_by="object")
try:
    sampler = S5Sampler(ds, budget=400 * 1024, staging_dir=root, shrink_budget=shrink == "1",
                        samples_per_call=4, seed=1)
except BudgetError as exc:
    print(json.dumps({"error": str(exc)}))
    sys.exit(0)
keys = [ds[i]["__key__"] for i in sampler]
print(json.dumps({"budget": sampler.budget, "keys": keys}))
sampler.close()
"""


def run_ranks(store: Store, root: str, tmp_path, shrink: bool) -> list[dict]:
    """Three ranks of one node, started together as torchrun would."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    procs = []
    for rank in range(3):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_WORLD_SIZE": "3",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), store.uri(), store.endpoint, root, "1" if shrink else "0"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def test_three_ranks_on_a_small_tmpfs(moto: Store, node_fs: str, tmp_path) -> None:
    # 40 objects of 32 KiB: each rank's share (14 samples) is more than its 400 KiB budget, and
    # three budgets (1.2 MiB) are more than the 1 MiB file system, though one alone fits.
    moto.put({f"{i:03d}.bin": bytes([i]) * OBJECT for i in range(40)})
    refused = run_ranks(moto, node_fs, tmp_path, shrink=False)
    for r in refused:  # refused up front, not a StagingSpaceError in the middle of the epoch
        assert "error" in r, r
        assert "x 3 ranks on this node" in r["error"] and node_fs in r["error"]
    shrunk = run_ranks(moto, node_fs, tmp_path, shrink=True)
    assert all("error" not in r for r in shrunk), shrunk
    assert sum(r["budget"] for r in shrunk) <= 1024 * 1024 * 0.9
    keys = [k for r in shrunk for k in r["keys"]]
    assert len(keys) == 42 and len(set(keys)) == 40  # every sample (two repeated as padding)
    assert os.listdir(node_fs) == []


def test_choose_root_counts_the_local_ranks(node_fs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert choose_root(node_fs, 200 * 1024) == (node_fs, 200 * 1024)
    with pytest.raises(BudgetError, match="x 4 ranks on this node"):
        choose_root(node_fs, 300 * 1024)
    root, room = choose_root(node_fs, 300 * 1024, shrink=True)
    assert root == node_fs and room == int(1024 * 1024 * 0.9) // 4
    monkeypatch.setattr("s5loader._staging.area.SHM", node_fs)  # /dev/shm only if all four fit
    assert choose_root(None, 200 * 1024)[0] == node_fs
    assert choose_root(None, 300 * 1024)[0] == tempfile.gettempdir()
