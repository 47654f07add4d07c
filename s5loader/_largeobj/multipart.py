"""One large object written in many parts at once, in this process: a stream written into a
multipart upload (the read side is :mod:`s5loader._largeobj.ranged`).

Its requests run on daemon threads over the process's boto3 client (:func:`transfer_client`;
botocore releases the GIL while it sends and receives), so nothing is staged on disk and no
byte is copied more than once: a written chunk is copied into its part's buffer, which is sent
as is.

:class:`MultipartWriter` keeps the promise of :mod:`s5loader.checkpoint`: the object appears
only when :meth:`MultipartWriter.commit` completes the upload (``CompleteMultipartUpload``, or
one ``PutObject`` for an object smaller than a part), so a reader sees the previous object or
the whole new one. Anything else (an error, ``KeyboardInterrupt``, SIGTERM, the writer
dropped unfinished) aborts the upload, its own upload ID, so no parts are left stored.
"""

from __future__ import annotations

import io
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from .._s3api.client import cached_client
from .._s3api.errors import boto3_error
from .._staging.area import register_cleanup
from .._util.uri import format_size
from ..config import Access
from ..exceptions import FetchError, S5LoaderError
from .parts import MAX_PARTS, PartPlan, stream_part_size
from .transfer import object_uri

log = logging.getLogger(__name__)

MiB = 1024**2
DEFAULT_MAX_MEMORY = 512 * MiB  # part buffers of one streamed upload, in flight or filling
_ABORT_WAIT = 5.0  # seconds an abort waits for parts in flight before aborting once more


def _unsigned_parts(params: Any, context: dict[str, Any], **kwargs: Any) -> None:
    from botocore.config import Config

    context["client_config"] = context["client_config"].merge(
        Config(s3={"payload_signing_enabled": False}, request_checksum_calculation="when_required")
    )


def transfer_client(access: Access | str | None) -> Any:
    """The boto3 client of this process for large transfers over ``access``: the settings of
    :meth:`Access.boto3_client`, except that the bodies of ``UploadPart`` and ``PutObject`` are
    neither hashed into the signature nor checksummed. botocore would otherwise read every byte
    twice in this process (SHA-256 for the signature over plain http, CRC32 for the checksum),
    each pass costing more CPU than sending the bytes. Over https TLS protects the bytes, as it
    does for s5cmd's and boto3's own unsigned uploads; over plain http (a store on the local
    network) nothing beyond TCP does."""
    return cached_client(access, "transfer", _new_transfer_client)


def _new_transfer_client(a: Access) -> Any:
    client = a.boto3_client()
    for op in ("UploadPart", "PutObject"):
        client.meta.events.register(f"before-parameter-build.s3.{op}", _unsigned_parts)
    return client


def _daemon(target: Callable[[], None], name: str) -> threading.Thread:
    t = threading.Thread(target=target, name=name, daemon=True)
    t.start()
    return t


class MultipartWriter(io.RawIOBase):
    """A write-only stream that becomes the object ``uri`` when :meth:`commit` is called.

    Parts of ``plan.part_size`` bytes are uploaded as they fill, up to ``plan.concurrency``
    at once and within ``max_memory`` bytes of buffers; a stream much longer than planned
    doubles its part size every 2,000 parts. ``close()`` without ``commit()`` aborts.

    Raises (from ``write`` and ``commit``): AccessDeniedError, NoSuchBucketError,
    EndpointError, FetchError: a request failed; the upload is aborted.
    """

    def __init__(
        self, uri: str, access: Access | str | None, plan: PartPlan, max_memory: int = DEFAULT_MAX_MEMORY
    ) -> None:
        super().__init__()
        self.uri = uri
        self.bucket, self.key = object_uri(uri)
        self._client: Any = transfer_client(access)
        self._base = plan.part_size
        self._inflight = max(1, min(plan.concurrency, max_memory // plan.part_size))
        self._slots = threading.Semaphore(self._inflight)
        self._jobs: queue.SimpleQueue[tuple[int, bytearray] | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._free: list[bytearray] = []
        self._number = 1
        self._buf = bytearray(self._base)
        self._fill = 0
        self._upload_id: str | None = None
        self._etags: dict[int, str] = {}
        self._error: BaseException | None = None
        self._interrupt: KeyboardInterrupt | None = (
            None  # Ctrl-C inside write(), which torch's writer swallows
        )
        self._lock = threading.RLock()  # SIGTERM's close() runs in the main thread, maybe inside close()
        self._state = "open"  # open | committed | aborted
        self.written = 0
        register_cleanup(self)  # SIGTERM and exit abort an upload under way

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        try:
            return self._write(b)
        except KeyboardInterrupt as exc:
            self._interrupt = exc  # torch's zip writer turns it into an "unexpected pos" RuntimeError
            raise

    def _write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        while view:
            take = min(len(view), len(self._buf) - self._fill)
            self._buf[self._fill : self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == len(self._buf):
                self._submit(self._buf)
                self._number += 1
                size = stream_part_size(self._base, self._number)
                self._buf = (
                    self._free.pop() if self._free and len(self._free[-1]) == size else bytearray(size)
                )
                self._fill = 0
        self.written += n
        return n

    def _raise_if_failed(self) -> None:
        if self._state != "open":
            raise FetchError(f"{self.uri}: the upload was {self._state}")
        exc = self._error
        if isinstance(exc, S5LoaderError):
            raise exc
        if isinstance(exc, Exception):
            raise boto3_error(exc, self.uri) from exc
        if exc is not None:
            raise FetchError(f"{self.uri}: an upload thread stopped ({exc!r})") from exc

    def raise_failure(self) -> None:
        """Raise the ``KeyboardInterrupt`` that stopped a :meth:`write`, else the error of a
        part that failed, if one did (naming the object, as :meth:`write` would). For the
        caller of a writer that broke off mid-write: torch's zip writer reports the short
        write it was left with, not its cause."""
        if self._interrupt is not None:
            raise self._interrupt from None  # torch's report of it says nothing more
        if self._error is not None:
            self._raise_if_failed()

    def _submit(self, data: bytearray) -> None:
        self._raise_if_failed()
        if self._number > MAX_PARTS:
            raise FetchError(f"{self.uri}: more than {MAX_PARTS} parts; pass a larger part_size")
        if self._upload_id is None:
            try:
                up = self._client.create_multipart_upload(Bucket=self.bucket, Key=self.key)
            except Exception as exc:
                raise boto3_error(exc, self.uri) from exc
            self._upload_id = up["UploadId"]
            self._workers = [_daemon(self._work, f"s5loader-upload-{i}") for i in range(self._inflight)]
        while not self._slots.acquire(timeout=0.5):
            self._raise_if_failed()
        self._jobs.put((self._number, data))

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            number, data = job
            try:
                if self._error is None and self._state == "open":
                    r = self._client.upload_part(
                        Bucket=self.bucket,
                        Key=self.key,
                        UploadId=self._upload_id,
                        PartNumber=number,
                        Body=data,
                    )
                    self._etags[number] = r["ETag"]
            except BaseException as exc:  # noqa: BLE001 - handed to the writing thread
                self._error = self._error or exc
            finally:
                if len(data) == self._base:
                    self._free.append(data)
                self._slots.release()

    def _wait_idle(self, deadline: float | None = None) -> bool:
        """Wait until no part is in flight; ``False`` if ``deadline`` (monotonic) came first."""
        got = 0
        try:
            while got < self._inflight:
                if self._slots.acquire(timeout=0.5):
                    got += 1
                elif deadline is not None and time.monotonic() > deadline:
                    return False
                elif deadline is None:
                    self._raise_if_failed()
            return True
        finally:
            for _ in range(got):
                self._slots.release()

    def commit(self) -> None:
        """Upload what is left and complete the object; from here on readers see it."""
        self._raise_if_failed()
        try:
            if self._upload_id is None:  # smaller than one part: one PUT
                self._client.put_object(Bucket=self.bucket, Key=self.key, Body=self._buf[: self._fill])
            else:
                if self._fill:
                    self._submit(self._buf[: self._fill])
                self._wait_idle()
                self._raise_if_failed()
                parts = [{"PartNumber": n, "ETag": e} for n, e in sorted(self._etags.items())]
                self._client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=self.key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},
                )
        except S5LoaderError:
            self.close()
            raise
        except BaseException as exc:
            self.close()
            if isinstance(exc, Exception):
                raise boto3_error(exc, self.uri) from exc
            raise
        with self._lock:
            self._state = "committed"
        self._stop()
        log.info("%s: uploaded %s in %d parts", self.uri, format_size(self.written), max(1, len(self._etags)))
        super().close()

    def _stop(self) -> None:
        for _ in self._workers:
            self._jobs.put(None)
        self._workers = []

    def close(self) -> None:
        """Abort, unless committed: no object, no upload left. Idempotent."""
        with self._lock:
            was, self._state = self._state, ("aborted" if self._state == "open" else self._state)
        if was == "open":
            self._stop()
            self._abort()
        super().close()

    def _abort(self) -> None:
        if self._upload_id is None:
            return
        for attempt in range(2):  # again after the parts in flight: one may land after the first
            try:
                self._client.abort_multipart_upload(
                    Bucket=self.bucket, Key=self.key, UploadId=self._upload_id
                )
                if attempt == 0:
                    log.info("aborted the unfinished multipart upload %s of %s", self._upload_id, self.uri)
            except Exception as exc:  # noqa: BLE001 - best effort on a path that is already failing
                code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
                if attempt == 0 and code != "NoSuchUpload":
                    log.warning(
                        "could not abort the unfinished multipart upload of %s (%s); a bucket "
                        "lifecycle rule (AbortIncompleteMultipartUpload) removes it",
                        self.uri,
                        exc,
                    )
            if attempt == 0:
                self._wait_idle(time.monotonic() + _ABORT_WAIT)
