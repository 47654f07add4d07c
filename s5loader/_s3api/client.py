"""One boto3 S3 client per process and per :class:`~s5loader.config.Access`: making one costs
about 0.1 s (more than a HEAD request), botocore clients are thread-safe, and none may cross a
fork (a DataLoader worker makes its own)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from ..config import Access

_CLIENTS: dict[tuple[int, str, Access], Any] = {}
_LOCK = threading.Lock()


def cached_client(access: Access | str | None, kind: str, make: Callable[[Access], Any]) -> Any:
    """This process's client of ``kind`` for ``access``, made by ``make`` on first use: one cache
    for every kind (the plain client, the large transfers' client), emptied in a forked child."""
    a = Access.coerce(access)
    key = (os.getpid(), kind, a)
    found = _CLIENTS.get(key)
    if found is None:
        with _LOCK:
            found = _CLIENTS.get(key)
            if found is None:
                found = _CLIENTS[key] = make(a)
    return found


def s3_client(access: Access | str | None) -> Any:
    """The boto3 client of this process for ``access`` (an :class:`Access`, or an endpoint URL)."""
    return cached_client(access, "s3", Access.boto3_client)


def _forget_after_fork() -> None:
    global _LOCK
    _CLIENTS.clear()
    _LOCK = threading.Lock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_forget_after_fork)
