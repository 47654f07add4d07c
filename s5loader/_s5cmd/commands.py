"""Writing s5cmd command files: one quoted line per copy (``cp --raw``) or per wildcard
fetch of a block, and the file itself, readable by its owner only; what each line costs in S3
requests, and when a wildcard line costs no more than a ``cp --raw`` line per object."""

from __future__ import annotations

import os
import re
import shlex
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

# Characters that s5cmd's command-file parser cannot carry inside a quoted argument: a
# line break ends the command whatever the quoting.
_UNWRITABLE = re.compile(r"[\n\r\x00]")

#: s5cmd 2.3.0's part size for downloads (``cp --part-size``, 50 MiB by default): a larger
#: object is read with one ranged GET per part.
DOWNLOAD_PART = 50 * 1024**2
#: Keys in one ListObjectsV2 page, the most S3 returns per LIST request.
LIST_PAGE = 1000
#: The fewest objects a wildcard line must fetch to cost no more than a ``cp --raw`` line per
#: object. s5cmd 2.3.0 sends a HEAD before the GET of each ``cp --raw`` object (see
#: docs/s5cmd-head.md) and none for the objects a wildcard lists, and at AWS S3 Standard list
#: prices a LIST is billed as 12.5 GETs or HEADs ($0.005 against $0.0004 per 1,000): one LIST
#: pays for itself from 13 objects on.
WILDCARD_MIN_OBJECTS = 13


def wildcard_pays(objects: int) -> bool:
    """Whether one wildcard line that fetches ``objects`` objects costs no more in S3 requests
    than a ``cp --raw`` line per object (see :data:`WILDCARD_MIN_OBJECTS`)."""
    return objects >= WILDCARD_MIN_OBJECTS


def _parts(size: int) -> int:
    return max(1, -(-size // DOWNLOAD_PART))


def copy_requests(size: int) -> Counter[str]:
    """The S3 requests s5cmd 2.3.0 sends for a :func:`copy_line` of an object of ``size``
    bytes: a HEAD, then a GET per :data:`DOWNLOAD_PART`."""
    return Counter(HEAD=1, GET=_parts(size))


def wildcard_requests(sizes: Iterable[int]) -> Counter[str]:
    """The S3 requests s5cmd 2.3.0 sends for a :func:`wildcard_line` that matches objects of
    ``sizes`` bytes: a LIST per :data:`LIST_PAGE` keys, a GET per part of each object, and a
    HEAD for each empty one (s5cmd takes a listed size of 0 for "unknown" and asks again)."""
    out: Counter[str] = Counter()
    n = 0
    for size in sizes:
        n += 1
        out["GET"] += _parts(size)
        out["HEAD"] += size == 0
    out["LIST"] = max(1, -(-n // LIST_PAGE))
    return +out


def can_write(uri: str) -> bool:
    """Whether a URI can be written into an s5cmd command file at all."""
    return _UNWRITABLE.search(uri) is None


def copy_line(source: str, destination: str) -> str:
    """One command-file line that copies exactly ``source`` (no wildcards) to ``destination``.

    Both arguments are shell-quoted, so quotes, spaces, ``;``, ``$`` and friends in keys are
    data, never syntax. Callers must check :func:`can_write` first.
    """
    if not can_write(source) or not can_write(destination):
        raise ValueError(f"cannot write {source!r} into an s5cmd command file")
    return f"cp --raw {shlex.quote(source)} {shlex.quote(destination)}\n"


def wildcard_line(pattern: str, folder: str) -> str:
    """One command-file line that copies every object matching ``pattern`` (a key prefix
    followed by ``*``) into ``folder``, each at its path below the pattern's folder.

    s5cmd joins a matched key onto ``folder`` as it is, so a key with a ``..`` component
    (``p/../../x``) would land outside it; ``--exclude '*..*'`` leaves every key containing
    ``..`` out of the match (blocks never contain one).
    """
    if not can_write(pattern) or not can_write(folder):
        raise ValueError(f"cannot write {pattern!r} into an s5cmd command file")
    return f"cp --exclude '*..*' {shlex.quote(pattern)} {shlex.quote(folder)}\n"


def write_command_file(path: str | Path, lines: Iterable[str]) -> None:
    """Write a command file readable by its owner only (it holds bucket and key names)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(lines)
