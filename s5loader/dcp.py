"""A ``torch.distributed.checkpoint`` storage writer and reader over S3.

``S5StorageWriter`` is torch's ``FileSystemWriter`` over a file system whose files are S3
objects: every rank streams its files (``__RANK_N.distcp``) into multipart uploads as torch
writes them, in parallel parts (as :func:`s5loader.checkpoint.save` does; nothing staged on
disk), each completed when torch closes it and aborted on an error; the coordinator then
uploads ``.metadata`` last. A checkpoint without ``.metadata`` is not a checkpoint to a
reader, and each file is atomic (a single PUT or a completed multipart upload), so a reader
never sees half of one. ``S5StorageReader`` downloads ``.metadata``,
then on each rank only the files its load plan reads, as many at a time as the staging
directory has room for, and deletes them once read.

    import torch.distributed.checkpoint as dcp
    from s5loader.dcp import S5StorageReader, S5StorageWriter

    dcp.save(state_dict, storage_writer=S5StorageWriter("s3://bucket/run1/step-1000/"))
    dcp.load(state_dict, storage_reader=S5StorageReader("s3://bucket/run1/step-1000/"))
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ._largeobj import transfer as _transfer
from ._largeobj.multipart import MultipartWriter
from ._largeobj.parts import plan_parts
from ._s5cmd import S5cmd
from ._staging.area import StagingArea, free_bytes
from ._util.uri import format_size, parse_s3_uri
from .checkpoint import DEFAULT_CONCURRENCY
from .config import Access

log = logging.getLogger(__name__)

METADATA = ".metadata"

__all__ = ["S5StorageReader", "S5StorageWriter"]


def _prefix(uri: str | os.PathLike[str]) -> str:
    text = os.fspath(uri)
    parse_s3_uri(text)
    return text if text.endswith("/") else text + "/"


def _is_s3(checkpoint_id: str | os.PathLike[str]) -> bool:
    return isinstance(checkpoint_id, str) and checkpoint_id.startswith("s3://")


class _Staged:
    """A rank's staging directory, made on first use."""

    def __init__(self, staging_dir: str | None) -> None:
        self._staging_dir = staging_dir
        self._area: StagingArea | None = None

    def path(self, need: int, uri: str, what: str) -> str:
        if self._area is None:
            root, seen = _transfer.pick_staging(need, self._staging_dir)
            if root is None:
                raise _transfer.space_error(uri, need, seen, what)
            self._area = StagingArea(root)
        return self._area.create()

    def remove(self) -> None:
        if self._area is not None:
            self._area.remove()
            self._area = None


class _Settings:
    """What the writer and the reader share: the prefix, the store, the transfer sizes and the
    local staging folder."""

    uri: str
    access: Access
    endpoint_url: str | None
    concurrency: int
    part_size: int
    _staged: _Staged

    def _setup(
        self,
        uri: str,
        endpoint_url: str | None,
        staging_dir: str | None,
        concurrency: int,
        part_size: int | str | None,
        access: Access | None,
    ) -> None:
        self.uri = _prefix(uri)
        self.access = Access.coerce(access, endpoint_url)
        self.endpoint_url = self.access.endpoint_url
        self.concurrency = concurrency
        self.part_size = _transfer.part_bytes(part_size)
        self._staged = _Staged(staging_dir)


class _Written(io.RawIOBase):
    """What torch writes one checkpoint file into: the front of a :class:`MultipartWriter`.
    torch closes it when the file is complete; the upload completes when its ``with`` block
    ends without an error (see :meth:`_S3Files.create_stream`)."""

    def __init__(self, upload: MultipartWriter) -> None:
        super().__init__()
        self._upload = upload

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self._upload.write(b)

    def tell(self) -> int:
        return self._upload.written  # torch records each item's offset in its file


class _S3Files(FileSystemBase):
    """torch's file-system interface over the writer's prefix: a file is streamed into an
    upload of its own; ``.metadata`` is written in memory under its temporary name and
    uploaded when torch renames it to its final name (after every rank's files)."""

    def __init__(self, writer: S5StorageWriter) -> None:
        self._writer = writer
        self._held: dict[str, bytes] = {}

    def _uri(self, path: str | os.PathLike[str]) -> str:
        return self._writer.uri + PurePosixPath(os.fspath(path)).name

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            raise ValueError(f"{self._uri(path)}: the writer only writes (mode {mode!r})")
        name = PurePosixPath(os.fspath(path)).name
        if name.endswith(".tmp"):  # the metadata, renamed when complete
            buf = io.BytesIO()
            yield buf
            self._held[name] = buf.getvalue()
            return
        w = self._writer
        plan = plan_parts(w.file_bytes, part_size=w.part_size, concurrency=w.concurrency)
        upload = MultipartWriter(self._uri(path), w.access, plan)
        try:
            try:
                yield _Written(upload)
            except Exception:
                upload.raise_failure()  # a failed part, rather than what torch's writer made of it
                raise
            upload.commit()
        finally:
            upload.close()  # aborts unless committed

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        data = self._held.pop(PurePosixPath(os.fspath(path)).name)
        upload = MultipartWriter(self._uri(new_path), self._writer.access, plan_parts(len(data)))
        try:
            upload.write(data)
            upload.commit()
        finally:
            upload.close()

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> PurePosixPath:
        return PurePosixPath(os.fspath(path)) / suffix

    def init_path(self, path: str | os.PathLike[str]) -> PurePosixPath:
        return PurePosixPath(os.fspath(path))

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        pass  # a prefix needs no folder

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_s3(checkpoint_id)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return False  # an object written replaces the one before it, atomically

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        pass


class S5StorageWriter(_Settings, FileSystemWriter):
    """Save a distributed checkpoint to ``s3://bucket/prefix/``, each file streamed into an
    upload in parallel parts, nothing staged on disk.

    Args:
        uri: the checkpoint's prefix (one "directory" per checkpoint).
        endpoint_url: the S3 endpoint, as for the datasets.
        access: how to reach the store (:class:`~s5loader.Access`), as for the datasets.
        staging_dir: not used by the writer (kept so that the writer and the reader take the
            same arguments).
        concurrency, part_size: parallel parts per file and their size (default: about 64
            parts per file, from the rank's tensor bytes; 32 in flight).
        **kwargs: passed to ``FileSystemWriter`` (``thread_count``, ``single_file_per_rank``,
            ...); ``thread_count=N`` makes N files per rank, uploaded side by side.

    Raises (from ``dcp.save``):
        AccessDeniedError, NoSuchBucketError, EndpointError, FetchError: an upload failed
            (its multipart upload is aborted; ``.metadata`` is not written).
    """

    def __init__(
        self,
        uri: str,
        *,
        endpoint_url: str | None = None,
        staging_dir: str | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        part_size: int | str | None = None,
        access: Access | None = None,
        **kwargs: Any,
    ) -> None:
        self._setup(uri, endpoint_url, staging_dir, concurrency, part_size, access)
        self.file_bytes = 0
        kwargs.setdefault("sync_files", False)  # objects: nothing to sync
        super().__init__("/", **kwargs)
        self.fs = _S3Files(self)  # type: ignore[assignment]  # torch types it as its local FileSystem
        self.path = self.fs.init_path("/")

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id and _is_s3(checkpoint_id):
            self.uri = _prefix(checkpoint_id)
        super().reset(None)

    @property
    def checkpoint_id(self) -> str:
        return self.uri

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_s3(checkpoint_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # the size of each of this rank's files, roughly, for the size of its parts
        files = max(1, self.thread_count) if self.single_file_per_rank else max(1, len(plan.items))
        self.file_bytes = sum(_tensor_bytes(item) for item in plan.items) // files
        return super().prepare_local_plan(plan)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        log.info("streaming this rank's files to %s", self.uri)
        return super().write_data(plan, planner)


class S5StorageReader(_Settings, FileSystemReader):
    """Load a distributed checkpoint from ``s3://bucket/prefix/`` through s5cmd.

    Args:
        uri: the checkpoint's prefix.
        endpoint_url, access, staging_dir, concurrency, part_size: as for :class:`S5StorageWriter`.

    Raises (from ``dcp.load``):
        ObjectNotFoundError: no ``.metadata`` under the prefix (no complete checkpoint).
        StagingSpaceError: one of the files this rank reads does not fit its staging dir.
    """

    def __init__(
        self,
        uri: str,
        *,
        endpoint_url: str | None = None,
        staging_dir: str | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        part_size: int | str | None = None,
        access: Access | None = None,
        **kwargs: Any,
    ) -> None:
        self._setup(uri, endpoint_url, staging_dir, concurrency, part_size, access)
        super().__init__("/nonexistent-until-staged", **kwargs)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id and _is_s3(checkpoint_id):
            self.uri = _prefix(checkpoint_id)
        super().reset(None)

    @property
    def checkpoint_id(self) -> str:
        return self.uri

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_s3(checkpoint_id)

    def _s5(self) -> S5cmd:
        return S5cmd(access=self.access)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        uri = self.uri + METADATA
        size, _ = _transfer.head_size(uri, self.access)
        self.path = Path(self._staged.path(size, uri, "the checkpoint's metadata"))
        local = os.path.join(self.path, METADATA)
        try:
            _transfer.download(
                self._s5(), uri, local, size=size, concurrency=self.concurrency, part_size=self.part_size
            )
            return super().read_metadata(*args, **kwargs)
        finally:
            _unlink(local)
            self._staged.remove()  # read_data picks its place by the size of the files

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        size: dict[str, int] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append(item)
            size[info.relative_path] = max(size.get(info.relative_path, 0), info.offset + info.length)
        names = sorted(per_file)
        try:
            while names:
                self.path = Path(self._staged.path(size[names[0]], self.uri + names[0], "reading this file"))
                room = free_bytes(str(self.path)) - _transfer.MARGIN
                batch: list[str] = []
                used = 0
                for n in names:  # as many files as fit, at least one
                    if batch and used + size[n] > room:
                        break
                    batch.append(n)
                    used += size[n]
                if used > room:
                    raise _transfer.space_error(
                        self.uri + batch[0],
                        used,
                        f"{format_size(room)} free in {self.path}",
                        "reading this file",
                    )
                names = names[len(batch) :]
                self._download(batch, size)
                items = [i for n in batch for i in per_file[n]]
                try:
                    super().read_data(dataclasses.replace(plan, items=items), planner).wait()
                finally:
                    for n in batch:
                        _unlink(os.path.join(self.path, n))
        finally:
            self._staged.remove()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _download(self, names: Sequence[str], size: dict[str, int]) -> None:
        def one(name: str) -> None:
            _transfer.download(
                self._s5(),
                self.uri + name,
                os.path.join(self.path, name),
                size=size[name],
                concurrency=self.concurrency,
                part_size=self.part_size,
            )

        _transfer.side_by_side(one, names)


def _tensor_bytes(item: Any) -> int:
    data = item.tensor_data
    if data is None:  # a pickled object: small next to the tensors
        return 0
    n = 1
    for d in data.size:
        n *= d
    return n * data.properties.dtype.itemsize


def _unlink(path: str | os.PathLike[str]) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
