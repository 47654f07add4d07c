"""Loading a checkpoint read into memory, for :func:`s5loader.checkpoint.load`: whether it is
mapped (``mmap=True``, where this system has an anonymous in-memory file to map), how much
memory is available, and the load itself, from parallel ranged GETs: ``torch.load`` reading
the buffer while it fills, or mapping a memfd the parts were written into.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable
from typing import Any

from .._util.uri import format_size
from ..config import Access
from ..exceptions import StagingSpaceError
from .parts import PartPlan, plan_parts
from .ranged import ArrivingFile, RangedRead, anonymous_buffer, read_into

log = logging.getLogger(__name__)


def in_memory_kwargs(kwargs: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """Whether a load into memory maps the object (``mmap=True``, where this system has an
    in-memory file to map), and the ``torch.load`` arguments for it: without one, ``mmap`` is
    dropped, so the object is read into memory and copied (a staged load still maps its file)."""
    mapped = bool(kwargs.get("mmap"))
    if mapped and not (hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")):
        return False, {k: v for k, v in kwargs.items() if k != "mmap"}
    return mapped, kwargs


def available_memory() -> int | None:
    """The kernel's estimate of memory available without swapping (``MemAvailable``)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None  # unknown: try anyway


def load_in_memory(
    uri: str,
    store: Access,
    size: int,
    etag: str,
    part: int,
    concurrency: int,
    available: int | None,
    mapped: bool,
    torch_load: Callable[[Any], Any],
) -> Any:
    """Read the object with parallel ranged GETs into memory and load it: mapped (an in-memory
    file whose pages the tensors view), or by ``torch.load`` reading each part as it arrives.

    Raises:
        StagingSpaceError: the object is larger than the memory available.
    """
    if available is not None and size > available:
        raise StagingSpaceError(
            f"{uri}: loading this checkpoint needs {format_size(size)} ({size} bytes) of memory; "
            f"{format_size(available)} available; pass stream=False to stage it on disk"
        )
    plan = plan_parts(size, part_size=part, concurrency=concurrency)
    log.info(
        "%s: reading %s into memory (%d MiB parts, %d at once%s)",
        uri,
        format_size(size),
        plan.part_mib,
        plan.concurrency,
        ", mapped" if mapped else "",
    )
    if mapped:
        return _load_mapped(uri, store, size, etag, plan, torch_load)
    buf = anonymous_buffer(size)
    reader = RangedRead(uri, store, buf, etag=etag, plan=plan).start()
    try:  # torch.load reads each part as soon as it has arrived
        obj = torch_load(ArrivingFile(reader, buf))
        reader.join()
    except BaseException as exc:
        reader.stop(exc)
        if reader.error is not None and reader.error is not exc:
            raise reader.error from exc  # what torch raised of it: the read's own error
        raise
    return obj


def _load_mapped(
    uri: str, store: Access, size: int, etag: str, plan: PartPlan, torch_load: Callable[[Any], Any]
) -> Any:
    """``torch.load(mmap=True)`` of the object read into an anonymous in-memory file (a memfd,
    which no other process sees and which needs no cleanup): the tensors are views of its pages,
    nothing is copied, and it is freed with the last of them."""
    fd = os.memfd_create("s5loader-checkpoint", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        if size:
            m = mmap.mmap(fd, size)
            view = memoryview(m)
            read_into(uri, store, view, etag=etag, plan=plan)  # on an error, threads still writing keep it
            view.release()
            m.close()
        return torch_load(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
