"""``torch.save`` / ``torch.load`` to and from S3 in many parallel parts.

``save(obj, "s3://bucket/run1/step-1000.pt")`` streams ``torch.save`` into a multipart upload
made in this process: the bytes are cut into parts as they are written (16 MiB each for
1 GiB: about 64 parts, see :mod:`s5loader._largeobj.parts`), up to ``concurrency`` (32) parts
go up at once while serialisation goes on, and nothing touches the disk; at most 512 MiB of
part buffers are held. ``stream=False`` serialises into a staging file first and uploads it
with one ``s5cmd cp`` in parallel parts.
``load(uri)`` reads the object into memory with ``concurrency`` parallel ranged GETs (each
straight from the socket into its slice of one buffer, each conditional on the ETag, so an
object replaced while it is read is an error), and ``torch.load`` reads that buffer while it
fills: each tensor is copied into its storage as soon as its bytes have arrived, the only
copy. With ``mmap=True`` (as for ``torch.load``) there is none: the buffer is an in-memory
file and the tensors are views of it. Where memory is short, or with ``stream=False``, it
downloads into a staging file with ``s5cmd cp`` in parallel parts instead.

Atomic for readers, without a temporary key. S3 (and the stores s5loader is tested on) shows
an object only once its upload completes: a single PUT, or ``CompleteMultipartUpload`` for
a multipart upload, which ``save`` sends only after ``torch.save`` has returned and every
part has been stored. A reader of the final key therefore sees the previous checkpoint or the
whole new one, never a part of it. A temporary key followed by a server-side copy would double
the server's work for every multi-GB save and guarantee nothing more. What an interrupted
save could leave behind is an unfinished multipart upload (stored parts, billed, invisible to
readers): on an error (serialisation included), on KeyboardInterrupt and on SIGTERM, ``save``
aborts its upload (the streamed one by its own upload ID; for the staged one it kills s5cmd
and aborts every upload of that key that this save started, see ``_transfer.UploadGuard``).
Only SIGKILL (or a power cut) can leave an unfinished upload; a lifecycle rule
``AbortIncompleteMultipartUpload`` on the bucket removes those.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from ._largeobj import transfer as _transfer
from ._largeobj.memload import available_memory, in_memory_kwargs, load_in_memory
from ._largeobj.multipart import MultipartWriter
from ._largeobj.parts import DEFAULT_CONCURRENCY, plan_parts
from ._s5cmd import S5cmd
from ._staging.area import StagingArea
from ._util.uri import format_size
from .config import Access

log = logging.getLogger(__name__)

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
    pin_memory: bool = True,
) -> None:
    """Save ``obj`` with ``torch.save`` to the object ``uri``.

    Args:
        obj: what ``torch.save`` accepts (a state dict, a model, any picklable object).
        uri: ``s3://bucket/key``; replaced atomically if it exists.
        endpoint_url: the S3 endpoint, as for the datasets (else ``AWS_ENDPOINT_URL_S3``,
            ``AWS_ENDPOINT_URL``, ``S3_ENDPOINT_URL``, else AWS). Credentials follow the AWS
            chain.
        staging_dir: with ``stream=False``, where to serialise before uploading; default
            tmpfs (``/dev/shm``) when it has room, else the system temp directory.
        stream: ``True`` or ``None`` (default): serialise straight into the upload, nothing
            staged; ``False``: serialise into a staging file, then upload it (fails when
            there is no room).
        concurrency: parts uploaded in parallel (default 32).
        part_size: bytes per part (``"32MiB"``); default: from the size of the tensors in
            ``obj``, about 64 parts, 5 to 64 MiB each. Raised where an object would need more
            than 10,000 parts.
        access: how to reach the store (:class:`~s5loader.Access`: anonymous, profile,
            requester pays, TLS, ...), for s5cmd and boto3 alike.
        pin_memory: where ``obj`` holds tensors on a CUDA device, ``torch.save`` copies each
            to the host through page-locked memory (torch's
            ``torch.utils.serialization.config.save.use_pinned_memory_for_d2h``) rather than
            into fresh pageable memory, so each copy is a DMA into page-locked pages (the
            guide's checkpoint section has what it saves). The setting is restored and the
            page-locked buffers that torch keeps cached are released when the save returns.
            ``False``: torch's own pageable copies.

    Raises:
        S3URIError: ``uri`` names no object.
        StagingSpaceError: ``stream=False`` and the staging directory has no room (the
            message says how much is needed), or the disk filled up.
        AccessDeniedError, NoSuchBucketError, EndpointError, FetchError: the upload failed;
            no object was written under ``uri`` and no multipart upload is left.
        KeyboardInterrupt: Ctrl-C, wherever the save was (torch's zip writer included, which
            would report it as a ``RuntimeError``); the upload is aborted.
    """
    _transfer.object_uri(uri)
    part = _transfer.part_bytes(part_size)
    store = Access.coerce(access, endpoint_url)
    need, on_cuda = _inspect(obj)

    def serialise(f: Any) -> None:
        import torch

        with _pinned_host_copies(pin_memory and on_cuda):
            torch.save(obj, f)

    if stream is not False:
        _save_streamed(serialise, uri, store, need, part, concurrency)
    else:
        _save_staged(serialise, uri, store, need, part, concurrency, staging_dir)


def _save_streamed(
    serialise: Callable[[Any], None], uri: str, store: Access, need: int, part: int, concurrency: int
) -> None:
    """Serialise straight into a multipart upload: parts planned from ``need``, each sent as it
    fills, and the upload completed only once ``torch.save`` has returned (aborted otherwise)."""
    plan = plan_parts(need, part_size=part, concurrency=concurrency)
    log.info(
        "%s: streaming about %s into the upload (%d MiB parts, %d at once)",
        uri,
        format_size(need),
        plan.part_mib,
        plan.concurrency,
    )
    writer = MultipartWriter(uri, store, plan)
    try:
        try:
            serialise(writer)  # a binary file, write-only
        except Exception:
            writer.raise_failure()  # Ctrl-C or a failed part, rather than what torch's zip writer made of it
            raise
        writer.commit()
    finally:
        writer.close()  # aborts the upload unless it was committed


def _save_staged(
    serialise: Callable[[Any], None],
    uri: str,
    store: Access,
    need: int,
    part: int,
    concurrency: int,
    staging_dir: str | None,
) -> None:
    """Serialise into a staging file where ``need`` bytes fit, then upload it with one ``s5cmd
    cp`` in parallel parts; the staging area is removed either way.

    Raises:
        StagingSpaceError: no staging directory has room, or the disk filled up.
    """
    root, seen = _transfer.pick_staging(need, staging_dir)
    if root is None:
        raise _transfer.space_error(uri, need, seen, "saving this checkpoint")
    area = StagingArea(root)
    try:
        path = os.path.join(area.create(), "checkpoint.pt")
        try:
            with open(path, "wb") as f:
                serialise(f)
        except Exception as exc:
            # torch reports a full disk as a RuntimeError whose context is the OSError
            if _no_space(exc):
                raise _transfer.space_error(uri, need, seen, "saving this checkpoint") from exc
            raise
        size = os.path.getsize(path)
        log.info("%s: uploading %s staged in %s", uri, format_size(size), root)
        with _transfer.UploadGuard(uri, store) as guard:
            proc = _transfer.s5cmd_copy(
                S5cmd(access=store), path, uri, size=size, concurrency=concurrency, part_size=part
            )
            guard.attach(proc)
            _transfer.run(proc, uri)
    finally:
        area.remove()


def _no_space(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


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
        endpoint_url, concurrency, part_size, access: as for :func:`save`.
        staging_dir: where to download when the object is not read into memory; default
            tmpfs when it has room, else the system temp directory.
        stream: ``True`` reads the object into memory (parallel ranged GETs), nothing
            staged; ``False`` always downloads into a staging file; ``None`` (default) reads
            into memory when there is room for it and the loaded tensors (twice its size;
            once with ``mmap=True``), and stages otherwise.
        **torch_load_kwargs: passed on to ``torch.load``. ``mmap=True`` maps the object as
            ``torch.load(path, mmap=True)`` maps a file: read into memory, it is an anonymous
            in-memory file (a memfd) and the tensors are views of it, not copies; staged, it
            is the staging file, removed from the directory at once. Either way the tensors
            are backed by one private mapping that lives as long as any of them (an in-place
            write copies the pages it touches), as with torch's own ``mmap``.

    Returns:
        the loaded object.

    Raises:
        ObjectNotFoundError: no object ``uri``.
        StagingSpaceError: neither the staging directory nor memory has room; the message
            says how much is needed.
        AccessDeniedError, NoSuchBucketError, EndpointError, FetchError: the download failed,
            or the object changed while it was read.
    """
    import torch

    part = _transfer.part_bytes(part_size)
    store = Access.coerce(access, endpoint_url)
    size, etag = _transfer.head_size(uri, store)
    mapped, memory_kwargs = in_memory_kwargs(torch_load_kwargs)
    available = available_memory()
    need = (1 if mapped else 2) * size
    fits = available is None or need + _transfer.margin(size) <= available
    if stream or (stream is None and fits):
        in_memory = functools.partial(
            torch.load, map_location=map_location, weights_only=weights_only, **memory_kwargs
        )
        return load_in_memory(uri, store, size, etag, part, concurrency, available, mapped, in_memory)
    staged = functools.partial(
        torch.load, map_location=map_location, weights_only=weights_only, **torch_load_kwargs
    )
    return _load_staged(uri, store, size, part, concurrency, staging_dir, staged)


def _load_staged(
    uri: str,
    store: Access,
    size: int,
    part: int,
    concurrency: int,
    staging_dir: str | None,
    torch_load: Callable[[Any], Any],
) -> Any:
    """Download the object into a staging file with ``s5cmd cp`` in parallel parts and load it;
    the staging area is removed either way.

    Raises:
        StagingSpaceError: no staging directory has room for the object.
    """
    root, seen = _transfer.pick_staging(size, staging_dir)
    if root is None:
        raise _transfer.space_error(uri, size, seen, "loading this checkpoint")
    area = StagingArea(root)
    try:
        path = os.path.join(area.create(), "checkpoint.pt")
        _transfer.download(S5cmd(access=store), uri, path, size=size, concurrency=concurrency, part_size=part)
        log.info("%s: downloaded %s into %s", uri, format_size(size), root)
        return torch_load(path)
    finally:
        area.remove()


@contextlib.contextmanager
def _pinned_host_copies(on: bool) -> Iterator[None]:
    """While the block runs, ``torch.save`` copies CUDA storages to the host through pinned
    memory (where this torch has the setting). Afterwards the setting is as it
    was, and where it was off, torch's cache of idle pinned host buffers is emptied, so no
    page-locked memory outlives the save."""
    try:
        from torch.utils.serialization import config as settings
    except ImportError:  # an older torch: its pageable copies
        settings = None  # type: ignore[assignment]
    cfg = getattr(settings, "save", None)
    if (
        not on
        or cfg is None
        or not hasattr(cfg, "use_pinned_memory_for_d2h")
        or cfg.use_pinned_memory_for_d2h
    ):
        yield
        return
    import torch

    cfg.use_pinned_memory_for_d2h = True
    try:
        yield
    finally:
        cfg.use_pinned_memory_for_d2h = False
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()


def estimate_size(obj: Any) -> int:
    """Roughly the bytes ``torch.save(obj)`` writes: the tensors' storages (each once), the
    numpy arrays and byte strings in nested dicts, lists and tuples, a whole ``nn.Module``'s
    parameters and buffers, plus a margin. Objects it cannot see into count for little; a
    streamed save then grows its parts as it goes."""
    return _inspect(obj)[0]


def _inspect(obj: Any) -> tuple[int, bool]:
    """:func:`estimate_size`, and whether a tensor it saw lives on a CUDA device."""
    import torch

    total, seen, stack, visited, on_cuda = 0, set(), [obj], 0, False
    while stack and visited < 10_000_000:
        o = stack.pop()
        visited += 1
        if isinstance(o, torch.Tensor):
            on_cuda = on_cuda or o.device.type == "cuda"
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
        elif isinstance(o, torch.nn.Module):
            stack.extend(o.parameters())
            stack.extend(o.buffers())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif isinstance(o, (bytes, bytearray, memoryview, str)):
            total += len(o)
        elif hasattr(o, "nbytes") and isinstance(getattr(o, "nbytes", None), int):
            total += int(o.nbytes)
    return total + total // 100 + 1024**2, on_cuda
