"""Listing once per job: one process builds the sample index (or reads the tar shards' index),
the others of the job receive it.

- Under an initialized ``torch.distributed`` process group, rank 0 builds the index and
  broadcasts its saved form (``broadcast_object_list``); an error on rank 0 is broadcast too
  and raised on every rank. Every rank must build the data set (a collective call).
- Without one, under ``torchrun``, ``srun`` or ``mpirun`` (their variables for a local rank,
  :func:`~s5loader._util.dist.local_rank_info`), local rank 0
  builds it and writes an index file into a private folder of the temporary directory, named
  after the source, the endpoint and the run; the other local ranks wait for it (at most
  ``S5LOADER_INDEX_TIMEOUT`` seconds, default 3600) and read it. The last reader deletes it.
- Otherwise, or with ``S5LOADER_SHARE_INDEX=0``, the process builds it itself.

Under a process group, a rank whose source differs from rank 0's builds its own index. Local
ranks sharing through a file must all build the same sources, in the same order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .. import exceptions
from .._util.dist import local_rank_info, local_world_size
from ..exceptions import IndexShareError, S5LoaderError
from .compact import SampleIndex
from .saved import index_bytes, load, loads, save

log = logging.getLogger(__name__)
T = TypeVar("T")

ENV_TIMEOUT = "S5LOADER_INDEX_TIMEOUT"
ENV_SHARE = "S5LOADER_SHARE_INDEX"  # "0": every process builds its own index
_POLL = 0.05


class _Form(Generic[T]):
    """How a shared value travels: to bytes and back, and into a file and back."""

    def __init__(
        self,
        dumps: Callable[[T], bytes],
        loads: Callable[[bytes, str], T],
        save: Callable[[T, str], None],
        load: Callable[[str], T],
    ) -> None:
        self.dumps, self.loads, self.save, self.load = dumps, loads, save, load


def _json_form(to_plain: Callable[[T], Any], from_plain: Callable[[Any], T]) -> _Form[T]:
    """A value that travels as JSON of its plain form: what a process reads from the shared
    file is data, never code (the file lives in a private folder, and is still no pickle)."""

    def dumps(value: T) -> bytes:
        return json.dumps(to_plain(value)).encode()

    def loads(data: bytes, where: str) -> T:
        try:
            return from_plain(json.loads(data))
        except (ValueError, TypeError, KeyError) as exc:
            raise IndexShareError(f"{where} is not a shared value of this s5loader: {exc}") from exc

    def save(value: T, path: str) -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(dumps(value))
        os.replace(tmp, path)

    def load(path: str) -> T:
        with open(path, "rb") as f:
            return loads(f.read(), path)

    return _Form(dumps, loads, save, load)


_INDEX: _Form[SampleIndex] = _Form(index_bytes, loads, save, load)


def shared_index(build: Callable[[], SampleIndex], what: list[str | None]) -> SampleIndex:
    """Build the index in one process of the job and hand it to the others.

    Args:
        build: makes the index (lists the prefix, reads the manifest).
        what: what the index is of (source, endpoint, grouping): names the shared file.
    """
    return _share(build, what, _INDEX)


def shared_object(
    build: Callable[[], T],
    what: list[str | None],
    to_plain: Callable[[T], Any],
    from_plain: Callable[[Any], T],
) -> T:
    """As :func:`shared_index`, for a value that ``to_plain`` makes JSON of and ``from_plain``
    makes again (a list of tar shards and their index's URI): built by one process of the
    job, received by the others."""
    return _share(build, what, _json_form(to_plain, from_plain))


def _share(build: Callable[[], T], what: list[str | None], form: _Form[T]) -> T:
    import torch.distributed as dist

    if os.environ.get(ENV_SHARE, "1") == "0":
        return build()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return _broadcast(build, what, form)
    local = local_rank_info()  # torchrun's, mpirun's or srun's variables
    if local is not None and local[0] is not None and local_world_size() > 1:
        return _through_file(build, what, local[0], local[1], form)
    return build()


def _broadcast(build: Callable[[], T], what: list[str | None], form: _Form[T]) -> T:
    import torch.distributed as td

    if td.get_rank() == 0:
        try:
            index = build()
        except S5LoaderError as exc:
            td.broadcast_object_list([("error", exc, what)], src=0)
            raise
        td.broadcast_object_list([("index", form.dumps(index), what)], src=0)
        return index
    box: list[Any] = [None]
    td.broadcast_object_list(box, src=0)
    kind, payload, theirs = box[0]
    if theirs != what:  # this rank reads another source (a manifest per rank): its own index
        log.debug("rank 0 built the index of %s, this rank wants %s: building its own", theirs, what)
        return build()
    if kind == "error":
        raise payload
    log.debug("received the sample index from rank 0 (%d bytes)", len(payload))
    return form.loads(payload, "the index broadcast by rank 0")


def _folder() -> str:
    path = os.path.join(tempfile.gettempdir(), f"s5loader-index-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise IndexShareError(f"{path} is not a private folder of this user; remove it")
    return path


def _through_file(
    build: Callable[[], T], what: list[str | None], local_rank: int, local_world: int, form: _Form[T]
) -> T:
    run = [os.environ.get(v) for v in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")]
    # the torchrun agent is the parent of every local rank: a new launch, a new file
    name = hashlib.sha256(json.dumps([what, run, os.getppid()]).encode()).hexdigest()[:32]
    path = os.path.join(_folder(), f"{name}.s5idx")
    failed = path + ".error"
    if local_rank == 0:
        for stale in (path, failed):
            try:
                os.unlink(stale)
            except FileNotFoundError:
                pass
        try:
            index = build()
        except S5LoaderError as exc:
            with open(failed, "w", encoding="utf-8") as f:
                json.dump({"type": type(exc).__name__, "message": str(exc)}, f)
            raise
        form.save(index, path)
        return index
    limit = float(os.environ.get(ENV_TIMEOUT, "3600"))
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if os.path.exists(failed):
            with open(failed, encoding="utf-8") as f:
                err = json.load(f)
            kind = getattr(exceptions, str(err.get("type")), None)
            if not (isinstance(kind, type) and issubclass(kind, S5LoaderError)):
                kind = S5LoaderError
            raise kind(f"local rank 0 could not build the index: {err.get('message')}")
        if time.monotonic() > deadline:
            raise IndexShareError(
                f"local rank {local_rank} waited {limit:g}s for local rank 0 to build the sample "
                f"index of {what[1]} into {path}; set {ENV_TIMEOUT} to wait longer"
            )
        time.sleep(_POLL)
    index = form.load(path)
    _done(path, local_rank, local_world)
    return index


def _done(path: str, local_rank: int, local_world: int) -> None:
    with open(f"{path}.read{local_rank}", "w"):
        pass
    marks = [f"{path}.read{r}" for r in range(1, local_world)]
    if all(os.path.exists(m) for m in marks):
        for p in [path, *marks]:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
