"""Processes of the same user that are none of the loader's: what a test sends at the loader's
channel from outside it."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path


def orphan(script: str, log: Path, *args: str) -> None:
    """Run ``script`` in a process whose parent is not this one's nor a sibling's (started by a
    shell that exits at once, it is handed on to init); its output goes to ``log``."""
    argv = shlex.join([sys.executable, "-c", script, *args])
    subprocess.run(["sh", "-c", f"{argv} >{shlex.quote(str(log))} 2>&1 &"], check=True, timeout=30)
