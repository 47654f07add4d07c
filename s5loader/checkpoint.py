"""``torch.save`` / ``torch.load`` to and from S3 through s5cmd's parallel multipart transfer.

``save(obj, "s3://bucket/run1/step-1000.pt")`` serialises ``obj`` into a staging file (tmpfs
when it has room, else the temp directory), uploads it with one ``s5cmd cp`` in
``concurrency`` parallel parts, and removes the file. When neither has room for the estimated
size (the bytes of the tensors in ``obj``), it streams instead: ``torch.save`` writes into
``s5cmd pipe``, which uploads parts as they fill, so nothing touches the disk.
``load(uri)`` downloads the object the same way (or, without room, reads it with
``s5cmd cat`` into memory) and hands it to ``torch.load``.

Atomic for readers, without a temporary key. S3 (and the stores s5loader is tested on) shows
an object only once its upload completes: a single PUT, or ``CompleteMultipartUpload`` for
a multipart upload, which s5cmd sends only after every part has been stored. A reader of the
final key therefore sees the previous checkpoint or the whole new one, never a part of it. A
temporary key followed by a server-side copy would double the server's work for every
multi-GB save and guarantee nothing more. What an interrupted save can leave behind is an
unfinished multipart upload (stored parts, billed, invisible to readers); s5cmd does not abort
it when it is killed, so ``save`` does (see ``_transfer.UploadGuard``): on an error, on
KeyboardInterrupt and on SIGTERM it kills s5cmd and aborts every upload of that key that this
save started. A streamed save that fails while serialising kills ``s5cmd pipe`` before its
input is closed, so a half-written stream is never completed as an object. Only SIGKILL (or a
power cut) can leave an unfinished upload; a lifecycle rule ``AbortIncompleteMultipartUpload``
on the bucket removes those.
"""

from __future__ import annotations

import errno
import io
import logging
import os
from typing import IO, Any

from ._largeobj import transfer as _transfer
from ._util.uri import format_size
from .config import Access
from .exceptions import FetchError, StagingSpaceError
from .s5cmd import S5cmd, error_from_exit, kill, start_cat, start_copy, start_pipe
from .staging.area import StagingArea

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 16

__all__ = ["save", "load"]


def save(
    obj: Any,
    uri: str,
    *,
    endpoint_url: str | None = None,
    staging_dir: str | None = None,
    stream: bool | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    part_size: int | str | None = None,
    access: Access | None = None,
) -> None:
    """Save ``obj`` with ``torch.save`` to the object ``uri``.

    Args:
        obj: what ``torch.save`` accepts (a state dict, a model, any picklable object).
        uri: ``s3://bucket/key``; replaced atomically if it exists.
        endpoint_url: the S3 endpoint, as for the datasets (else ``AWS_ENDPOINT_URL_S3``,
            ``AWS_ENDPOINT_URL``, ``S3_ENDPOINT_URL``, else AWS). Credentials follow the AWS
            chain.
        staging_dir: where to serialise before uploading; default tmpfs (``/dev/shm``) when
            it has room, else the system temp directory.
        stream: ``True`` never stages (serialise straight into the upload); ``False`` always
            stages and fails when there is no room; ``None`` (default) stages when the
            estimated size fits and streams otherwise.
        concurrency: parts uploaded in parallel.
        part_size: bytes per part (``"32MiB"``); default: the object split over the
            ``concurrency`` requests, 5 to 32 MiB (8 MiB when streaming). Raised where an
            object would need more than 10,000 parts.
        access: how to reach the store (:class:`~s5loader.Access`: anonymous, profile,
            requester pays, TLS, ...), for s5cmd and boto3 alike.

    Raises:
        S3URIError: ``uri`` names no object.
        StagingSpaceError: ``stream=False`` and the staging directory has no room (the
            message says how much is needed), or the disk filled up while streaming was off.
        AccessDeniedError, NoSuchBucketError, EndpointError, FetchError: the upload failed;
            no object was written under ``uri`` and no multipart upload is left.
    """
    import torch

    _transfer.object_uri(uri)
    part = _transfer.part_bytes(part_size)
    store = Access.coerce(access, endpoint_url)
    s5 = S5cmd(access=store)
    need = estimate_size(obj)
    root, seen = (None, "streaming requested") if stream else _transfer.pick_staging(need, staging_dir)
    if root is not None:
        area = StagingArea(root)
        try:
            path = os.path.join(area.create(), "checkpoint.pt")
            try:
                with open(path, "wb") as f:
                    torch.save(obj, f)
            except Exception as exc:
                # torch reports a full disk as a RuntimeError whose context is the OSError
                if not _no_space(exc):
                    raise
                if stream is False:
                    raise _transfer.space_error(uri, need, seen, "saving this checkpoint") from exc
                log.info("%s: %s filled up while serialising; streaming instead", uri, root)
            else:
                size = os.path.getsize(path)
                log.info("%s: uploading %s staged in %s", uri, format_size(size), root)
                with _transfer.UploadGuard(uri, store) as guard:
                    proc = start_copy(s5, path, uri, concurrency=concurrency, part_size=part, size=size)
                    guard.attach(proc)
                    _transfer.run(proc, uri)
                return
        finally:
            area.remove()
    elif stream is False:
        raise _transfer.space_error(uri, need, seen, "saving this checkpoint")
    log.info("%s: streaming about %s into the upload (%s)", uri, format_size(need), seen)
    _save_streaming(obj, uri, s5, store, concurrency, part, need)


def _no_space(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class _PipeWriter(io.RawIOBase):
    """The write end of ``s5cmd pipe`` as a file for ``torch.save``."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self._pipe = pipe
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = self._pipe.write(b)
        self.written += len(memoryview(b)) if n is None else n
        return len(memoryview(b)) if n is None else n

    def flush(self) -> None:
        self._pipe.flush()


def _save_streaming(
    obj: Any, uri: str, s5: S5cmd, access: Access | str | None, concurrency: int, part: int, need: int
) -> None:
    import torch

    with _transfer.UploadGuard(uri, access) as guard:
        proc = start_pipe(s5, uri, concurrency=concurrency, part_size=part, size=need)
        guard.attach(proc)
        assert proc.stdin is not None
        writer = _PipeWriter(proc.stdin)
        try:
            torch.save(obj, writer)  # type: ignore[arg-type]  # a binary file, write-only
            writer.flush()
        except BrokenPipeError:
            pass  # s5cmd stopped reading: its exit status says why, below
        except BaseException:
            # Kill before the input is closed: s5cmd must not see end-of-stream and complete
            # a half-written object.
            kill(proc)
            raise
        try:
            proc.stdin.close()  # end of stream: s5cmd uploads the last part and completes
        except BrokenPipeError:
            pass
        proc.stdin = None  # closed: communicate() must not flush it
        _transfer.run(proc, uri)
        log.info("%s: streamed %s", uri, format_size(writer.written))


def load(
    uri: str,
    map_location: Any = None,
    weights_only: bool = True,
    *,
    endpoint_url: str | None = None,
    staging_dir: str | None = None,
    stream: bool | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    part_size: int | str | None = None,
    access: Access | None = None,
    **torch_load_kwargs: Any,
) -> Any:
    """Load what :func:`save` (or ``torch.save`` and any upload) wrote to ``uri``.

    Args:
        uri: ``s3://bucket/key``.
        map_location, weights_only: as for ``torch.load`` (``weights_only=True`` refuses
            arbitrary pickled objects, as torch does by default).
        endpoint_url, staging_dir, concurrency, part_size, access: as for :func:`save`.
        stream: ``True`` reads the object into memory without staging it; ``False`` always
            stages; ``None`` stages when the object fits and reads into memory otherwise.
        **torch_load_kwargs: passed on to ``torch.load``.

    Returns:
        the loaded object.

    Raises:
        ObjectNotFoundError: no object ``uri``.
        StagingSpaceError: neither the staging directory nor memory has room; the message
            says how much is needed.
        AccessDeniedError, NoSuchBucketError, EndpointError, FetchError: the download failed.
    """
    import torch

    part = _transfer.part_bytes(part_size)
    store = Access.coerce(access, endpoint_url)
    s5 = S5cmd(access=store)
    size, _ = _transfer.head_size(uri, store)
    root, seen = (None, "streaming requested") if stream else _transfer.pick_staging(size, staging_dir)
    if root is not None:
        area = StagingArea(root)
        try:
            path = os.path.join(area.create(), "checkpoint.pt")
            _transfer.download(s5, uri, path, size=size, concurrency=concurrency, part_size=part)
            log.info("%s: downloaded %s into %s", uri, format_size(size), root)
            return torch.load(path, map_location=map_location, weights_only=weights_only, **torch_load_kwargs)
        finally:
            area.remove()
    if stream is False:
        raise _transfer.space_error(uri, size, seen, "loading this checkpoint")
    available = _available_memory()
    if available is not None and size > available:
        raise StagingSpaceError(
            f"{uri}: loading this checkpoint needs {format_size(size)} ({size} bytes) of staging "
            f"space or memory; {seen}, {format_size(available)} of memory available"
        )
    log.info("%s: reading %s into memory (%s)", uri, format_size(size), seen)
    buf = _read_all(s5, uri, size, concurrency, part)
    return torch.load(io.BytesIO(buf), map_location=map_location, weights_only=weights_only, **torch_load_kwargs)


def _read_all(s5: S5cmd, uri: str, size: int, concurrency: int, part: int) -> memoryview:
    proc = start_cat(s5, uri, concurrency=concurrency, part_size=part, size=size)
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    try:
        assert proc.stdout is not None
        while got < size:
            n = proc.stdout.readinto(view[got:])  # type: ignore[attr-defined]
            if not n:
                break
            got += n
        extra = proc.stdout.read(1)
        _, err = proc.communicate()
    except BaseException:
        kill(proc)
        raise
    if proc.returncode != 0:
        raise error_from_exit(proc.returncode, err, uri)
    if got != size or extra:
        raise FetchError(f"{uri}: read {got}{'+' if extra else ''} bytes, expected {size} (changed while read?)")
    return view


def _available_memory() -> int | None:
    """The kernel's estimate of memory available without swapping (``MemAvailable``)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None  # unknown: try anyway


def estimate_size(obj: Any) -> int:
    """Roughly the bytes ``torch.save(obj)`` writes: the tensors' storages (each once), the
    numpy arrays and byte strings in nested dicts, lists and tuples, plus a margin. Objects it
    cannot see into (a whole ``nn.Module``) count for little; :func:`save` then finds out
    from a full disk and streams."""
    import torch

    total, seen, stack, visited = 0, set(), [obj], 0
    while stack and visited < 10_000_000:
        o = stack.pop()
        visited += 1
        if isinstance(o, torch.Tensor):
            try:
                st = o.untyped_storage()
                key = (st.data_ptr(), st.nbytes())
                if key not in seen:
                    seen.add(key)
                    total += st.nbytes()
            except (RuntimeError, NotImplementedError):  # sparse, nested: its own size
                total += o.numel() * o.element_size()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif isinstance(o, (bytes, bytearray, memoryview, str)):
            total += len(o)
        elif hasattr(o, "nbytes") and isinstance(getattr(o, "nbytes", None), int):
            total += int(o.nbytes)
    return total + total // 100 + 1024**2
