"""The cache directory's names: what the daemon writes and a consumer reads (docs/daemon.md).

The consumer's side of the protocol (sample folders in delivery order, ``END``) is
:mod:`s5loader.consume`, which depends on nothing of the daemon; its names are re-exported
here so the daemon's modules take them from one place.
"""

from __future__ import annotations

import re

from ..consume import END_MARKER, KEY_FILE, SEQ_WIDTH, parse_seq, ready_names

__all__ = [
    "END_MARKER", "END_TMP", "EPOCH_DIR", "KEY_FILE", "LOCK_FILE", "SEQ_WIDTH", "STAGING_DIR", "STATE_FILE", "STATE_TMP",
    "parse_seq", "ready_names", "sample_folder_name",
]

STATE_FILE = ".state.json"
STATE_TMP = f"{STATE_FILE}.tmp"
LOCK_FILE = ".lock"
STAGING_DIR = ".staging"
EPOCH_DIR = ".epoch-cache"
END_TMP = f".{END_MARKER}.tmp"
_KEY_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_KEY_LEN = 64


def sample_folder_name(seq: int, key: str) -> str:
    """``SEQUENCE-KEY``: the zero-padded delivery number, then the key made safe and short.

    The key keeps its last 64 characters (the most specific part); anything but letters,
    digits, ``.``, ``_`` and ``-`` becomes ``_``.
    """
    short = _KEY_CHARS.sub("_", key)[-_KEY_LEN:] or "_"
    return f"{seq:0{SEQ_WIDTH}d}-{short}"
