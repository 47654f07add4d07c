"""One boto3 S3 client per process and per :class:`~s5loader.config.Access`: making one costs
about 0.1 s (more than a HEAD request), botocore clients are thread-safe, and none may cross a
fork (a DataLoader worker makes its own)."""

from __future__ import annotations

import os
import threading
from typing import Any

from ..config import Access

_CLIENTS: dict[tuple[int, Access], Any] = {}
_LOCK = threading.Lock()


def s3_client(access: Access | str | None) -> Any:
    """The boto3 client of this process for ``access`` (an :class:`Access`, or an endpoint URL)."""
    a = Access.coerce(access)
    key = (os.getpid(), a)
    found = _CLIENTS.get(key)
    if found is None:
        with _LOCK:
            found = _CLIENTS.get(key)
            if found is None:
                found = _CLIENTS[key] = a.boto3_client()
    return found


def _forget_after_fork() -> None:
    _CLIENTS.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
