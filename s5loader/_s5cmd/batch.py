"""One command file run to its end (``s5cmd run``), and what it says about each copy: the
copies ``s5loader pack`` makes of a shard's objects. A run that is interrupted is killed
with its whole process group."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Sequence
from typing import NamedTuple

from .commands import write_command_file
from .output import Result, parse_line, reported_destinations
from .process import S5cmd, kill


class BatchOutcome(NamedTuple):
    """What one ``s5cmd run`` did: its exit code, the copies that failed (by the destination
    they were written for, when s5cmd names it) and the end of its stderr."""

    returncode: int
    failed: dict[str, str]  # destination -> error message
    unplaced: list[str]  # errors that name no destination of the batch
    stderr: str


def start_batch(s5: S5cmd, lines: Sequence[str], command_file: str) -> subprocess.Popen[bytes]:
    """Write ``lines`` (from :func:`~s5loader._s5cmd.copy_line`) into ``command_file`` and start
    ``s5cmd run`` on it."""
    write_command_file(command_file, lines)
    return s5.run_file(command_file)


def finish_batch(proc: subprocess.Popen[bytes], destinations: Sequence[str]) -> BatchOutcome:
    """Wait for a run :func:`start_batch` started; kill it if we are interrupted.

    Args:
        destinations: the destinations its lines copy to, so that a failure is attributed
            to its copy (s5cmd prints the failing command unquoted).
    """
    assert proc.stdout is not None and proc.stderr is not None
    err_out = proc.stderr
    errors: list[bytes] = []
    drain = threading.Thread(target=lambda: errors.extend(err_out), daemon=True)
    drain.start()
    try:
        for _ in proc.stdout:  # successes: nothing to do but keep the pipe flowing
            pass
        rc = proc.wait()
        drain.join()
    except BaseException:
        kill(proc)
        raise
    kill(proc)  # reaps it and closes its pipes
    wanted = set(destinations)
    failed: dict[str, str] = {}
    unplaced: list[str] = []
    for line in errors:
        res: Result | None = parse_line(line)
        if res is None or res.ok:
            continue
        dest = next((d for d in reported_destinations(res.command) if d in wanted), None)
        if dest is None:
            unplaced.append(res.error)
        else:
            failed[dest] = res.error
    text = b"".join(errors[-50:]).decode("utf-8", "replace")
    return BatchOutcome(rc, failed, unplaced, text)
