"""Writing one shard: a pax tar whose members are the samples' fields, consecutive, in plan
order, with fixed metadata (mode 0644, owner 0, time 0), so the same samples always make the
same bytes; its MD5 is taken as it is written. Staged files are deleted as soon as they are in
the tar, so a shard being built takes little more disk than its tar."""

from __future__ import annotations

import hashlib
import os
import tarfile
from typing import IO, Any

from ..exceptions import FetchError


class _Hashing:
    """A write-only file that hashes and counts what goes through it (to a file, or nowhere:
    a shard skipped in a rerun is still measured, to cut the next one at the same place)."""

    def __init__(self, out: IO[bytes] | None) -> None:
        self.out = out
        self.md5 = hashlib.md5()  # noqa: S324 - a checksum, not security
        self.size = 0

    def write(self, data: Any) -> int:
        if self.out is not None:
            self.out.write(data)
            self.md5.update(data)
        self.size += len(data)
        return len(data)

    def tell(self) -> int:
        return self.size


class ShardWriter:
    """One shard's tar, written to ``path`` (``None``: measured only).

    Use as a context manager; :attr:`size`, :attr:`md5` and :attr:`nsamples` are final after
    it closes.
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._file: IO[bytes] | None = open(path, "wb") if path else None  # noqa: SIM115 - closed in close()
        self._sink = _Hashing(self._file)
        self._tar = tarfile.open(fileobj=self._sink, mode="w", format=tarfile.PAX_FORMAT)  # type: ignore[call-overload]
        self.nsamples = 0
        self.members = 0
        self._last_key: str | None = None
        self.size = 0
        self.md5 = ""
        self._closed = False

    @property
    def offset(self) -> int:
        """Bytes written so far (the tar's end blocks not yet)."""
        return int(self._tar.offset)

    def add(self, name: str, key: str, size: int, data: IO[bytes] | None) -> None:
        """Add the member ``name`` of sample ``key`` with ``size`` bytes read from ``data``.

        Raises:
            FetchError: ``data`` ends before ``size`` bytes.
        """
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime, info.uid, info.gid = size, 0o644, 0, 0, 0
        info.uname = info.gname = ""
        try:
            self._tar.addfile(info, data)
        except OSError as exc:
            if "unexpected end of data" in str(exc):
                raise FetchError(f"{name}: fewer than its {size} bytes arrived") from exc
            raise
        self.members += 1
        if key != self._last_key:
            self.nsamples += 1
            self._last_key = key

    def add_file(self, name: str, key: str, path: str) -> None:
        """Add a staged file as the member ``name`` and delete it."""
        with open(path, "rb") as f:
            self.add(name, key, os.fstat(f.fileno()).st_size, f)
        os.unlink(path)

    def close(self) -> None:
        """End the tar (end blocks, record padding) and the file. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._tar.close()
        if self._file is not None:
            self._file.close()
        self.size = self._sink.size
        self.md5 = self._sink.md5.hexdigest()

    def abandon(self) -> None:
        """Close and delete a shard that will not be finished."""
        self._closed = True
        if self._file is not None:
            self._file.close()
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()
