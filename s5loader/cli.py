"""The ``s5loader`` command: ``ls`` (show the sample index), ``index-shards`` (count the
samples of tar shards), ``pack`` (objects into tar shards), ``prefetch`` (the daemon) and
``bench`` (the benchmark, the separate ``s5loader_bench`` package, imported only when that
command runs). The CLI owns the terminal; the library only logs."""

from __future__ import annotations

import importlib
import logging
import signal
import sys
import threading
from types import FrameType
from typing import Any

from ._util.args import ArgumentParser
from ._util.uri import for_cli
from .exceptions import S5LoaderError

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
QUIET_LOGGERS = ("botocore", "boto3", "s3transfer", "urllib3")


def _ls(argv: list[str]) -> int:
    from . import S5Dataset
    from .config import Access

    p = ArgumentParser(prog="s5loader ls", description="List the samples of an s3 prefix or manifest.")
    p.add_argument("source", help="s3://bucket/prefix/, or a manifest (.jsonl path or s3 URI)")
    p.add_argument("--group-by", default="stem", choices=["stem", "folder", "object"])
    Access.add_arguments(p)
    p.add_argument("--limit", type=int, default=20, help="samples to show (default 20)")
    args = p.parse_args(argv)
    access = Access.from_args(args)
    if args.source.endswith((".jsonl", ".json")):
        ds = S5Dataset.from_manifest(args.source, access=access, group_by=args.group_by)
    else:
        ds = S5Dataset.from_prefix(args.source, access=access, group_by=args.group_by)
    total = ds.total_bytes
    print(f"{len(ds)} samples, {total} bytes, largest {max(s.size for s in ds.samples)} bytes")
    for s in ds.samples[: args.limit]:
        print(f"{s.key}\t{s.size}\t{','.join(f.name for f in s.fields)}")
    return EXIT_OK


def _index_shards(argv: list[str]) -> int:
    from ._shards.indexing import build_index
    from .config import Access
    from .progress import Progress

    p = ArgumentParser(
        prog="s5loader index-shards",
        description="Count the samples of each tar shard and write a wids JSON shard list "
        "(default: wids.json in the shards' folder), for S5Dataset.from_shards.",
    )
    p.add_argument(
        "source",
        nargs="+",
        help="s3://bucket/prefix/ (every *.tar, *.tar.gz and *.tgz below it), a brace pattern "
        "('s3://b/train/shard-{000000..000999}.tar', quoted) or shard URIs",
    )
    p.add_argument("--output", help="where to write the index (s3 URI or local path)")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an index already there (else refused: s5loader pack's has each shard's MD5)",
    )
    p.add_argument("--jobs", type=int, default=8, help="shards read at once (default 8)")
    Access.add_arguments(p)
    args = p.parse_args(argv)
    source: str | list[str] = args.source[0] if len(args.source) == 1 else args.source
    # a bar on a terminal, a line every few seconds otherwise (stderr)
    with Progress("indexing shards", unit="shards") as bar:
        where, shards = build_index(
            source,
            Access.from_args(args),
            args.output,
            lambda done, total, _bytes: bar.set(done, total),
            args.jobs,
            overwrite=args.force,
        )
    print(f"{len(shards)} shards, {sum(s.nsamples for s in shards)} samples: wrote {where}")
    return EXIT_OK


COMMANDS = {
    "ls": ("list the samples of a source", "s5loader.cli:_ls"),
    "index-shards": ("count the samples of tar shards into a wids shard index", "s5loader.cli:_index_shards"),
    "prefetch": ("keep a bounded local cache filled for any consumer", "s5loader._daemon.command:main"),
    "bench": ("measure loading methods on your bucket", "s5loader_bench.cli:main"),
    "fetch": ("download big objects or a split archive through a small disk", "s5loader.fetch:main"),
    "pack": (
        "pack objects or a split archive into WebDataset tar shards with an index",
        "s5loader.packing:main",
    ),
}
BENCH_INSTALL = "pip install 's5loader[bench]'"
# Commands that end with exit code 0 on SIGTERM and SIGINT from their very start, while their
# modules (torch among them) are still loading; each takes the signals over once it runs.
STOP_CLEANLY = ("prefetch",)


class _StoppedEarly(BaseException):
    """A stop signal arrived before the command took the signals over."""


def _stop_early(signum: int, frame: FrameType | None) -> None:
    raise _StoppedEarly(signal.Signals(signum).name)


def _load(command: str) -> Any:
    """The handler of ``command``, imported now: the benchmark and its dependencies load only
    for ``s5loader bench``, and a missing one is a message that says how to install it."""
    module, _, func = COMMANDS[command][1].partition(":")
    try:
        return getattr(importlib.import_module(module), func)
    except ModuleNotFoundError as exc:
        if command != "bench":
            raise
        missing = exc.name or str(exc)
        what = (
            "the benchmark package s5loader_bench is not installed"
            if missing.startswith("s5loader_bench")
            else f"the benchmark needs {missing}, which is not installed"
        )
        print(f"s5loader bench: error: {what}: {BENCH_INSTALL}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = "\n".join(f"  {name:<{width}}  {text}" for name, (text, _) in COMMANDS.items())
        out = sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr
        if argv and argv[0] not in ("-h", "--help"):
            print(f"s5loader: unknown command {argv[0]!r}", file=out)
        print(f"usage: s5loader COMMAND [ARGS]\n\ncommands:\n{lines}", file=out)
        return EXIT_OK if out is sys.stdout else EXIT_USAGE
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The AWS libraries log their routine at INFO ("Found credentials in environment variables.",
    # once per client); the terminal shows only what they warn about.
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    previous: dict[signal.Signals, Any] = {}
    try:
        # inside the try: a signal that comes while the second handler is being set is a stop too
        if argv[0] in STOP_CLEANLY and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, _stop_early)
        handler = _load(argv[0])
        if handler is None:
            return EXIT_ERROR
        return int(handler(argv[1:]) or 0)
    except _StoppedEarly as stop:
        logging.getLogger(f"s5loader.{argv[0]}").info("stopped by %s before it began", stop)
        return EXIT_OK
    except S5LoaderError as exc:
        print(f"s5loader {argv[0]}: error: {for_cli(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback; what it had under way is stopped and removed
        print(f"s5loader {argv[0]}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
