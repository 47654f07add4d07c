"""What a forked child (a DataLoader worker) inherits from a parent with threads: the per-process
caches start empty and their locks anew, whatever a thread of the parent held at the fork.

A private module (``s5loader._s3api.client``) is imported: its fork hook is what is tested."""

from __future__ import annotations

import os
import signal
import threading
import time

from s5loader._s3api import client


def _exit_code(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -1  # hung: the child waited on a lock nobody will release


def test_the_client_cache_takes_a_new_lock_in_a_forked_child() -> None:
    parent_made = client.cached_client("http://127.0.0.1:9", "fork-test", lambda a: "the parent's")
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with client._LOCK:  # a thread of the parent makes a client at the moment of the fork
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            made = client.cached_client("http://127.0.0.1:9", "fork-test", lambda a: "the child's")
            code = 0 if made == "the child's" else 1
        finally:
            os._exit(code)
    release.set()
    t.join()
    assert parent_made == "the parent's"
    assert _exit_code(pid, 20) == 0, "the child reused the parent's client or waited on its lock"
