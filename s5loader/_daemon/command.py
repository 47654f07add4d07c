"""``s5loader prefetch``: the command line, signals and exit codes of the daemon."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

from .._index.sample import GROUP_BY
from .._util.args import ArgumentParser, positive_int
from .._util.platform import require_linux
from .._util.uri import format_size
from ..cli import EXIT_ERROR, EXIT_OK
from ..config import Access
from ..handover import daemon_status, sample_bytes
from .flags import NOT_DAEMON, add_staging_arguments, staging_from_args
from .lock import CacheLock, record_failure, take_cache

if TYPE_CHECKING:
    from .prefetch_options import PrefetchOptions
    from .prefetcher import PrefetchDaemon

log = logging.getLogger(__name__)


class _Interrupted(BaseException):
    """A stop signal arrived while nothing needed a clean stop (before the first sample)."""


def _starting_process(frame: FrameType | None) -> bool:
    """Whether the main thread is starting a process (s5cmd's start and its fork hooks,
    ``subprocess``): an exception raised there would leave the spawn lock unbalanced, so the
    stop waits for the next check of the signal event instead."""
    spawn = {"start", "_before_fork", "_after_fork_in_parent"}
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith("subprocess.py") or (
            name.endswith(os.path.join("s5cmd", "process.py")) and frame.f_code.co_name in spawn
        ):
            return True
        frame = frame.f_back
    return False


class _Signals:
    """SIGTERM and SIGINT set :attr:`event`; while :attr:`interruptible`, they also raise."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.interruptible = True
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name
        self.event.set()
        if self.interruptible and not _starting_process(frame):
            raise _Interrupted()

    def __enter__(self) -> _Signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _DefaultsHelp(argparse.HelpFormatter):
    """Shows every option's default, except for required options and those without one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.required or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        default = "off" if action.default is False else "%(default)s"
        return f"{text} (default: {default})"


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``s5loader prefetch``: the source, the cache, the order and the staging
    options the daemon takes, and how to reach the store."""
    p = ArgumentParser(
        prog="s5loader prefetch",
        formatter_class=_DefaultsHelp,
        description=(
            "Keep a local cache directory filled with samples from S3, up to a byte budget, "
            "for any consumer: each sample appears complete as a folder SEQUENCE-KEY/ (ls order "
            "is the delivery order), the consumer deletes it when done, END marks the end."
        ),
        epilog=(
            "exit codes: 0 done or stopped by SIGTERM/SIGINT, 1 error, 2 usage. "
            "'s5loader prefetch --status CACHE [--grace S]' says whether a daemon is alive on CACHE "
            "(exit code 0) or failed or is gone (1). See docs/daemon.md."
        ),
    )
    p.add_argument("source", help="s3://bucket/prefix/, or a JSON Lines manifest (local path or s3 URI)")
    p.add_argument("--cache", required=True, help="the cache directory consumers read from")
    p.add_argument("--group-by", default="stem", choices=list(GROUP_BY), help="how objects form samples")
    p.add_argument(
        "--shards",
        action="store_true",
        help="the source names tar shards in the WebDataset format (a prefix of *.tar, a brace pattern "
        "'s3://b/shard-{000..099}.tar' or one shard): each sample is delivered as a folder of its fields; "
        "--shuffle permutes the shards (block or not); --budget must hold the largest shard beside the "
        "samples written out that the consumer holds (a sixteenth of the budget)",
    )
    p.add_argument(
        "--index", help="with --shards: the wids shard index (default: wids.json beside the shards)"
    )
    p.add_argument(
        "--shuffle",
        nargs="?",
        const=True,
        default=False,
        type=_shuffle_arg,
        metavar="block",
        help=(
            "a seeded permutation per epoch; '--shuffle block' permutes blocks of samples that share a key "
            "prefix"
        ),
    )
    p.add_argument("--seed", type=int, default=0, help="the permutation's seed")
    p.add_argument("--epochs", type=positive_int, default=1, help="passes over the source")
    # The former names of --calls-in-flight and --s5cmd-workers, accepted for one release.
    p.add_argument("--buffers", type=positive_int, dest="old_buffers", help=argparse.SUPPRESS)
    p.add_argument("--numworkers", type=positive_int, dest="old_numworkers", help=argparse.SUPPRESS)
    add_staging_arguments(
        p,
        exclude=NOT_DAEMON,
        required=("budget",),
        help={
            "budget": (
                "most bytes in the cache: samples delivered and not yet consumed, and those being fetched "
                "(e.g. 2GiB)"
            ),
            "epoch_cache": (
                "bytes of samples kept from one epoch for the next, beside --budget (e.g. 8GiB): read "
                "locally, not fetched again"
            ),
        },
    )
    p.add_argument("--fresh", action="store_true", help="discard the cache's samples and progress first")
    p.add_argument(
        "--json-log",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write JSON lines of progress to PATH, or to stdout without PATH (default: none)",
    )
    bar = p.add_mutually_exclusive_group()
    bar.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="always draw the bar (default: only when stderr is a terminal)",
    )
    bar.add_argument(
        "--no-progress", dest="progress", action="store_false", default=None, help="never draw the bar"
    )
    Access.add_arguments(p)
    return p


def _shuffle_arg(text: str) -> str:
    if text != "block":
        raise argparse.ArgumentTypeError(f"the only value --shuffle takes is 'block', got {text!r}")
    return text


def _renamed(args: argparse.Namespace, old: str, new: str) -> int:
    """The value of an option whose flag was renamed; the old flag warns."""
    value = getattr(args, "old_" + old)
    if value is None:
        return int(getattr(args, new))
    log.warning("--%s is deprecated; use --%s", old, new.replace("_", "-"))
    return int(value)


def options_from_args(args: argparse.Namespace) -> PrefetchOptions:
    from .prefetch_options import PrefetchOptions  # loads torch (the order's permutations): after the lock

    staging = staging_from_args(
        args,
        calls_in_flight=_renamed(args, "buffers", "calls_in_flight"),
        s5cmd_workers=_renamed(args, "numworkers", "s5cmd_workers"),
    )
    return PrefetchOptions(
        source=args.source,
        cache=args.cache,
        staging=staging,
        group_by=args.group_by,
        shuffle=args.shuffle,
        seed=args.seed,
        epochs=args.epochs,
        access=Access.from_args(args),
        fresh=args.fresh,
        json_log=args.json_log,
        progress=args.progress,
        shards=args.shards,
        index=args.index,
    )


def _daemon(args: argparse.Namespace, stop: threading.Event, lock: CacheLock) -> PrefetchDaemon:
    from .prefetcher import PrefetchDaemon  # loads torch: after the lock is taken

    return PrefetchDaemon(options_from_args(args), stop=stop, lock=lock)


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return v


def status(argv: list[str]) -> int:
    """``s5loader prefetch --status CACHE [--grace S]``: whether a daemon is alive on CACHE.

    Prints what it found and the bytes of samples in the cache; returns 0 while a daemon runs
    (or it delivered everything), 1 when it failed (its message) or is gone and no daemon took
    the cache within ``--grace`` seconds. It probes the lock without disturbing a daemon.
    """
    p = ArgumentParser(
        prog="s5loader prefetch --status",
        description="Whether a prefetch daemon is alive on a cache: exit code 0 while one runs or after it "
        "delivered everything, 1 when it failed (its message) or is gone (killed, stopped, never started).",
    )
    p.add_argument("--status", metavar="CACHE", required=True, help="the daemon's --cache directory")
    p.add_argument(
        "--grace",
        type=_seconds,
        default=0.0,
        help=(
            "seconds to wait for a daemon to take the cache before saying that it failed or is gone "
            "(default: 0)"
        ),
    )
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.grace
    while True:
        found = daemon_status(args.status)
        if found.alive or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if not found.alive:
        print(f"s5loader prefetch: error: {found.describe()}", file=sys.stderr)
        return EXIT_ERROR
    held = sample_bytes(args.status)
    print(f"{found.state}: {found.describe()}; {held} bytes of samples in the cache ({format_size(held)})")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """``s5loader prefetch``: returns the exit code (0 done or stopped by a signal).

    Raises:
        S5LoaderError: an error (``s5loader`` prints it and exits with 1; the cache's ``ERROR``
            holds it too once the daemon had taken the cache).
        SystemExit: a usage error (exit code 2).
    """
    if argv and "--status" in argv:
        return status(argv)
    args = build_parser().parse_args(argv)
    require_linux("the prefetch daemon")  # before the cache is made
    cache = os.path.abspath(args.cache)
    with _Signals() as signals:
        lock: CacheLock | None = None
        prefetcher: PrefetchDaemon | None = None
        try:
            try:
                # The cache's lock first, before torch loads (seconds on a busy machine): a
                # consumer that probes the lock sees this daemon at once.
                lock = take_cache(cache, args.fresh)
                prefetcher = _daemon(args, signals.event, lock)
                prefetcher.open()
            finally:
                signals.interruptible = False
            if signals.event.is_set():
                raise _Interrupted()
            summary = prefetcher.run()
        except _Interrupted:
            log.info("stopped by %s before the first delivery", signals.received)
            return EXIT_OK
        except Exception as exc:
            # ERROR in the cache (once this daemon holds it), for its consumers
            if prefetcher is not None:
                prefetcher.fail(exc)
            else:
                record_failure(cache, exc, lock or CacheLock(cache), args.json_log, None)
            raise
        finally:
            if prefetcher is not None:
                prefetcher.close()
            elif lock is not None:
                lock.release()
    if summary.stopped:
        log.info(
            "stopped by %s: %d samples delivered in this run, %d of %d in all; a restart continues",
            signals.received,
            summary.delivered,
            summary.resumed_from + summary.delivered + summary.skipped,
            summary.total,
        )
    else:
        log.info(
            "done: %d samples delivered in this run (%d skipped), starved %d time(s) for %.1fs",
            summary.delivered,
            summary.skipped,
            summary.starved,
            summary.starved_s,
        )
    return EXIT_OK
