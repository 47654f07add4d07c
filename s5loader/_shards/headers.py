"""A tar's member headers, for :func:`s5loader._shards.tar.iter_scan`: read here while they
are plain ustar (or GNU) headers of files, folders and links, and by tarfile from the first
that is not (pax and GNU long-name headers, sparse files, base-256 sizes, a damaged header) to
the end. Where both read a tar, they give the same members, offsets and errors."""

from __future__ import annotations

import tarfile
from collections.abc import Generator, Iterator
from typing import Any, NamedTuple

from ..exceptions import ShardError


def member_headers(fileobj: Any, size: int | None, uri: str, stream: bool) -> Generator[Any, None, int]:
    """The member headers of a tar (each with ``name``, ``offset_data``, ``size``, ``isreg()``
    and ``issparse()``, as tarfile's ``TarInfo``); returns the offset where the members end.

    A seekable tar of known size is read by :class:`_Ustar` while its headers are plain ones,
    and by tarfile from the first header that is not (pax, GNU long names, ...) to its end; a
    stream (a :class:`~s5loader._shards.tar.Tail`), by tarfile alone.

    Raises:
        ShardError: not a tar (named compressed where it is).
        tarfile.TarError, EOFError: a damaged tar after its first member.
    """
    if stream:
        head = fileobj.peek()
    else:
        head = fileobj.read(6)
        if size is not None:
            fast = _Ustar(fileobj)
            yield from fast
            if fast.ended:
                return fast.offset
            if fast.offset:  # tarfile reads on from the header where _Ustar stopped
                fileobj.seek(fast.offset)
                return (yield from _tar_headers(tarfile.open(fileobj=fileobj, mode="r:")))
        fileobj.seek(0)
    try:
        tar = tarfile.open(fileobj=fileobj, mode="r|" if stream else "r:")
    except tarfile.TarError as exc:
        kind = _compression(head)
        if kind:
            fix = (
                "name it .tar.gz or .tgz, which s5loader decompresses" if kind == "gzip" else "decompress it"
            )
            raise ShardError(
                f"{uri} is {kind} compressed, but named as an uncompressed tar: {fix} (s5loader reads "
                f".tar and gzip-compressed .tar.gz/.tgz shards)"
            ) from exc
        raise ShardError(f"{uri} is not a tar file ({exc})") from exc
    return (yield from _tar_headers(tar))


def _tar_headers(tar: tarfile.TarFile) -> Generator[tarfile.TarInfo, None, int]:
    try:
        while (info := tar.next()) is not None:
            yield info
        return tar.offset
    finally:
        tar.close()


# tarfile's ustar types that _Ustar reads itself: regular files (their data follows the
# header), and folders, links and devices (nothing follows)
_DATA_TYPES = frozenset(b"07\0")
_NO_DATA_TYPES = frozenset(b"123456")
_FOLDER = ord("5")


class _Header(NamedTuple):
    name: str
    offset_data: int
    size: int
    regular: bool

    def isreg(self) -> bool:
        return self.regular

    def issparse(self) -> bool:
        return False


class _Ustar:
    """The headers of a seekable tar read as tarfile reads them, for the headers that need
    none of its special cases (a header's name, prefix, size and checksum, each a few slices),
    in about a quarter of its time: tarfile builds a ``TarInfo`` of every field.
    Stops at the end-of-archive block (``ended``) or before the first header it leaves to
    tarfile (``offset``): pax and GNU long-name headers, sparse files, base-256 sizes, an
    old-style folder, and a header it cannot read (tarfile says what is wrong)."""

    def __init__(self, fileobj: Any) -> None:
        self.f = fileobj
        self.offset = 0
        self.ended = False

    def __iter__(self) -> Iterator[_Header]:
        f = self.f
        skipped = False  # the last member's data was skipped, not read
        while True:
            f.seek(self.offset)
            buf = f.read(512)
            if not buf and skipped:  # as tarfile: the tar ends inside that data
                f.seek(self.offset - 1)
                if not f.read(1):
                    raise tarfile.ReadError("unexpected end of data")
            if len(buf) < 512:
                return  # an empty or cut header: tarfile's verdict
            if buf.count(0) == 512:
                self.ended = True
                return
            header = _parse_header(buf, self.offset + 512)
            if header is None:
                return
            yield header
            self.offset = header.offset_data + (-(-header.size // 512) * 512 if header.regular else 0)
            skipped = self.offset != header.offset_data


def _parse_header(buf: bytes, data: int) -> _Header | None:
    """``buf`` as tarfile's ``TarInfo.frombuf`` reads it, where it needs none of the special
    cases; None otherwise."""
    kind = buf[156]
    if kind not in _DATA_TYPES and kind not in _NO_DATA_TYPES or buf[124] & 0x80 or buf[148] & 0x80:
        return None
    try:
        size = int(buf[124:136].split(b"\0", 1)[0].decode("ascii").strip() or "0", 8)
        chksum = int(buf[148:156].split(b"\0", 1)[0].decode("ascii").strip() or "0", 8)
    except ValueError:
        return None
    if chksum != 256 + sum(buf[:148]) + sum(buf[156:]):
        return None  # a damaged header, or one summed with signed bytes
    name = buf[:100].split(b"\0", 1)[0].decode(tarfile.ENCODING, "surrogateescape")
    if name.endswith("/") and kind in _DATA_TYPES:
        return None  # an old-style folder (tarfile makes it one), or a file named so
    folder = kind == _FOLDER
    if folder:
        name = name.rstrip("/")
    prefix = buf[345:500].split(b"\0", 1)[0]
    if prefix:
        name = prefix.decode(tarfile.ENCODING, "surrogateescape") + "/" + name
        if folder:
            name = name.rstrip("/")  # as tarfile: once more, after the prefix
    return _Header(name, data, size, kind in _DATA_TYPES)


_MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


def _compression(head: bytes) -> str:
    return next((kind for magic, kind in _MAGIC.items() if head.startswith(magic)), "")
