"""Checking an object's bytes: against a sibling ``.md5`` file (md5sum format), else its
single-part ETag (the MD5), else its multipart ETag (the MD5 of the parts' MD5s, ``-N``)
recomputed for the part sizes that give N parts."""

from __future__ import annotations

import hashlib
import re
from typing import Any

from ..exceptions import ChecksumError

MiB = 1024**2
_MD5 = re.compile(r"^[0-9a-fA-F]{32}$")
_MULTIPART = re.compile(r"^([0-9a-fA-F]{32})-(\d+)$")
# Part sizes that common tools use (aws cli and boto3 8 MiB, s5cmd 50 MiB, ...).
_COMMON = (8, 5, 16, 50, 64, 15, 32, 100, 128, 10, 25, 256, 512)


def parse_md5_file(text: str, name: str) -> str | None:
    """The hash for ``name`` in an md5sum-format file (``HASH  NAME`` or ``HASH *NAME``);
    a file with one line gives its hash whatever the name."""
    entries = []
    for line in text.splitlines():
        parts = line.strip().split(None, 1)
        if parts and _MD5.match(parts[0]):
            entries.append((parts[0].lower(), parts[1].lstrip("*").strip() if len(parts) > 1 else ""))
    for digest, entry in entries:
        if entry.rsplit("/", 1)[-1] == name:
            return digest
    return entries[0][0] if len(entries) == 1 else None


def _part_sizes(size: int, parts: int) -> list[int]:
    """Part sizes (bytes) that split ``size`` bytes into exactly ``parts`` parts, best guess
    first: size / parts rounded up to a whole MiB, then common sizes."""
    out: list[int] = []
    guesses = [-(-size // parts // MiB) * MiB if size >= parts else MiB, -(-size // parts)]
    for p in guesses + [c * MiB for c in _COMMON]:
        if p > 0 and -(-size // p) == parts and p not in out:
            out.append(p)
    return out[:6]


class _Parts:
    def __init__(self, part: int) -> None:
        self.part, self.filled, self.cur = part, 0, hashlib.md5()  # noqa: S324
        self.digests: list[bytes] = []

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), self.part - self.filled)
            self.cur.update(data[:take])
            self.filled += take
            data = data[take:]
            if self.filled == self.part:
                self.digests.append(self.cur.digest())
                self.cur, self.filled = hashlib.md5(), 0  # noqa: S324

    def etag(self) -> str:
        digests = self.digests + ([self.cur.digest()] if self.filled else [])
        return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"  # noqa: S324


class Checker:
    """Hashes an object's bytes as they pass; :meth:`check` compares at the end.

    Args:
        uri: the object, for messages.
        size: its size from the listing.
        etag: its ETag (without quotes).
        md5: the hash from a sibling ``.md5`` file, which wins over the ETag.
    """

    def __init__(self, uri: str, size: int, etag: str, md5: str | None = None) -> None:
        self.uri, self.size, self.seen = uri, size, 0
        self.expected: str | None = None
        self.source = ""
        self._md5: Any = None
        self._parts: list[_Parts] = []
        if md5:
            self.expected, self.source, self._md5 = md5.lower(), f"{uri}.md5", hashlib.md5()  # noqa: S324
        elif _MD5.match(etag or ""):
            self.expected, self.source, self._md5 = etag.lower(), "its ETag", hashlib.md5()  # noqa: S324
        elif m := _MULTIPART.match(etag or ""):
            self.expected, self.source = etag.lower(), "its multipart ETag"
            self._parts = [_Parts(p) for p in _part_sizes(size, int(m.group(2)))]

    @property
    def can_check(self) -> bool:
        return self.expected is not None and (self._md5 is not None or bool(self._parts))

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.seen += len(view)
        if self._md5 is not None:
            self._md5.update(view)
        for p in self._parts:
            p.update(view)

    def check(self) -> None:
        """Raises:
        ChecksumError: the size or the hash does not match; the message names the object."""
        if self.seen != self.size:
            raise ChecksumError(f"{self.uri}: got {self.seen} bytes, the listing says {self.size}")
        if not self.can_check:
            return
        if self._md5 is not None:
            got = self._md5.hexdigest()
            if got != self.expected:
                raise ChecksumError(
                    f"{self.uri}: MD5 {got} does not match {self.expected} from {self.source}"
                )
            return
        got_all = [p.etag() for p in self._parts]
        if self.expected not in got_all:
            sizes = ", ".join(f"{p.part / MiB:g} MiB" for p in self._parts)
            raise ChecksumError(
                f"{self.uri}: the bytes do not match {self.source} {self.expected} "
                f"(recomputed with part sizes {sizes}: {', '.join(got_all)})"
            )


def check_file(path: str, checker: Checker, block: int = 8 * MiB) -> None:
    """Hash a downloaded file and check it."""
    buf = bytearray(block)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            checker.update(view[:n])
    checker.check()
