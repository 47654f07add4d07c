"""The cache directory's names: what the daemon writes and a consumer reads (docs/daemon.md).

The names a consumer sees (sample folders in delivery order, ``END``, ``ERROR``, ``.claimed/``,
the lock) are :mod:`s5loader.handover`'s, which depends on nothing of the daemon; they are
re-exported here with the daemon's own, so the daemon's modules take them from one place.
"""

from __future__ import annotations

import re

from ..handover import (
    CLAIMED_DIR,
    CONTROL_FILES,
    END_MARKER,
    EPOCH_FILE,
    ERROR_MARKER,
    KEY_FILE,
    LOCK_FILE,
    SEQ_WIDTH,
    STAGING_DIR,
    STATE_FILE,
    claimed_names,
    parse_seq,
    ready_names,
)

__all__ = [
    "CLAIMED_DIR",
    "CONTROL_FILES",
    "END_MARKER",
    "END_TMP",
    "EPOCH_DIR",
    "EPOCH_FILE",
    "ERROR_MARKER",
    "ERROR_TMP",
    "KEY_FILE",
    "LOCK_FILE",
    "SEQ_WIDTH",
    "STAGING_DIR",
    "STATE_FILE",
    "STATE_TMP",
    "claimed_names",
    "parse_seq",
    "ready_names",
    "sample_folder_name",
]

STATE_TMP = f"{STATE_FILE}.tmp"
EPOCH_DIR = ".epoch-cache"
END_TMP = f".{END_MARKER}.tmp"
ERROR_TMP = f".{ERROR_MARKER}.tmp"
_KEY_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_KEY_LEN = 64


def sample_folder_name(seq: int, key: str) -> str:
    """``SEQUENCE-KEY``: the zero-padded delivery number, then the key made safe and short.

    The key keeps its last 64 characters (the most specific part); anything but letters,
    digits, ``.``, ``_`` and ``-`` becomes ``_``.
    """
    short = _KEY_CHARS.sub("_", key)[-_KEY_LEN:] or "_"
    return f"{seq:0{SEQ_WIDTH}d}-{short}"
