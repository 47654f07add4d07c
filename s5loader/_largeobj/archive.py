"""Extracting a tar archive (``.tar``, ``.tar.gz``/``.tgz``, ``.tar.bz2``, ``.tar.xz``,
``.tar.zst``) from a stream, so an archive split into volumes is joined and extracted in one
pass and never stored whole; members that would land outside the destination are refused."""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import tarfile
import zlib
from typing import Any

from .._staging.area import free_bytes
from .._util.uri import format_size
from ..exceptions import ConfigError, FetchError, StagingSpaceError, UnsafeArchiveError

log = logging.getLogger(__name__)

MARGIN = 1024**2
SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst", ".tzst")


class _NoFilterError(Exception):
    """Stands for ``tarfile.FilterError`` on a Python without extraction filters."""


_FilterError: type[Exception] = getattr(tarfile, "FilterError", _NoFilterError)


def is_zstd(name: str) -> bool:
    return ".tar.zst" in name or ".tzst" in name


def _unsafe(member: tarfile.TarInfo) -> str | None:
    """Why ``member`` would land outside the destination, or ``None``."""
    name = member.name
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return "an absolute path"
    norm = posixpath.normpath(name)
    if norm == ".." or norm.startswith("../"):
        return "a path that leaves the destination"
    if member.issym():
        target = member.linkname
        if target.startswith("/"):
            return f"a symbolic link to the absolute path {target!r}"
        joined = posixpath.normpath(posixpath.join(posixpath.dirname(norm), target))
        if joined == ".." or joined.startswith("../"):
            return f"a symbolic link to {target!r}, outside the destination"
    if member.islnk():
        target = posixpath.normpath(member.linkname)
        if member.linkname.startswith("/") or target == ".." or target.startswith("../"):
            return f"a hard link to {member.linkname!r}, outside the destination"
    return None


def extract_stream(stream: Any, dest: str, archive: str) -> tuple[int, int]:
    """Extract the tar archive read from ``stream`` into the directory ``dest``.

    Args:
        stream: the archive's bytes (the joined volumes), read once, in order.
        dest: an empty directory of the caller's own.
        archive: the archive's name (its first volume's URI), for the compression and for
            messages.

    Returns:
        the number of members and the bytes of regular files extracted.

    Raises:
        UnsafeArchiveError: a member's path is absolute or leaves ``dest``, or a link points
            outside it; nothing after it is extracted.
        StagingSpaceError: a member does not fit the free space of ``dest``.
        ConfigError: a ``.tar.zst`` archive and no ``zstandard`` module.
    """
    src, mode = _decompressing(stream, archive)
    members = written = 0
    try:
        with tarfile.open(fileobj=src, mode=mode) as tar:  # type: ignore[call-overload]
            for member in tar:
                if _extract_member(tar, member, dest, archive, written):
                    members += 1
                    written += member.size if member.isfile() else 0
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StagingSpaceError(
                f"{archive}: the disk of {dest} filled up after {format_size(written)} extracted"
            ) from exc
        raise
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise FetchError(f"{archive}: not a readable tar archive ({type(exc).__name__}: {exc})") from exc
    return members, written


def _decompressing(stream: Any, archive: str) -> tuple[Any, str]:
    """The stream ``tarfile`` reads and its mode: ``tarfile``'s own decompression (``r|*``), or
    for a ``.tar.zst`` archive a zstandard reader over ``stream`` (read across its frames).

    Raises:
        ConfigError: a ``.tar.zst`` archive and no ``zstandard`` module.
    """
    if not is_zstd(archive):
        return stream, "r|*"
    try:
        import zstandard
    except ImportError as exc:
        raise ConfigError(
            f"{archive} is a zstandard archive; install the 'zstandard' module to extract it "
            "(pip install zstandard)"
        ) from exc
    return zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True), "r|"


def _extract_member(
    tar: tarfile.TarFile, member: tarfile.TarInfo, dest: str, archive: str, written: int
) -> bool:
    """Extract one member into ``dest`` (with the data filter where Python has it); False for a
    member that is no file, directory or link, which is skipped with a warning.

    Raises:
        UnsafeArchiveError: the member's path or link leaves ``dest``, or the filter refuses it.
        StagingSpaceError: a file larger than the free space of ``dest``.
    """
    why = _unsafe(member)
    if why is not None:
        raise UnsafeArchiveError(f"{archive}: refusing the member {member.name!r}: {why}")
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        log.warning("%s: skipping %r (not a file, directory or link)", archive, member.name)
        return False
    if member.isfile():
        free = free_bytes(dest)
        if member.size + MARGIN > free:
            raise StagingSpaceError(
                f"{archive}: the member {member.name!r} needs {format_size(member.size)}; "
                f"{format_size(free)} free in {dest} (after {format_size(written)} extracted)"
            )
    data_filter = getattr(tarfile, "data_filter", None)
    try:
        if data_filter is not None:
            tar.extract(member, dest, set_attrs=True, filter=data_filter)
        else:  # pragma: no cover - Python without extraction filters
            tar.extract(member, dest)
    except _FilterError as exc:  # the data filter's own checks (special modes, ...)
        raise UnsafeArchiveError(f"{archive}: refusing the member {member.name!r}: {exc}") from exc
    return True


def merge_into(src: str, dest: str) -> None:
    """Move everything in ``src`` into ``dest`` (same file system), replacing files and
    merging directories."""
    os.makedirs(dest, exist_ok=True)
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dest, name)
        if os.path.isdir(s) and not os.path.islink(s) and os.path.isdir(d) and not os.path.islink(d):
            merge_into(s, d)
        else:
            if os.path.isdir(d) and not os.path.islink(d):
                raise FileExistsError(errno.EEXIST, f"a directory is in the way of {name!r}", d)
            os.replace(s, d)
