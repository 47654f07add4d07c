"""Writing one shard: a pax tar whose members are the samples' fields, consecutive, in plan
order, with fixed metadata (mode 0644, owner 0, time 0), so the same samples always make the
same bytes; its MD5 is taken as it is written. Staged files are deleted as soon as they are in
the tar, so a shard being built takes little more disk than its tar.

A member whose name is ASCII of at most 100 bytes and whose size fits the header's 11 octal
digits (under 8 GiB) gets a plain ustar header made here, the bytes Python's ``tarfile`` writes
for it in the pax format (a unit test compares them), at a small part of its cost; any other
member's header is ``tarfile``'s, with its pax records. The end is ``tarfile``'s too: two zero
blocks, then zeros to a whole record of 20 blocks."""

from __future__ import annotations

import hashlib
import os
import tarfile
from typing import IO, Any

from ..exceptions import FetchError

BLOCK = tarfile.BLOCKSIZE  # 512
RECORD = tarfile.RECORDSIZE  # 20 blocks
_CHUNK = 1 << 20  # bytes copied into the tar at a time


def header(name: str, size: int) -> bytes:
    """The header block of the member ``name`` of ``size`` bytes (a regular file, mode 0644,
    owner 0 with no names, time 0), as ``tarfile`` makes it in the pax format."""
    raw = name.encode("ascii", "strict") if name.isascii() else b""
    if not raw or len(raw) > 100 or size >= 8**11:  # tarfile's pax records
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime, info.uid, info.gid = size, 0o644, 0, 0, 0
        info.uname = info.gname = ""
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    h = bytearray(BLOCK)
    h[0 : len(raw)] = raw
    h[100:148] = b"0000644\x000000000\x000000000\x00%011o\x0000000000000\x00" % size
    h[148:156] = b"        "  # the checksum's place counts as spaces
    h[156] = ord(tarfile.REGTYPE)
    h[257:265] = tarfile.POSIX_MAGIC
    h[148:155] = b"%06o\x00" % sum(h)
    return bytes(h)


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
        self.nsamples = 0
        self.members = 0
        self._last_key: str | None = None
        self.size = 0
        self.md5 = ""
        self._closed = False

    @property
    def offset(self) -> int:
        """Bytes written so far (the tar's end blocks not yet)."""
        return self._sink.size

    def add(self, name: str, key: str, size: int, data: IO[bytes] | None) -> None:
        """Add the member ``name`` of sample ``key`` with ``size`` bytes read from ``data``.

        Raises:
            FetchError: ``data`` ends before ``size`` bytes.
        """
        sink = self._sink
        sink.write(header(name, size))
        left = size
        while left > 0:
            chunk = data.read(min(left, _CHUNK)) if data is not None else b""
            if not chunk:
                raise FetchError(f"{name}: fewer than its {size} bytes arrived")
            sink.write(chunk)
            left -= len(chunk)
        if size % BLOCK:
            sink.write(bytes(BLOCK - size % BLOCK))
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
        self._sink.write(bytes(2 * BLOCK))
        if self._sink.size % RECORD:
            self._sink.write(bytes(RECORD - self._sink.size % RECORD))
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
