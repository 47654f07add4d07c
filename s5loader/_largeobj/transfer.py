"""Moving one large object: where to stage it, running one s5cmd transfer to its end, and
making sure an interrupted upload leaves no multipart upload behind.

Shared by :mod:`s5loader.checkpoint`, :mod:`s5loader.dcp` and :mod:`s5loader.fetch`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .._s3api.client import s3_client
from .._s3api.errors import boto3_error
from .._s5cmd import S5cmd, error_from_exit, kill, start_copy
from .._staging.area import SHM, free_bytes, register_cleanup
from .._util.uri import format_size, parse_s3_uri, parse_size
from ..config import Access
from ..exceptions import S3URIError, StagingSpaceError
from .parts import PartPlan, plan_parts

log = logging.getLogger(__name__)

T = TypeVar("T")

# Room left free beside a staged file (file-system metadata, other writers): 1 MiB + 2%.
MARGIN = 1024**2


def margin(need: int) -> int:
    return MARGIN + need // 50


def object_uri(uri: str) -> tuple[str, str]:
    """Check that ``uri`` names one object; return its bucket and key.

    Raises:
        S3URIError: not an s3 URI, or no key (a bucket or a ``prefix/``).
    """
    u = parse_s3_uri(uri)
    if not u.key or u.key.endswith("/"):
        raise S3URIError(f"{uri!r} names no object (it needs a key that does not end with '/')")
    return u.bucket, u.key


def part_bytes(part_size: int | str | None) -> int:
    """Bytes per part from what a user gave; 0 (``None``) lets s5loader pick per object."""
    return 0 if part_size is None else parse_size(part_size, "part_size")


def staging_candidates(staging_dir: str | None) -> list[str]:
    """Where a large object may be staged: ``staging_dir``, else tmpfs then the temp dir."""
    if staging_dir is not None:
        return [os.path.abspath(os.fspath(staging_dir))]
    out = []
    if os.path.isdir(SHM) and os.access(SHM, os.W_OK):
        out.append(SHM)
    out.append(tempfile.gettempdir())
    return out


def pick_staging(need: int, staging_dir: str | None) -> tuple[str | None, str]:
    """The first candidate with room for ``need`` bytes (plus a margin), or ``None``.

    Returns:
        the directory (or ``None``) and a description of what each candidate has free, for
        error messages.
    """
    seen = []
    for root in staging_candidates(staging_dir):
        try:
            os.makedirs(root, exist_ok=True)
            free = free_bytes(root)
        except OSError as exc:
            seen.append(f"{root}: {exc.strerror}")
            continue
        seen.append(f"{format_size(free)} free in {root}")
        if free >= need + margin(need):
            return root, ", ".join(seen)
    return None, ", ".join(seen)


def space_error(uri: str, need: int, seen: str, what: str) -> StagingSpaceError:
    return StagingSpaceError(
        f"{uri}: {what} needs {format_size(need)} ({need} bytes) of staging space; {seen}; "
        "free space, pass staging_dir= a larger directory, or stream"
    )


def run(proc: subprocess.Popen[bytes], what: str) -> bytes:
    """Wait for one s5cmd transfer; kill it (its process group) if we are interrupted.

    Returns:
        its stdout.

    Raises:
        StagingSpaceError, ObjectNotFoundError, AccessDeniedError, EndpointError, FetchError:
            it failed; the message names ``what``.
    """
    try:
        out, err = proc.communicate()
    except BaseException:
        kill(proc)
        raise
    if proc.returncode != 0:
        raise error_from_exit(proc.returncode, err, what)
    return out


class UploadGuard:
    """Aborts the multipart uploads that one save started, if the save does not finish.

    S3 shows an object only when its upload completes (a single PUT, or
    ``CompleteMultipartUpload``), so an interrupted upload never leaves a partial object
    under its key; what it can leave is an unfinished multipart upload, whose parts are
    stored (and billed) until it is aborted. s5cmd does not abort it when it is killed
    (checked against moto and SeaweedFS), so this guard lists the key's uploads before the
    save, and on failure, interruption (``KeyboardInterrupt``) or SIGTERM kills the
    transfer and aborts every upload of that key that was not there before.

    Use as a context manager around the transfer; :meth:`attach` the s5cmd process.
    """

    def __init__(self, uri: str, access: Access | str | None) -> None:
        self.uri = uri
        self.bucket, self.key = object_uri(uri)
        self._client: Any = s3_client(access)
        self._before: set[str] = set()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._active = False
        self._lock = threading.Lock()

    def _upload_ids(self) -> set[str]:
        ids = set()
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.key}
        while True:
            page = self._client.list_multipart_uploads(**kwargs)
            for up in page.get("Uploads", []) or []:
                if up.get("Key") == self.key:
                    ids.add(up["UploadId"])
            if not page.get("IsTruncated"):
                return ids
            kwargs["KeyMarker"] = page.get("NextKeyMarker", "")
            kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    def attach(self, proc: subprocess.Popen[bytes]) -> None:
        self._procs.append(proc)

    def __enter__(self) -> UploadGuard:
        try:
            self._before = self._upload_ids()
            self._active = True
        except Exception as exc:  # noqa: BLE001 - a save must not need this permission
            log.warning(
                "%s: cannot list multipart uploads (%s); an interrupted save may leave one "
                "behind for a lifecycle rule to remove",
                self.uri,
                boto3_error(exc, self.uri),
            )
        register_cleanup(self)  # SIGTERM and exit run close() while the save is under way
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self._active = False
        self.close()
        self._procs.clear()

    def close(self) -> None:
        """Kill the transfer and abort this save's uploads, unless it finished. Idempotent."""
        with self._lock:
            active, self._active = self._active, False
        for proc in self._procs:
            kill(proc)  # a no-op for a finished transfer
        if not active:
            return
        try:
            stale = self._upload_ids() - self._before
            for upload_id in sorted(stale):
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=upload_id)
                log.info("aborted the unfinished multipart upload %s of %s", upload_id, self.uri)
        except Exception:  # noqa: BLE001 - best effort on a path that is already failing
            log.warning(
                "could not abort the unfinished multipart upload of %s; a bucket lifecycle rule "
                "(AbortIncompleteMultipartUpload) removes it",
                self.uri,
                exc_info=True,
            )


def head_size(uri: str, access: Access | str | None) -> tuple[int, str]:
    """Size and ETag of one object (a HEAD request)."""
    bucket, key = object_uri(uri)
    try:
        head = s3_client(access).head_object(Bucket=bucket, Key=key)
    except Exception as exc:
        raise boto3_error(exc, uri) from exc
    return int(head["ContentLength"]), str(head.get("ETag", "")).strip('"')


def s5cmd_copy(
    s5: S5cmd, source: str, destination: str, *, size: int, concurrency: int, part_size: int
) -> subprocess.Popen[bytes]:
    """Start one s5cmd copy of an object of ``size`` bytes in the parts :func:`plan_parts`
    picks for it (``part_size=0``: from its size)."""
    plan: PartPlan = plan_parts(size, part_size=part_size, concurrency=concurrency)
    return start_copy(
        s5, source, destination, concurrency=plan.concurrency, part_size=plan.part_size, size=size
    )


def download(s5: S5cmd, uri: str, path: str, *, size: int, concurrency: int, part_size: int) -> None:
    """Download one object to ``path`` in parallel parts."""
    run(s5cmd_copy(s5, uri, path, size=size, concurrency=concurrency, part_size=part_size), uri)


def side_by_side(fn: Callable[[T], None], items: Sequence[T]) -> None:
    """Run ``fn`` on every item at once, one thread each; the first error is raised here, in
    the caller's thread, once all have ended."""
    errors: list[BaseException] = []

    def one(item: T) -> None:
        try:
            fn(item)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(item,), daemon=True) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def upload_many(
    s5: S5cmd,
    pairs: Sequence[tuple[str, str]],
    access: Access | str | None,
    *,
    concurrency: int,
    part_size: int,
) -> None:
    """Upload local files to ``s3://`` URIs side by side, each in parallel parts, each
    guarded: on any failure or interruption every unfinished upload is aborted."""
    guards = [UploadGuard(uri, access) for _, uri in pairs]

    def one(item: tuple[str, UploadGuard]) -> None:
        path, guard = item
        size = os.path.getsize(path)
        proc = s5cmd_copy(s5, path, guard.uri, size=size, concurrency=concurrency, part_size=part_size)
        guard.attach(proc)
        run(proc, guard.uri)

    entered: list[UploadGuard] = []
    try:
        for g in guards:
            entered.append(g.__enter__())
        side_by_side(one, [(p, g) for (p, _), g in zip(pairs, guards, strict=True)])
    except BaseException:
        for g in entered:
            g.close()
        raise
    for g in entered:
        g.__exit__(None, None, None)
