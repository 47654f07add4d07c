"""Reading a tar shard while it downloads: the first shard of a pass.

A pass stages shards whole with s5cmd, so its first sample would wait for a whole shard to
download. The first shard of a pass is instead downloaded by one
streamed GET in a thread of the process that runs the pass: each chunk is written to the
shard's staged path as it arrives, its tar headers are read as they go by, and each sample
whose bytes are on disk is added to the shard's member table at once. The readers read a
sample by offset exactly as from a shard staged whole (a reader that does not find its sample
in the table it has reads the table again). The shard counts against the budget from the
start, and goes as a staged shard goes: with the last claim of the pass.

A dropped connection, or one that sends nothing for ``stall_timeout`` seconds, is picked up
where it stopped (a ranged GET from the bytes on disk, of the same ETag), up to ``retries``
failures in a row; with ``verify`` the bytes are checked against a single-part ETag (MD5)
as they stream by. The shard is checked against its index (sample count, end of archive) at
its end: a shard found bad after some of its samples were read raises then.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from .._s3api.client import s3_client
from .._s3api.errors import boto3_error
from .._staging.layout import NEED, StagingLayout
from .._util.uri import parse_s3_uri
from ..config import Access
from ..exceptions import FetchError, S5LoaderError, ShardError
from . import tar as _tar
from .index import Shard
from .shardset import ShardSet

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
_PUBLISH_S = 0.02  # at most this long between a sample on disk and the table that names it


class _Released(Exception):
    """The readers dropped the shard's last claim: the rest of it is not needed."""


class _Growing:
    """The shard's file as it grows, for tarfile's seeking mode: reads and seeks see the file on
    disk and wait (downloading the next chunks in this thread) for bytes not yet there, so
    tarfile reads the headers alone and skips the data, which Python never touches. A dropped
    connection resumes with a ranged GET from the bytes on disk."""

    def __init__(self, stream: ShardStream, out: Any, rd: Any) -> None:
        self.s = stream
        self.out = out
        self.rd = rd
        self.size = stream.shard.size
        self.written = 0  # bytes on disk
        self.pos = 0  # the reader's position
        self.md5 = hashlib.md5(usedforsecurity=False) if stream.verify else None
        self.body: Any = None
        self.failures = 0

    def _open(self) -> None:
        u = parse_s3_uri(self.s.shard.uri)
        extra: dict[str, str] = {}
        if self.written:  # resume where the bytes on disk end, from the same object only
            extra["Range"] = f"bytes={self.written}-"
            if self.s.shard.etag:
                extra["IfMatch"] = self.s.shard.etag
        if self.s.count is not None:
            self.s.count({"GET": 1})
        try:
            self.body = s3_client(self.s.access).get_object(Bucket=u.bucket, Key=u.key, **extra)["Body"]
            # no byte for stall_timeout seconds: a stalled read, retried from the bytes on disk
            self.body.set_socket_timeout(self.s.stall_timeout)
        except Exception as exc:
            raise boto3_error(exc, self.s.shard.uri) from exc

    def close(self) -> None:
        body, self.body = self.body, None
        if body is not None:
            with contextlib.suppress(Exception):
                body.close()

    def _fill(self) -> None:
        """Write the next bytes that arrive to disk."""
        self.s.flush()  # before waiting for the network: every sample on disk is in the table
        if not os.path.isdir(self.s.claims):
            raise _Released  # the pass read every sample it needs of the shard and freed it
        while True:
            if self.s.stop.is_set():
                raise FetchError(f"{self.s.shard.uri}: the pass ended while the shard was downloading")
            try:
                if self.body is None:
                    self._open()
                # what has arrived, not a full chunk: a sample is readable as soon as its bytes
                # are here (botocore's read(n) waits for n bytes; urllib3 2's read1 does not)
                raw: Any = getattr(self.body, "_raw_stream", None)
                chunk = raw.read1(_CHUNK) if hasattr(raw, "read1") else self.body.read(_CHUNK)
                if not chunk:
                    raise FetchError(
                        f"{self.s.shard.uri}: the body ended at byte {self.written} of {self.size}"
                    )
                break
            except Exception as exc:  # noqa: BLE001 - a transient failure resumes from self.written
                self.close()
                self.failures += 1
                if self.failures > self.s.retries or (
                    isinstance(exc, S5LoaderError) and not isinstance(exc, FetchError)
                ):
                    if isinstance(exc, S5LoaderError):
                        raise
                    raise FetchError(
                        f"{self.s.shard.uri}: the download broke off at byte {self.written} ({exc})"
                    ) from exc
                log.info("%s: resuming at byte %d after %s", self.s.shard.uri, self.written, exc)
                self.s.stop.wait(min(2.0, 0.1 * 2**self.failures))
        self.failures = 0  # progress: the retries count failures in a row
        chunk = chunk[: self.size - self.written]
        self.out.write(chunk)
        self.out.flush()
        if self.md5 is not None:
            self.md5.update(chunk)
        self.written += len(chunk)

    def read(self, n: int = -1) -> bytes:
        want = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        while self.written < want:
            self._fill()
        self.rd.seek(self.pos)
        data: bytes = self.rd.read(want - self.pos) if want > self.pos else b""
        self.pos += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos


class ShardStream:
    """One shard downloaded by a streamed GET into ``layout``, its samples published to the
    readers as their bytes land; :meth:`wait` blocks until sample ``j`` is readable."""

    def __init__(
        self,
        layout: StagingLayout,
        shards: ShardSet,
        shard_index: int,
        path: str,
        needed: list[int],
        access: Access,
        *,
        verify: bool = False,
        retries: int = 3,
        stall_timeout: float = 60.0,
        count: Callable[[Mapping[str, int]], None] | None = None,
    ) -> None:
        self.layout = layout
        self.shards = shards
        self.index = shard_index
        self.shard: Shard = shards[shard_index]
        self.path = path
        self.folder = os.path.dirname(path)
        self.claims = f"{self.folder}/{NEED}"  # removed by the reader that drops the last claim
        self.needed = needed
        self.access = access
        self.verify = verify
        self.retries = retries
        self.stall_timeout = stall_timeout
        self.count = count  # told of each S3 request the stream makes (a GET per connection)
        self.stop = threading.Event()
        self.cond = threading.Condition()
        self.table: list[_tar.TarSample] = []  # the samples whose bytes are on disk
        self.published = 0  # of which named in the table on disk
        self._last = 0.0
        self._entries: list[str] = []  # the table's entries, each encoded once
        self.done = False
        self.error: S5LoaderError | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> ShardStream:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.layout.claim_shard(self.index, self.needed)
        self._thread = threading.Thread(target=self._run, name="s5loader-shard-stream", daemon=True)
        self._thread.start()
        return self

    def wait(self, j: int) -> None:
        """Block until sample ``j`` of the shard is on disk and in its table.

        Raises:
            ShardError, FetchError (or another :class:`S5LoaderError`): the shard could not be
                read up to sample ``j``.
        """
        with self.cond:
            while self.published <= j and not self.done and self.error is None:
                self.cond.wait(0.5)
            if self.published > j:
                return
            if self.error is not None:
                raise self.error
        raise ShardError(f"{self.shard.uri}: no sample {j} in the shard")

    def join(self) -> None:
        """Wait for the download to end (the shard read to its end, or freed by its readers)."""
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()

    def close(self) -> None:
        """Stop the download (if it still runs) and join. Safe to call twice."""
        self.stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()

    def flush(self) -> None:
        """Write the member table if samples came in since it was last written."""
        table = self.table
        if len(table) == self.published:
            return
        entries = self._entries
        entries += map(_tar.dump_sample, table[len(entries) :])
        try:
            self.layout.write_shard_table(self.index, _tar.join_table(entries))
        except FileNotFoundError:
            return  # every sample the pass needs was read and the shard deleted
        self._last = time.monotonic()
        with self.cond:
            self.published = len(table)
            self.cond.notify_all()

    def _run(self) -> None:
        uri = self.shard.uri
        table = self.table
        stack = contextlib.ExitStack()
        try:
            with open(self.path, "wb") as out, open(self.path, "rb") as rd:
                body = _Growing(self, out, rd)
                stack.callback(body.close)
                for sample in _tar.iter_scan(body, self.shard.size, uri):
                    table.append(sample)
                    if time.monotonic() - self._last >= _PUBLISH_S:
                        self.flush()
                etag = self.shard.etag.strip('"')
                if body.md5 is not None and etag and "-" not in etag and body.md5.hexdigest() != etag:
                    raise ShardError(
                        f"{uri}: the downloaded bytes do not match its ETag {etag} (verify=True)"
                    )
            self.flush()  # every whole sample, before the count is checked (a skipped shard's are read)
            self.shards.check_members(self.index, table)
        except _Released:
            pass
        except S5LoaderError as exc:
            with self.cond:
                self.error = exc
                self.cond.notify_all()
        except OSError as exc:
            with self.cond:
                self.error = FetchError(f"{uri}: cannot write the shard to {self.path} ({exc})")
                self.cond.notify_all()
        finally:
            stack.close()
            if self.needed and not os.path.isdir(self.claims) and os.path.lexists(self.folder):
                # the readers dropped the last claim while this thread still wrote (a table):
                # what it wrote after their clean-up goes too, and the engine is told again
                shutil.rmtree(self.folder, ignore_errors=True)
                self.layout.notify(self.index)
            with self.cond:
                self.done = True
                self.cond.notify_all()
