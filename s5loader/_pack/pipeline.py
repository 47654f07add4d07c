"""Packing shards through a small disk: each shard's objects are downloaded with one
``s5cmd run`` (parallel GETs), written into its tar (each staged file deleted once it is in),
uploaded with ``s5cmd cp`` (a multipart upload for a large shard, aborted if it does not
finish) and marked done. Several shards are under way at once, as many as the disk budget
holds: downloads run ahead while earlier shards upload behind."""

from __future__ import annotations

import functools
import io
import logging
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .._largeobj import transfer as _transfer
from .._largeobj.volumes import FetchWork
from ..config import Access
from ..exceptions import FetchError, ObjectNotFoundError
from ..s5cmd import (
    MIN_PART_SIZE,
    S5cmd,
    classify,
    copy_line,
    error_for,
    error_from_exit,
    finish_batch,
    start_batch,
)
from ..s5cmd import start_copy as _start_copy
from .plan import SHARD_NAME, PlannedSample
from .shard import ShardWriter
from .state import DestState

log = logging.getLogger(__name__)


class Gate:
    """Bytes of local disk the shards under way hold. A shard waits until its bytes fit the
    budget beside the others; alone, it always goes (a shard larger than the budget)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.reserved = self.peak = 0
        self._cond = threading.Condition()

    def acquire(self, n: int, give_up: Callable[[], object]) -> bool:
        """Reserve ``n`` bytes; False if ``give_up()`` turned true while waiting."""
        with self._cond:
            while self.reserved and self.reserved + n > self.budget:
                if give_up():
                    return False
                self._cond.wait(0.2)
            self.reserved += n
            self.peak = max(self.peak, self.reserved)
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self.reserved -= n
            self._cond.notify_all()


@dataclass
class Packer:
    """What every shard of one pack shares."""

    s5: S5cmd
    access: Access
    state: DestState
    work: FetchWork
    missing: str
    numworkers: int
    on_shard: Callable[[int, int], None]  # (samples written, bytes) of a finished shard

    def shard_uri(self, i: int) -> str:
        return self.state.dest + SHARD_NAME.format(i)

    def pack(self, i: int, samples: Sequence[PlannedSample]) -> dict[str, Any]:
        """Download, write, upload and mark shard ``i``; returns its index entry."""
        folder = os.path.join(self.work.path, f"{i:06d}")
        os.makedirs(folder)
        try:
            skipped = self._download(i, samples, folder)
            tar_path = folder + ".tar"
            with ShardWriter(tar_path) as w:
                for j, s in enumerate(samples):
                    for k, m in enumerate(s.members):
                        path = os.path.join(folder, f"{j}.{k}")
                        if j in skipped:
                            _unlink(path)
                        elif m.data is not None:
                            w.add(m.name, s.key, m.size, io.BytesIO(m.data))
                        else:
                            try:
                                w.add_file(m.name, s.key, path)
                            except FileNotFoundError as exc:
                                raise FetchError(f"{m.uri}: s5cmd reported no error, but did not download it") from exc
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        uri = self.shard_uri(i)
        try:
            self._upload(tar_path, uri, w.size)
        finally:
            _unlink(tar_path)
        entry = {"url": SHARD_NAME.format(i), "nsamples": w.nsamples, "filesize": w.size, "md5sum": w.md5,
                 "skipped": sorted(samples[j].key for j in skipped)}
        self.state.mark_done(i, entry)
        self.on_shard(w.nsamples, w.size)
        return entry

    def _download(self, i: int, samples: Sequence[PlannedSample], folder: str) -> set[int]:
        """Stage the shard's objects as ``folder/J.K`` (sample J, member K: no key ever names a
        path); returns the samples left out (objects gone, with ``missing="skip"``)."""
        lines, where = [], {}
        for j, s in enumerate(samples):
            for k, m in enumerate(s.members):
                if m.data is None:
                    path = os.path.join(folder, f"{j}.{k}")
                    lines.append(copy_line(m.uri, path))
                    where[path] = (j, m.uri)
        if not lines:
            return set()
        cmds = os.path.join(folder, ".commands")
        proc = self.work.start(lambda: start_batch(self.s5, lines, cmds))
        out = finish_batch(proc, list(where))
        skipped: set[int] = set()
        for path, error in sorted(out.failed.items()):
            j, uri = where[path]
            kind = classify(error)
            if kind == "not_found" and self.missing == "skip":
                log.warning("%s: gone since it was listed; its sample %r is left out of %s", uri, samples[j].key,
                            self.shard_uri(i))
                skipped.add(j)
            elif kind == "not_found":
                raise ObjectNotFoundError(
                    f"{uri}: listed, but gone before it was downloaded ({error}); run the pack again to pack "
                    "what is there now, or skip such samples (missing='skip', --skip-missing)"
                )
            else:
                raise error_for(kind, f"{uri}: {error}", self.access.endpoint())
        if out.unplaced or (out.returncode != 0 and not out.failed):
            raise error_from_exit(out.returncode, out.stderr, f"the objects of {self.shard_uri(i)}", self.access.endpoint())
        return skipped

    def _upload(self, path: str, uri: str, size: int) -> None:
        def start() -> Any:
            return _start_copy(self.s5, path, uri, concurrency=min(16, self.numworkers), part_size=0, size=size)

        if size <= MIN_PART_SIZE:  # one PUT: nothing to abort if it is cut short
            _transfer.run(self.work.start(start), uri)
            return
        with _transfer.UploadGuard(uri, self.access) as guard:
            proc = self.work.start(start)
            guard.attach(proc)
            _transfer.run(proc, uri)


def _ended_cb(fn: Callable[[Future[dict[str, Any]], int], None], need: int, f: Future[dict[str, Any]]) -> None:
    fn(f, need)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def run_shards(
    packer: Packer, jobs: Sequence[tuple[int, Sequence[PlannedSample], int]], gate: Gate, parallel: int
) -> list[dict[str, Any]]:
    """Pack ``jobs`` (shard number, its samples, the disk it takes), ``parallel`` at once within
    the gate's budget, in order; the first error stops the rest and is raised here."""
    errors: list[BaseException] = []
    futures: list[Future[dict[str, Any]]] = []

    def ended(f: Future[dict[str, Any]], n: int) -> None:
        gate.release(n)
        exc = f.exception()
        if exc is not None:
            errors.append(exc)

    pool = ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="s5loader-pack")
    try:
        for i, samples, need in jobs:
            if errors or not gate.acquire(need, errors.__len__):
                break
            f = pool.submit(packer.pack, i, samples)
            f.add_done_callback(functools.partial(_ended_cb, ended, need))
            futures.append(f)
        for f in futures:
            if errors:
                break
            f.exception()
    except BaseException:
        packer.work.kill()  # the transfers under way end with an error, not later
        raise
    finally:
        if errors:
            packer.work.kill()
        pool.shutdown(wait=True, cancel_futures=True)
    if errors:
        raise errors[0]
    return [f.result() for f in futures]
