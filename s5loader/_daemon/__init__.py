"""``s5loader prefetch``: a daemon that keeps a bounded local cache filled from S3 for any
consumer, in any language.

It builds the same sample index as :class:`~s5loader.S5Dataset`, orders it as
:class:`~s5loader.S5Sampler` does (one seeded permutation per epoch) and stages with the same
s5cmd engine (:class:`~s5loader._engine.Stager`) into a hidden ``.staging`` directory inside
the cache. Each sample whose turn has come is renamed into place as ``SEQUENCE-KEY/`` (see
:mod:`s5loader.handover` and docs/daemon.md for the protocol); the consumer deletes it, which
frees its bytes for the next. A state file records how far delivery got, so a restarted
daemon continues where the last one stopped.

Layout of a cache directory::

    CACHE/000000000000-train_0000/   a delivered sample (its files named by field)
    CACHE/END                        every sample was delivered
    CACHE/ERROR                      the daemon failed: its message
    CACHE/.lock                      flock-ed by the running daemon (holds its pid)
    CACHE/.state.json                progress; replaced atomically after every delivery
    CACHE/.claimed/                  samples consumers claimed (by rename) and did not delete yet
    CACHE/.staging/                  samples being fetched (never visible to ``ls``)
    CACHE/.epoch-cache/              with ``--epoch-cache``: samples kept for the next epoch
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .protocol import END_MARKER, LOCK_FILE, STAGING_DIR, STATE_FILE, sample_folder_name

if TYPE_CHECKING:
    from .command import build_parser, main, options_from_args
    from .delivery import Summary
    from .prefetch_options import PrefetchOptions
    from .prefetcher import PrefetchDaemon

__all__ = [
    "END_MARKER",
    "LOCK_FILE",
    "STAGING_DIR",
    "STATE_FILE",
    "PrefetchOptions",
    "PrefetchDaemon",
    "Summary",
    "build_parser",
    "main",
    "options_from_args",
    "sample_folder_name",
]

# The names that load torch come from their modules when first asked for, so ``s5loader
# prefetch`` takes its cache's lock before torch loads (see .cli.main).
_LAZY = {
    "build_parser": "command",
    "main": "command",
    "options_from_args": "command",
    "Summary": "delivery",
    "PrefetchOptions": "prefetch_options",
    "PrefetchDaemon": "prefetcher",
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
