"""Writing s5cmd command files: one quoted line per copy (``cp --raw``) or per wildcard
fetch of a block, and the file itself, readable by its owner only."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterable
from pathlib import Path

# Characters that s5cmd's command-file parser cannot carry inside a quoted argument: a
# line break ends the command whatever the quoting.
_UNWRITABLE = re.compile(r"[\n\r\x00]")



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
