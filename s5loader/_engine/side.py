"""Side fetches: objects whose key s5cmd cannot carry in a command file (a line break in the
key) are fetched with boto3 instead, so they are neither dropped nor able to inject a command."""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from .._s3api.client import s3_client
from .._s3api.errors import boto3_error
from .._s5cmd import classify
from .._util.uri import parse_s3_uri
from ..config import Access
from .retry import Failures

THREAD_PREFIX = "s5loader-aside"
# boto3's download_file (s3transfer's defaults): objects of 8 MiB or more in ranged GETs of 8 MiB
_MULTIPART = 8 * 1024**2


def download_requests(size: int) -> Counter[str]:
    """The S3 requests one side fetch of an object of ``size`` bytes sends: boto3's
    ``download_file`` asks for the size (a HEAD), then GETs it, in 8 MiB parts from 8 MiB on."""
    return Counter(HEAD=1, GET=-(-size // _MULTIPART) if size >= _MULTIPART else 1)


class SideFetches:
    """boto3 downloads running beside the s5cmd calls, on a small thread pool made on first use."""

    def __init__(self, access: Access | str | None) -> None:
        self.access = access
        self._executor: ThreadPoolExecutor | None = None
        self._running: list[tuple[Future[None], int, int, str]] = []

    def __bool__(self) -> bool:
        return bool(self._running)

    def submit(self, pos: int, attempt: int, uri: str, dest: str) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(4, thread_name_prefix=THREAD_PREFIX)
        fut = self._executor.submit(_download, uri, dest, self.access)
        self._running.append((fut, pos, attempt, uri))

    def check(
        self,
        current: Callable[[int, int], bool],
        on_done: Callable[[int], None],
        on_failed: Callable[[Failures], None],
    ) -> None:
        """Hand finished downloads on: ``on_done(position)`` for a success, ``on_failed`` for a
        failure. ``current(position, attempt)`` says whether a result still counts (the
        sample may have been retried, or given up on, since)."""
        if not self._running:
            return
        still = []
        for fut, pos, attempt, uri in self._running:
            if not fut.done():
                still.append((fut, pos, attempt, uri))
                continue
            if not current(pos, attempt):
                continue  # the sample was retried (or given up) since: this result is stale
            exc = fut.exception()
            if exc is None:
                on_done(pos)
            else:
                msg = str(exc)
                on_failed({pos: (classify(msg), msg, uri)})
        self._running = still

    def close(self) -> None:
        if self._executor is not None:
            # close() may run on one of the pool's own threads (garbage collection happens
            # anywhere); a pool cannot join itself
            own = threading.current_thread().name.startswith(THREAD_PREFIX)
            self._executor.shutdown(wait=not own, cancel_futures=True)
            self._executor = None


def _download(uri: str, dest: str, access: Access | str | None) -> None:
    u = parse_s3_uri(uri)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = dest + ".part"
    try:
        s3_client(access).download_file(u.bucket, u.key, tmp)
    except Exception as exc:
        raise boto3_error(exc, uri) from exc
    os.rename(tmp, dest)
