"""The staging options on a command line: one flag per field of
:class:`~s5loader.config.StagingOptions`, named after it (``samples_per_call`` is
``--samples-per-call``), with its type, default and help written once here, so ``s5loader
prefetch`` and :class:`~s5loader.Prefetcher` (which runs it) take the same options as
:class:`~s5loader.S5Sampler` by the same names."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any

from .._util.args import non_negative_int, positive_float, positive_int, size_arg
from ..config import ON_ERROR, StagingOptions


def _non_negative_float(text: str) -> float:
    return 0.0 if text.strip() in ("0", "0.0") else positive_float(text)


# field -> (argparse type, or None for a switch; help)
FLAGS: dict[str, tuple[Callable[[str], Any] | None, str]] = {
    "budget": (size_arg, "most bytes staged and not yet consumed (e.g. 2GiB, 500MB)"),
    "samples_per_call": (positive_int, "samples per s5cmd call"),
    "calls_in_flight": (positive_int, "s5cmd calls running at once"),
    "s5cmd_workers": (positive_int, "s5cmd --numworkers (parallel requests per call)"),
    "block_size": (positive_int, "most samples in a block, with --shuffle block (or twice, see docs)"),
    "stall_timeout": (positive_float, "seconds without progress before a call or a copy counts as stalled"),
    "retries": (non_negative_int, "retries of a sample that failed for a transient reason"),
    "retry_backoff": (_non_negative_float, "seconds before the first retry (doubling)"),
    "on_error": (str, f"a sample that cannot be fetched: {' or '.join(ON_ERROR)}"),
    "verify": (None, "check each staged file against the listing's size and MD5 ETag"),
    "keep_staged": (None, "keep staged files across epochs"),
    "shrink_budget": (None, "shrink a budget larger than the free space instead of failing"),
    "staging_dir": (str, "the staging root (default: /dev/shm when it has room, else the temp directory)"),
    "epoch_cache": (
        size_arg,
        "bytes of samples kept from one epoch for the next, beside the budget (e.g. 8GiB)",
    ),
    "keep_epoch_cache": (None, "leave the epoch cache behind for a later run"),
}
assert set(FLAGS) == {f.name for f in fields(StagingOptions)}, "a staging option without its flag"

# Staging options that mean nothing to the daemon: it stages inside its cache and keeps nothing
# staged across epochs but its epoch cache, which it keeps until the last epoch.
NOT_DAEMON = ("staging_dir", "keep_staged", "shrink_budget", "keep_epoch_cache")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_staging_arguments(
    parser: argparse.ArgumentParser,
    exclude: Iterable[str] = (),
    required: Iterable[str] = (),
    help: dict[str, str] | None = None,
) -> None:
    """Add a flag for each staging option but ``exclude`` (``required``: with no default;
    ``help``: wording of a command's own for some of them)."""
    defaults = StagingOptions()
    group = parser.add_argument_group("staging options (as S5Sampler's, see StagingOptions)")
    skip, must = set(exclude), set(required)
    for name, (kind, text) in FLAGS.items():
        if name in skip:
            continue
        text = (help or {}).get(name, text)
        if kind is None:
            group.add_argument(flag(name), dest=name, action="store_true", help=text)
        elif name in must:
            group.add_argument(flag(name), dest=name, type=kind, required=True, help=text)
        else:
            choices = list(ON_ERROR) if name == "on_error" else None
            group.add_argument(
                flag(name), dest=name, type=kind, default=getattr(defaults, name), choices=choices, help=text
            )


def staging_from_args(args: argparse.Namespace, **given: Any) -> StagingOptions:
    """The :class:`StagingOptions` of the flags :func:`add_staging_arguments` added (``given``:
    values the command sets itself)."""
    values = {name: getattr(args, name) for name in FLAGS if hasattr(args, name)}
    return StagingOptions(**{**values, **given})


def staging_to_args(options: StagingOptions, exclude: Iterable[str] = ()) -> list[str]:
    """The flags that give ``options`` (those that differ from the defaults, and ``budget``)."""
    defaults = StagingOptions()
    skip = set(exclude)
    argv: list[str] = []
    for name, (kind, _) in FLAGS.items():
        value = getattr(options, name)
        if name in skip or (value == getattr(defaults, name) and name != "budget"):
            continue
        argv += [flag(name)] if kind is None else [flag(name), str(value)]
    return argv
