"""One large object read into memory with parallel ranged GETs, in this process, and read from
there while it is still arriving.

:class:`RangedRead` runs ``plan.concurrency`` daemon threads over the process's boto3 client
(botocore releases the GIL while it receives); each ranged response is read straight into its
slice of the caller's buffer, and each GET is conditional on the ETag, so an object replaced
while it is read is an error rather than a mix of two. The last part is asked for first, then
the others from the front: a zip archive (what ``torch.save`` writes) is read from its
directory at the end, then from the front. :class:`ArrivingFile` is a read-only file over
the buffer whose reads wait for the bytes they return, so that ``torch.load`` runs while the
rest of the object is still arriving. :func:`anonymous_buffer` is memory for it that is not
written (zeroed) before the GETs write it.
"""

from __future__ import annotations

import http.client
import io
import logging
import mmap
import sys
import threading
from typing import Any

from .._s3api.errors import boto3_error
from ..config import Access
from ..exceptions import FetchError
from .multipart import transfer_client
from .parts import PartPlan
from .transfer import object_uri

log = logging.getLogger(__name__)

READ_SLICE = 1024**2  # bytes read from a response at a time
READ_ATTEMPTS = 3  # tries per ranged GET whose body breaks off (botocore retries the rest)
COPY_OUTSIDE_GIL = 1024**2  # copies at least this large go through torch, without the GIL


def anonymous_buffer(size: int) -> memoryview:
    """``size`` bytes of private anonymous memory; its pages are zeroed by the kernel when first
    written (by the threads that write them), where ``bytearray(size)`` writes every byte in the
    calling thread before the first part can be read into it."""
    if size <= 0:
        return memoryview(bytearray(0))
    return memoryview(mmap.mmap(-1, size))


class RangedRead:
    """Read the object ``uri`` (``len(buf)`` bytes, ETag ``etag``) into ``buf`` in parts of
    ``plan.part_size`` bytes, ``plan.concurrency`` at once. :meth:`start` returns at once;
    :meth:`wait` blocks until a range of bytes has arrived, :meth:`join` until all have.

    Raises (from :meth:`wait` and :meth:`join`): ObjectNotFoundError, AccessDeniedError,
    EndpointError, FetchError (the object changed while it was read, or a body came short).
    """

    def __init__(
        self, uri: str, access: Access | str | None, buf: memoryview, *, etag: str, plan: PartPlan
    ) -> None:
        self.uri = uri
        self.bucket, self.key = object_uri(uri)
        self._client: Any = transfer_client(access)
        self._buf = buf
        self._etag = etag
        self._part = plan.part_size
        self._concurrency = plan.concurrency
        n = -(-len(buf) // self._part)
        self._todo = iter([n - 1, *range(n - 1)] if n else [])
        self._done = [False] * n
        self._cond = threading.Condition()
        self._errors: list[BaseException] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> RangedRead:
        for i in range(min(self._concurrency, len(self._done))):
            t = threading.Thread(target=self._work, name=f"s5loader-read-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _work(self) -> None:
        while True:
            with self._cond:
                if self._errors:
                    return
                i = next(self._todo, None)
            if i is None:
                return
            lo = i * self._part
            try:
                self._one(lo, min(len(self._buf), lo + self._part))
            except BaseException as exc:  # noqa: BLE001 - raised again in the reading thread
                self.stop(exc)
                return
            with self._cond:
                self._done[i] = True
                self._cond.notify_all()

    def _one(self, lo: int, hi: int) -> None:
        extra = {"IfMatch": f'"{self._etag}"'} if self._etag else {}
        uri = self.uri
        for attempt in range(READ_ATTEMPTS):
            try:
                resp = self._client.get_object(
                    Bucket=self.bucket, Key=self.key, Range=f"bytes={lo}-{hi - 1}", **extra
                )
                got = _read_body(resp, self._buf, lo, hi)
            except Exception as exc:
                response = getattr(exc, "response", None) or {}  # None on a read timeout
                code = str(response.get("Error", {}).get("Code", ""))
                if code in ("PreconditionFailed", "412"):
                    raise FetchError(
                        f"{uri}: the object changed while it was read (ETag {self._etag})"
                    ) from exc
                if getattr(exc, "response", None) is not None or attempt == READ_ATTEMPTS - 1:
                    raise boto3_error(exc, uri) from exc
                log.info("%s: bytes %d-%d broke off (%s); reading them again", uri, lo, hi - 1, exc)
                continue
            if got == hi:
                return
            if got > hi:
                raise FetchError(
                    f"{uri}: bytes {lo}-{hi - 1}: more bytes than asked for (changed while read?)"
                )
            if attempt == READ_ATTEMPTS - 1:
                raise FetchError(
                    f"{uri}: bytes {lo}-{hi - 1}: got {got - lo} of {hi - lo} (changed while read?)"
                )

    def stop(self, exc: BaseException | None = None) -> None:
        """Stop handing out parts (the ones under way finish); ``exc``: why, raised by
        :meth:`wait` and :meth:`join` from now on."""
        with self._cond:
            self._errors.append(exc if exc is not None else KeyboardInterrupt())
            self._cond.notify_all()

    @property
    def error(self) -> BaseException | None:
        """Why the read stopped (the first part that failed), or ``None``."""
        return self._errors[0] if self._errors else None

    def _raise(self) -> None:
        raise self._errors[0]

    def wait(self, lo: int, hi: int) -> None:
        """Block until bytes ``lo`` to ``hi - 1`` have arrived. An exception raised into this
        thread meanwhile (KeyboardInterrupt, SIGTERM's) stops the read and becomes its error."""
        if hi <= lo:
            return
        first, last = lo // self._part, (hi - 1) // self._part
        try:
            with self._cond:
                while True:
                    if self._errors:
                        self._raise()
                    if all(self._done[first : last + 1]):
                        return
                    self._cond.wait(0.5)
        except BaseException as exc:
            if not self._errors:
                self.stop(exc)
            raise

    def join(self) -> None:
        """Block until every part has arrived. Where a part failed, the threads finish the
        parts under way (nothing writes into the buffer after this returns or raises); on
        KeyboardInterrupt they stop at their next part, unwaited."""
        try:
            self.wait(0, len(self._buf))
        finally:
            if not isinstance(self.error, KeyboardInterrupt):
                for t in self._threads:
                    while t.is_alive():
                        t.join(0.5)


def _read_body(resp: dict[str, Any], buf: memoryview, lo: int, hi: int) -> int:
    """Read the body of the ranged GET ``resp`` into ``buf[lo:hi]``; returns the offset reached
    (``hi + 1`` where the body is longer than asked for).

    Where the body is botocore's usual one (urllib3 over ``http.client``), the bytes are read
    with ``http.client``'s ``readinto``, straight from the socket's buffer into ``buf``: urllib3's
    own ``readinto`` reads each slice into a new ``bytes`` first and copies it, a quarter of the
    reading thread's CPU. ``http.client`` still follows the framing (``Content-Length`` or
    chunked), and the connection goes back to the pool once the body is read. Any other body
    (one whose checksum botocore checks, among them) is read through botocore."""
    from botocore.response import StreamingBody

    body = resp["Body"]
    raw: Any = getattr(body, "_raw_stream", None)
    fp: Any = getattr(raw, "_fp", None)
    length: Any = resp.get("ContentLength")
    # botocore's checksum-checking body (a whole object whose response carries a checksum)
    # checks it as its own reads reach the end: it is read through botocore
    direct = (
        type(body) is StreamingBody
        and isinstance(fp, http.client.HTTPResponse)
        and hasattr(raw, "release_conn")
        and not getattr(raw, "_decoded_buffer", None)
        and isinstance(length, int)
    )
    reader = fp if direct else body
    got, done = lo, False
    try:
        while got < hi:
            n = reader.readinto(buf[got : min(hi, got + READ_SLICE)])
            if not n:
                break
            got += n
        if got == hi:
            if direct:
                got += int(length > hi - lo)
            elif body.read(1):  # at its end, botocore's body checks its length
                got += 1
        done = got == hi
    finally:
        if direct and done:
            raw.release_conn()  # for the next GET, as urllib3 does after a whole body
        elif not done:
            body.close()  # a connection in the middle of a body cannot be reused
    return got


def read_into(uri: str, access: Access | str | None, buf: memoryview, *, etag: str, plan: PartPlan) -> None:
    """Read the object ``uri`` (``len(buf)`` bytes, ETag ``etag``) into ``buf`` (see
    :class:`RangedRead`); returns when all of it has arrived."""
    RangedRead(uri, access, buf, etag=etag, plan=plan).start().join()


class ArrivingFile(io.RawIOBase):
    """A read-only, seekable file over the buffer of a :class:`RangedRead` under way, without
    copying it: a read waits until the bytes it returns have arrived (and raises the read's
    error if a part failed). ``torch.load`` reads each record into its tensor's storage with
    ``readinto``, one copy."""

    def __init__(self, read: RangedRead, buf: memoryview) -> None:
        super().__init__()
        self._read = read
        self._buf = buf
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._buf) - self._pos))
        self._read.wait(self._pos, self._pos + n)
        _copy(out, self._buf, self._pos, n)
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._buf)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def _copy(out: memoryview, buf: memoryview, pos: int, n: int) -> None:
    """``out[:n] = buf[pos:pos + n]``. A large copy (a tensor's record) goes through torch where
    torch is loaded: its ``copy_`` releases the GIL, so the threads receiving the other parts
    keep reading meanwhile (a memoryview assignment holds the GIL for the whole record), and it
    splits the copy over torch's threads."""
    torch: Any = sys.modules.get("torch")
    if n < COPY_OUTSIDE_GIL or torch is None or out.readonly or buf.readonly:
        out[:n] = buf[pos : pos + n]
        return
    u8 = torch.uint8
    torch.frombuffer(out, dtype=u8, count=n).copy_(torch.frombuffer(buf, dtype=u8, count=n, offset=pos))
