"""Reading tar shards in the WebDataset convention: scan the member headers once, group the
members into samples, and read a sample's members by offset.

A sample is a run of consecutive members sharing a key: the member path up to the first dot
of its file name (``train/0001.jpg`` and ``train/0001.cls`` form the sample ``train/0001``
with fields ``jpg`` and ``cls``; field names are lower-cased, as webdataset does). Members
that are not regular files (folders, links) and files without an extension are skipped, as
webdataset skips them. Nothing is ever extracted to a path made from a member name: members
are read by offset, and a name with a ``..`` component or an absolute path is refused.
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import io
import json
import os
import shutil
import tarfile
import zlib
from collections.abc import Iterator, Sequence
from typing import IO, Any, NamedTuple

from .._util.uri import GZIP_TAR
from ..exceptions import ShardError, UnsafeArchiveError
from .headers import member_headers


class Member(NamedTuple):
    """One field of a sample inside a shard: its name, where its bytes start, how many."""

    field: str
    offset: int
    size: int


class TarSample(NamedTuple):
    """One sample of a shard: its key and its members, in tar order."""

    key: str
    members: tuple[Member, ...]


def split_name(name: str) -> tuple[str, str] | None:
    """``dir/0001.seg.jpg`` -> (``dir/0001``, ``seg.jpg``); None for a name without extension."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash or dot == len(name) - 1:
        return None
    return name[:dot], name[dot + 1 :].lower()


def _check_name(name: str, uri: str) -> None:
    parts = name.split("/")
    if name.startswith("/") or ".." in parts or "\x00" in name:
        raise UnsafeArchiveError(f"{uri}: member {name!r} has an absolute path or a '..' component; refused")


def scan(fileobj: Any, size: int | None, uri: str, stream: bool = False) -> list[TarSample]:
    """Read the member headers of a tar and group its members into samples (the samples of
    :func:`iter_scan`, once the whole tar was checked)."""
    return list(iter_scan(fileobj, size, uri, stream))


def iter_scan(fileobj: Any, size: int | None, uri: str, stream: bool = False) -> Iterator[TarSample]:
    """Read the member headers of a tar and group its members into samples, giving each
    sample once the header that follows it was read (so, streamed, its bytes went by).

    Args:
        fileobj: the tar, seekable (data is skipped, never read), or with ``stream`` any
            file object with ``read`` (data is read and dropped as it streams by).
        size: its size in bytes, to tell a truncated tar; ``None`` with ``stream`` when
            unknown (a decompressed stream: its end is where the stream ends).
        uri: the shard's s3 URI, for messages.

    Raises:
        ShardError: not a tar, a damaged header, a truncated member, or a field twice in one
            sample (the message names the shard and the member).
        UnsafeArchiveError: a member name with ``..`` or an absolute path.
    """
    key: str | None = None
    members: list[Member] = []
    last = ""
    if stream:
        fileobj = Tail(fileobj)
    infos = member_headers(fileobj, size, uri, stream)
    try:
        while True:
            try:
                info = next(infos)
            except StopIteration as stop:
                end: int = stop.value
                break
            except (tarfile.TarError, EOFError) as exc:
                raise ShardError(
                    f"{uri}: a damaged or truncated tar after member {last!r} ({exc or type(exc).__name__})"
                ) from exc
            last = info.name
            _check_member(info, size, uri)
            if not info.isreg():
                continue
            parts = split_name(info.name)
            if parts is None:
                continue
            k, f = parts
            if k != key:
                if key is not None:
                    yield TarSample(key, tuple(members))
                key, members = k, []
            if any(m.field == f for m in members):
                raise ShardError(f"{uri}: member {info.name!r}: field {f!r} twice in sample {k!r}")
            members.append(Member(f, info.offset_data, info.size))
    finally:
        infos.close()  # tarfile's, where it read
    _check_end(fileobj, end, size, stream, last, uri)
    if key is not None:
        yield TarSample(key, tuple(members))


def _check_member(info: Any, size: int | None, uri: str) -> None:
    """A member :func:`iter_scan` can locate by offset: a safe name, its data in one piece and
    within the shard's ``size``.

    Raises:
        ShardError: a sparse or truncated member.
        UnsafeArchiveError: a member name with ``..`` or an absolute path.
    """
    _check_name(info.name, uri)
    if info.issparse():  # its data is not stored in one piece: offsets would lie
        raise ShardError(f"{uri}: member {info.name!r} is a GNU sparse file; write shards without --sparse")
    if size is not None and info.offset_data + info.size > size:
        raise ShardError(
            f"{uri}: member {info.name!r} is truncated ({info.size} bytes at offset "
            f"{info.offset_data}, the shard has {size})"
        )


class Tail:
    """A file object that reads through ``raw`` and keeps the last bytes it returned (so a
    stream's end can be checked after tarfile read its headers)."""

    KEEP = 1 << 16

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.pos = 0
        self.tail = b""
        self._head = b""

    def peek(self, n: int = 6) -> bytes:
        """The first ``n`` bytes, read ahead and given again by the next reads."""
        self._head = self.raw.read(n)
        return self._head

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        if self._head:
            data, self._head = self._head + data, b""
            if n is not None and n >= 0 and len(data) > n:
                data, self._head = data[:n], data[n:]
        self.pos += len(data)
        self.tail = (self.tail + data)[-self.KEEP :]
        return data


def _check_end(fileobj: Any, end: int, size: int | None, stream: bool, last: str, uri: str) -> None:
    # What follows the last member must be the end-of-archive blocks (zeros): anything else
    # is a tar cut short in a header, or garbage that tarfile took for the end.
    if stream:
        assert isinstance(fileobj, Tail)
        # tarfile reads ahead at most a record or so, well within the kept tail; what comes
        # after is checked as it streams by, so end padding of any length (``tar -b``) passes
        start = fileobj.pos - len(fileobj.tail)
        rest = fileobj.tail[end - start :] if end >= start else b"\x01"
        nonzero = False
        while chunk := fileobj.read(1 << 20):
            nonzero = nonzero or chunk.count(0) != len(chunk)
        if nonzero:
            rest += b"\x01"
        elif len(rest) < 512 and fileobj.pos - end >= 512:
            rest = bytes(512)
        total = fileobj.pos
    else:
        fileobj.seek(end)
        rest = fileobj.read()
        total = end + len(rest)
    if size is not None and total != size:
        raise ShardError(f"{uri}: {total} bytes read, {size} expected")
    if len(rest) < 512 or rest.count(0) != len(rest):
        raise ShardError(
            f"{uri}: a truncated or damaged tar after member {last!r} (no end-of-archive "
            f"blocks at offset {end})"
        )


def scan_file(path: str, uri: str) -> list[TarSample]:
    """:func:`scan` of a staged shard."""
    with open(path, "rb") as fh:
        return scan(fh, os.fstat(fh.fileno()).st_size, uri)


def is_gzip(uri: str) -> bool:
    """Whether a shard is named as a gzip-compressed tar (``.tar.gz``, ``.tgz``)."""
    return uri.endswith(GZIP_TAR)


class _Counted:
    """A file object that counts the bytes read through it."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.n = 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.n += len(data)
        return data


def _bad_gzip(uri: str, exc: BaseException) -> ShardError:
    return ShardError(
        f"{uri} is a gzip-compressed shard that does not decompress: not gzip, damaged or cut short ({exc})"
    )


def scan_gzip(fileobj: Any, uri: str) -> tuple[list[TarSample], int]:
    """:func:`scan` of a gzip-compressed tar read as a stream: its samples (offsets in the
    decompressed tar) and the decompressed size.

    Raises:
        ShardError: not gzip, damaged or cut short, or as :func:`scan`.
    """
    counted = _Counted(gzip.GzipFile(fileobj=fileobj, mode="rb"))  # type: ignore[arg-type]
    try:
        samples = scan(counted, None, uri, stream=True)
    except (OSError, EOFError, zlib.error) as exc:
        raise _bad_gzip(uri, exc) from exc
    except ShardError as exc:
        cause = exc.__cause__
        if isinstance(cause, (OSError, EOFError, zlib.error)):  # the gzip stream, not the tar in it
            raise _bad_gzip(uri, cause) from exc
        raise
    return samples, counted.n


def gunzip_file(path: str, uri: str) -> None:
    """Replace a staged gzip-compressed shard by its tar (written beside it, then renamed over
    it), so that its samples can be read by offset.

    Raises:
        ShardError: not gzip, damaged or cut short (the partial tar is removed).
    """
    part = path + ".tar.part"
    try:
        with gzip.open(path, "rb") as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (OSError, EOFError, zlib.error) as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)
        if isinstance(exc, OSError) and exc.errno is not None:
            raise  # the disk, not the shard: ENOSPC and the like
        raise _bad_gzip(uri, exc) from exc
    os.replace(part, path)


def scan_bytes(data: bytes, uri: str) -> list[TarSample]:
    """:func:`scan` of a shard in memory."""
    return scan(io.BytesIO(data), len(data), uri)


def read_sample(fileobj: IO[bytes], sample: TarSample) -> dict[str, bytes]:
    """The fields of ``sample`` as bytes, read by offset (``pread`` on a file's descriptor: no
    seek, no buffer between; a member cut short by the file's end comes back short)."""
    try:
        fd = fileobj.fileno()
    except (OSError, AttributeError):  # io.UnsupportedOperation: a shard in memory
        fd = -1
    out: dict[str, bytes] = {}
    for m in sample.members:
        if fd < 0:
            fileobj.seek(m.offset)
            out[m.field] = fileobj.read(m.size)
            continue
        data = os.pread(fd, m.size, m.offset)
        while 0 < len(data) < m.size:
            more = os.pread(fd, m.size - len(data), m.offset + len(data))
            if not more:
                break
            data += more
        out[m.field] = data
    return out


def dumps(samples: Sequence[TarSample]) -> bytes:
    """The member table of a shard, for the readers of a staging pass."""
    return join_table([dump_sample(s) for s in samples])


def dump_sample(sample: TarSample) -> str:
    """One sample's entry of a member table (a table grown sample by sample encodes each once)."""
    return json.dumps([sample.key, [list(m) for m in sample.members]], separators=(",", ":"))


def join_table(entries: Sequence[str]) -> bytes:
    """The member table of the samples whose entries (:func:`dump_sample`) are given."""
    return ("[" + ",".join(entries) + "]").encode()


class Table:
    """A shard's member table read from its file (:func:`dumps`), each sample built when it is
    asked for: a process reads only some of a shard's samples (a DataLoader worker, its
    share), and the readers of a shard read while it downloads load its growing table again
    and again."""

    __slots__ = ("_rows", "spans", "path")

    def __init__(self, rows: list[Any]) -> None:
        self._rows = rows
        self.spans: Any = None  # what its readers give back, made once (see ShardSet.spans)
        self.path: str | None = None  # the staged shard's file, named once (see ShardSet.read)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, j: int) -> TarSample:
        k, ms = self._rows[j]
        return TarSample(k, tuple(Member(f, o, n) for f, o, n in ms))

    def end(self, j: int) -> int:
        """Where sample ``j``'s last member ends (its offset plus size), without building it."""
        return max(o + n for _, o, n in self._rows[j][1])


def loads(data: bytes) -> Table:
    """A member table from its bytes (:func:`dumps`), parsed with the cycle collector paused: a
    table is thousands of small lists, whose allocation would otherwise set off collections that
    walk the whole heap of a DataLoader worker (torch's objects among it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return Table(json.loads(data))
    finally:
        if enabled:
            gc.enable()
