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
import re
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

from . import _archive, _transfer, _verify
from ._index import boto3_error, list_prefix
from ._uri import format_size, parse_s3_uri, parse_size
from .checkpoint import DEFAULT_CONCURRENCY
from .config import Access
from .exceptions import (
    ConfigError,
    EmptySourceError,
    FetchError,
    ObjectNotFoundError,
    S5LoaderError,
    StagingSpaceError,
    UnsafeArchiveError,
)
from .progress import Progress
from .s5cmd import ObjectInfo, S5cmd, kill, start_cat, start_copy
from .staging.area import free_bytes, register_cleanup

log = logging.getLogger(__name__)

DEFAULT_BUDGET = 1024**3
WORK_PREFIX = ".s5loader-fetch-"

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
    objects, names, md5_files = _resolve(uris, s5, store, skip_md5=verify or extract, verify=verify)
    total = sum(o.size for o in objects)
    single_file = len(uris) == 1 and len(objects) == 1 and not extract and not _is_dir_target(dest, uris[0])
    dest_dir = os.path.dirname(os.path.abspath(dest)) if single_file else os.path.abspath(dest)
    os.makedirs(dest_dir, exist_ok=True)
    free = free_bytes(dest_dir)
    if extract:
        staged = min(limit, total)
        need = staged + total
        what = (
            f"{format_size(staged)} of volumes at a time (the budget) + at least {format_size(total)} "
            "extracted"
        )
    else:
        need, what = total, f"{len(objects)} objects"
    if need + _transfer.margin(need) > free:
        raise StagingSpaceError(
            f"{uris[0]}: fetching into {dest_dir} needs {format_size(need)} ({what}); "
            f"{format_size(free)} free there"
        )
    checkers = {o.uri: _checker(o, md5_files, store) if verify else None for o in objects}
    work = _Work(dest_dir)
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


def _is_dir_target(dest: str, uri: str) -> bool:
    return dest.endswith(("/", os.sep)) or os.path.isdir(dest) or uri.endswith("/")


_DIGITS = re.compile(r"(\d+)")


def natural_key(key: str) -> list[Any]:
    """Sort key that orders ``vol2`` before ``vol10``."""
    return [int(t) if t.isdigit() else t for t in _DIGITS.split(key)]


def _resolve(
    uris: Sequence[str], s5: S5cmd, endpoint_url: Access | str | None, skip_md5: bool, verify: bool
) -> tuple[list[ObjectInfo], dict[str, str], dict[str, ObjectInfo]]:
    """The objects to fetch, in order; the file name (relative to DEST) of each, by URI; the
    ``.md5`` objects seen beside them."""
    found: list[tuple[str, ObjectInfo]] = []  # (listing prefix, object)
    for uri in uris:
        u = parse_s3_uri(uri)
        if u.key and not uri.endswith("/"):
            try:
                size, etag = _transfer.head_size(uri, endpoint_url)
                found.append((uri.rsplit("/", 1)[0] + "/", ObjectInfo(uri, u.key, size, etag)))
            except ObjectNotFoundError:
                pass  # a key prefix, such as the common start of a split archive's volumes
            else:
                if verify:  # its .md5 sibling, which no listing showed
                    try:
                        size, etag = _transfer.head_size(uri + ".md5", endpoint_url)
                        found.append((uri.rsplit("/", 1)[0] + "/", ObjectInfo(uri + ".md5", u.key + ".md5", size, etag)))
                    except ObjectNotFoundError:
                        pass
                continue
        try:
            listed = list_prefix(uri, s5)
        except EmptySourceError as exc:
            raise EmptySourceError(f"no object {uri} and no object under it") from exc
        base = uri if uri.endswith("/") or not u.key else uri.rsplit("/", 1)[0] + "/"
        found += [(base, o) for o in sorted(listed, key=lambda o: natural_key(o.key))]
    keys = {o.uri for _, o in found}
    md5_files = {o.uri: o for _, o in found if o.uri.endswith(".md5") and o.uri[:-4] in keys}
    objects: list[ObjectInfo] = []
    names: dict[str, str] = {}
    for base, o in found:
        if skip_md5 and o.uri in md5_files:
            continue
        rel = o.uri[len(base):] if o.uri.startswith(base) else o.key.rsplit("/", 1)[-1]
        norm = os.path.normpath(rel)
        if not rel or os.path.isabs(rel) or norm == ".." or norm.startswith("../") or rel.endswith("/"):
            raise UnsafeArchiveError(f"{o.uri}: its key cannot be a file name inside the destination")
        objects.append(o)
        names[o.uri] = norm
    if not objects:
        raise EmptySourceError(f"nothing to fetch from {', '.join(uris)}")
    return objects, names, md5_files


def _checker(o: ObjectInfo, md5_files: dict[str, ObjectInfo], endpoint_url: Access | str | None) -> _verify.Checker:
    md5 = None
    if o.uri + ".md5" in md5_files:
        u = parse_s3_uri(o.uri + ".md5")
        try:
            body = _transfer.client(endpoint_url).get_object(Bucket=u.bucket, Key=u.key)["Body"].read()
        except Exception as exc:
            raise boto3_error(exc, str(u)) from exc
        md5 = _verify.parse_md5_file(body.decode("utf-8", "replace"), o.key.rsplit("/", 1)[-1])
        if md5 is None:
            log.warning("%s.md5 has no hash for %s; checking the ETag instead", o.uri, o.uri)
    checker = _verify.Checker(o.uri, o.size, o.etag, md5)
    if not checker.can_check:
        log.warning("%s: no .md5 file and an ETag that is not an MD5 (%r): size checked only", o.uri, o.etag)
    return checker


class _Work:
    """``DEST/.s5loader-fetch-TOKEN/``: everything lands here first. :meth:`close` kills
    the transfers still running and removes the directory; it runs at the end, on errors,
    KeyboardInterrupt and SIGTERM."""

    def __init__(self, dest_dir: str) -> None:
        self.path = os.path.join(dest_dir, WORK_PREFIX + secrets.token_hex(4))
        os.makedirs(self.path, mode=0o700)
        self.procs: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()
        self.stopped = False
        self._pid = os.getpid()
        register_cleanup(self)

    def kill(self) -> None:
        """Kill the transfers still running."""
        with self._lock:
            self.stopped = True
            procs, self.procs = list(self.procs), set()
        for proc in procs:
            kill(proc)

    def start(self, fn: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        with self._lock:
            if self.stopped:
                raise FetchError("the fetch was stopped")
            proc = fn()
            self.procs.add(proc)
        return proc

    def close(self) -> None:
        if os.getpid() != self._pid:
            return
        self.kill()
        shutil.rmtree(self.path, ignore_errors=True)


def _poll_progress(progress: ProgressFn | None, done: Callable[[], int], total: int) -> Callable[[], None]:
    """Call ``progress(done(), total)`` every half second in a thread; returns its stop."""
    if progress is None:
        return lambda: None
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.5):
            progress(min(done(), total), total)

    t = threading.Thread(target=loop, daemon=True, name="s5loader-fetch-progress")
    t.start()

    def end() -> None:
        stop.set()
        t.join()

    return end


def _tree_bytes(path: str) -> int:
    n = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                n += os.lstat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                pass
    return n


def _fetch_plain(
    objects: list[ObjectInfo], names: dict[str, str], checkers: dict[str, _verify.Checker | None], s5: S5cmd,
    work: _Work, concurrency: int, part: int, progress: ProgressFn | None, single_file: bool, dest: str,
) -> None:
    files = os.path.join(work.path, "files")
    stop = _poll_progress(progress, lambda: _tree_bytes(files), sum(o.size for o in objects))
    try:
        for o in objects:
            path = os.path.join(files, names[o.uri])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            proc = work.start(lambda o=o, path=path: start_copy(  # type: ignore[misc]
                s5, o.uri, path, concurrency=concurrency, part_size=part, size=o.size))
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


class _Volumes:
    """The volumes, joined, as one file to read once: each is read from its staged file (or
    from ``s5cmd cat`` when larger than the budget), checked at its end and deleted."""

    def __init__(
        self, objects: list[ObjectInfo], checkers: dict[str, _verify.Checker | None], s5: S5cmd, work: _Work,
        budget: int, concurrency: int, part: int,
    ) -> None:
        self.objects, self.checkers, self.s5, self.work = objects, checkers, s5, work
        self.budget, self.concurrency, self.part = budget, concurrency, part
        self.dir = os.path.join(work.path, "volumes")
        os.makedirs(self.dir)
        self.cond = threading.Condition()
        self.ready: dict[int, str] = {}  # index -> staged path ("" = stream it)
        self.reserved = self.peak = self.read_bytes = 0
        self.error: BaseException | None = None
        self.closed_ = False
        self.index = -1
        self.cur: IO[bytes] | None = None
        self.cur_proc: subprocess.Popen[bytes] | None = None
        self.thread = threading.Thread(target=self._download_ahead, daemon=True, name="s5loader-fetch-volumes")
        self.thread.start()

    # --- the downloader thread
    def _download_ahead(self) -> None:
        try:
            for i, o in enumerate(self.objects):
                if o.size > self.budget:
                    with self.cond:
                        self.ready[i] = ""
                        self.cond.notify_all()
                    continue
                with self.cond:
                    while self.reserved and self.reserved + o.size > self.budget and not self.closed_:
                        self.cond.wait()
                    if self.closed_:
                        return
                    self.reserved += o.size
                    self.peak = max(self.peak, self.reserved)
                path = os.path.join(self.dir, f"{i:06d}")
                proc = self.work.start(lambda o=o, path=path: start_copy(  # type: ignore[misc]
                    self.s5, o.uri, path, concurrency=self.concurrency, part_size=self.part, size=o.size))
                _transfer.run(proc, o.uri)
                with self.cond:
                    self.ready[i] = path
                    self.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the reading thread
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    # --- the reading side
    def _next(self) -> bool:
        self._end_current()
        self.index += 1
        if self.index >= len(self.objects):
            return False
        with self.cond:
            while self.index not in self.ready and self.error is None:
                self.cond.wait()
            if self.index not in self.ready:
                assert self.error is not None
                raise self.error
            path = self.ready[self.index]
        o = self.objects[self.index]
        if path:
            self.cur = open(path, "rb")  # noqa: SIM115 - closed in _end_current
        else:
            log.info("%s is larger than the budget: reading it straight from the store", o.uri)
            self.cur_proc = self.work.start(lambda: start_cat(
                self.s5, o.uri, concurrency=self.concurrency, part_size=self.part, size=o.size))
            self.cur = self.cur_proc.stdout
        return True

    def _end_current(self) -> None:
        if self.cur is None:
            return
        o = self.objects[self.index]
        if self.cur_proc is not None:
            proc, self.cur_proc = self.cur_proc, None
            _transfer.run(proc, o.uri)
        else:
            self.cur.close()
            path = self.ready.get(self.index, "")
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            with self.cond:
                self.reserved -= o.size
                self.cond.notify_all()
        self.cur = None
        checker = self.checkers[o.uri]
        if checker is not None:
            checker.check()

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = 1 << 20
        while True:
            if self.cur is None and not self._next():
                return b""
            assert self.cur is not None
            data = self.cur.read(n)
            if data:
                self.read_bytes += len(data)
                checker = self.checkers[self.objects[self.index].uri]
                if checker is not None:
                    checker.update(data)
                return data
            self._end_current()

    def finish(self) -> None:
        """Read whatever the extractor left (tar padding), so every volume is checked."""
        while self.read(1 << 20):
            pass

    def close(self) -> None:
        with self.cond:
            self.closed_ = True
            self.cond.notify_all()
        if self.cur is not None:
            self.cur.close()
            self.cur = None


def _fetch_extract(
    objects: list[ObjectInfo], checkers: dict[str, _verify.Checker | None], s5: S5cmd, work: _Work,
    budget: int, concurrency: int, part: int, result: FetchResult, progress: ProgressFn | None,
) -> None:
    out = os.path.join(work.path, "tree")
    os.makedirs(out)
    volumes = _Volumes(objects, checkers, s5, work, budget, concurrency, part)
    stop = _poll_progress(progress, lambda: volumes.read_bytes, sum(o.size for o in objects))
    try:
        result.members, result.extracted_bytes = _archive.extract_stream(volumes, out, objects[0].uri)
        volumes.finish()
    except BaseException as exc:
        work.kill()  # the downloader thread must not go on
        if isinstance(exc, OSError) and not isinstance(exc, S5LoaderError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StagingSpaceError(f"{objects[0].uri}: the disk of {work.path} filled up") from exc
        raise
    finally:
        stop()
        volumes.close()
        volumes.thread.join()
    result.peak_staged, result.budget = volumes.peak, budget
    _archive.merge_into(out, os.path.dirname(work.path))


def main(argv: list[str]) -> int:
    """``s5loader fetch SOURCE [SOURCE ...] DEST [--verify] [--extract] [--budget SIZE]``."""
    import argparse

    from ._args import positive_int, size_arg

    p = argparse.ArgumentParser(
        prog="s5loader fetch",
        description="Download objects (one, several, a prefix, the volumes of a split archive) with "
        "parallel ranged requests; optionally verify them and extract them as one tar archive.",
    )
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="s3://bucket/key, s3://bucket/prefix/, or a key prefix")
    p.add_argument("dest", metavar="DEST", help="destination directory (or file, for one object)")
    p.add_argument("--verify", action="store_true", help="check each object against KEY.md5, else its ETag")
    p.add_argument("--extract", action="store_true", help="join the objects in order and extract the tar archive")
    p.add_argument("--budget", type=size_arg, default=None, help="with --extract: most bytes of volumes on disk at once (default 1GiB)")
    Access.add_arguments(p)
    p.add_argument("--concurrency", type=positive_int, default=DEFAULT_CONCURRENCY, help="parallel parts per object")
    p.add_argument("--part-size", type=size_arg, default=None, help="bytes per part (default: per object, 5 to 32 MiB)")
    args = p.parse_args(argv)
    logging.getLogger("botocore").setLevel(logging.WARNING)
    bar = Progress(f"fetching into {args.dest}", unit="bytes", final_line=False)  # main() prints the last line
    result = fetch(
        args.sources, args.dest, verify=args.verify, extract=args.extract, budget=args.budget,
        access=Access.from_args(args), concurrency=args.concurrency, part_size=args.part_size, progress=bar,
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
