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
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

from .._index.blocks import BlockPlan
from .._largeobj import transfer as _transfer
from .._largeobj.volumes import FetchWork
from .._s5cmd import (
    MIN_PART_SIZE,
    S5cmd,
    classify,
    copy_line,
    error_for,
    error_from_exit,
    finish_batch,
    start_batch,
    wildcard_line,
    wildcard_pays,
)
from .._s5cmd import start_copy as _start_copy
from .._util.uri import format_size
from ..config import Access
from ..exceptions import BudgetError, ObjectNotFoundError
from .plan import SHARD_NAME, PlannedSample, check_member
from .resumable import DestState
from .shard import ShardWriter
from .transform import SampleTransform

log = logging.getLogger(__name__)


class Gate:
    """Bytes of local disk the shards under way hold, never more than the budget: a shard
    waits until its bytes fit beside the others'. What could never fit is refused before the
    pack begins (:func:`~s5loader._pack.plan.check_budget`)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.reserved = self.peak = 0
        self._cond = threading.Condition()

    def acquire(self, n: int, give_up: Callable[[], object]) -> bool:
        """Reserve ``n`` bytes; False if ``give_up()`` turned true while waiting.

        Raises:
            BudgetError: ``n`` alone is more than the budget (the callers check first).
        """
        if n > self.budget:
            raise BudgetError(
                f"{format_size(n, exact=True)} of local disk at once, more than the budget of "
                f"{format_size(self.budget, exact=True)}"
            )
        with self._cond:
            while self.reserved + n > self.budget:
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
    """What every shard of one pack shares. ``blocks``: runs of samples (by their number in
    key order) whose objects are exactly those under one key prefix; a shard that holds a
    whole block fetches it with one wildcard line (no HEAD per object, one LIST)."""

    s5: S5cmd
    access: Access
    state: DestState
    work: FetchWork
    missing: str
    numworkers: int
    on_shard: Callable[[int, int], None]  # (samples written, bytes) of a finished shard
    blocks: BlockPlan | None = None
    transform: SampleTransform | None = None

    def shard_uri(self, i: int) -> str:
        return self.state.dest + SHARD_NAME.format(i)

    def build(self, i: int, numbers: Sequence[int], samples: Sequence[PlannedSample]) -> Built:
        """Download shard ``i``'s objects (``samples``, numbered ``numbers`` in key order) and
        write its tar; its staged files are gone when this returns."""
        folder = os.path.join(self.work.path, f"{i:06d}")
        os.makedirs(folder)
        t0 = time.monotonic()
        try:
            paths, skipped = self._download(i, numbers, samples, folder)
            t1 = time.monotonic()
            tar_path = folder + ".tar"
            with ShardWriter(tar_path) as w:
                if self.transform is not None:
                    self._write_transformed(w, i, samples, skipped, paths)
                for j, s in enumerate(samples if self.transform is None else ()):
                    if j in skipped:
                        continue
                    for k, m in enumerate(s.members):
                        if m.data is not None:
                            w.add(m.name, s.key, m.size, io.BytesIO(m.data))
                        else:
                            w.add_file(m.name, s.key, paths[j, k])
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        log.debug(
            "%s: %d samples downloaded in %.2fs, written in %.2fs",
            self.shard_uri(i),
            len(samples),
            t1 - t0,
            time.monotonic() - t1,
        )
        return Built(i, tar_path, w, sorted(samples[j].key for j in skipped))

    def _write_transformed(
        self,
        w: ShardWriter,
        i: int,
        samples: Sequence[PlannedSample],
        skipped: set[int],
        paths: dict[tuple[int, int], str],
    ) -> None:
        """Write shard ``i``'s samples as the transform makes them: each sample's staged files are
        read into memory and deleted, the transform's fields written in the plan's order."""
        assert self.transform is not None

        def inputs() -> Iterator[tuple[str, dict[str, Any]]]:
            for j, s in enumerate(samples):
                if j in skipped:
                    continue
                sample: dict[str, Any] = {"__key__": s.key}
                for k, m in enumerate(s.members):
                    if m.data is not None:
                        sample[m.name[len(s.key) + 1 :]] = m.data
                        continue
                    with open(paths[j, k], "rb") as f:
                        sample[m.name[len(s.key) + 1 :]] = f.read()
                    os.unlink(paths[j, k])
                yield s.key, sample

        for key, fields in self.transform.run(inputs()):
            for field, data in fields:
                w.add(check_member(key, field, self.shard_uri(i)), key, len(data), io.BytesIO(data))

    def ship(self, built: Built) -> dict[str, Any]:
        """Upload a built shard under its final name, delete it, mark it done; its index entry."""
        uri, w, t0 = self.shard_uri(built.shard), built.writer, time.monotonic()
        try:
            self.upload(built.path, uri, w.size)
        finally:
            _unlink(built.path)
        log.debug("%s: uploaded in %.2fs", uri, time.monotonic() - t0)
        entry = {
            "url": SHARD_NAME.format(built.shard),
            "nsamples": w.nsamples,
            "filesize": w.size,
            "md5sum": w.md5,
            "skipped": built.skipped,
        }
        self.state.mark_done(built.shard, entry)
        self.on_shard(w.nsamples, w.size)
        return entry

    def _lines(
        self, numbers: Sequence[int], samples: Sequence[PlannedSample], folder: str
    ) -> tuple[list[str], dict[str, str], dict[tuple[int, int], tuple[str, str]]]:
        """The command lines, their destinations (for failures: path -> URI), and where each
        object lands: ``(sample, member) -> (path, URI)``. Paths are ``folder/J.K`` (sample J,
        member K), or for a whole block ``folder/bN/`` (for a sample of several objects that are
        exactly those under its own key prefix, ``folder/sJ/``) and the key below the block's
        folder (keys :mod:`~s5loader._index.blocks` checked to be plain names). A wildcard line
        is written only where it costs no more S3 requests than a line per object
        (:func:`~s5loader._s5cmd.wildcard_pays`)."""
        plan = self.blocks
        held: dict[int, int] = {}
        if plan is not None and plan.blocks:
            for n in numbers:
                if plan.block_of[n] >= 0:
                    held[plan.block_of[n]] = held.get(plan.block_of[n], 0) + 1
        whole = {
            b
            for b, count in held.items()
            if plan is not None and count == len(plan.blocks[b]) and wildcard_pays(plan.blocks[b].objects)
        }
        lines: list[str] = []
        dests: dict[str, str] = {}
        where: dict[tuple[int, int], tuple[str, str]] = {}
        for j, (n, s) in enumerate(zip(numbers, samples, strict=True)):
            b = plan.block_of[n] if plan is not None and plan.blocks else -1
            block, scratch = None, ""
            if b in whole and plan is not None:
                block, scratch = plan.blocks[b], os.path.join(folder, f"b{b}")
            elif (
                plan is not None
                and plan.single is not None
                and (own := plan.single[n]) is not None
                and wildcard_pays(own.objects)
            ):
                block, scratch = own, os.path.join(folder, f"s{j}")  # its objects, one line
            if block is not None:
                if scratch + "/" not in dests:
                    lines.append(wildcard_line(block.wildcard, scratch + "/"))
                    dests[scratch + "/"] = block.wildcard
                for k, rel in enumerate(block.rels[n - block.start]):
                    where[j, k] = (os.path.join(scratch, rel), s.members[k].uri)
                continue
            for k, m in enumerate(s.members):
                if m.data is None:
                    path = os.path.join(folder, f"{j}.{k}")
                    lines.append(copy_line(m.uri, path))
                    dests[path] = m.uri
                    where[j, k] = (path, m.uri)
        return lines, dests, where

    def _download(
        self, i: int, numbers: Sequence[int], samples: Sequence[PlannedSample], folder: str
    ) -> tuple[dict[tuple[int, int], str], set[int]]:
        """Stage the shard's objects with one ``s5cmd run``; returns where each landed and the
        samples left out (objects gone, with ``missing="skip"``)."""
        lines, dests, where = self._lines(numbers, samples, folder)
        if lines:
            cmds = os.path.join(folder, ".commands")
            proc = self.work.start(lambda: start_batch(self.s5, lines, cmds))
            out = finish_batch(proc, list(dests))
            for dest, error in [*out.failed.items(), *(("", e) for e in out.unplaced)]:
                kind = classify(error)
                if kind != "not_found":  # a missing object is found below, by its file
                    what = dests.get(dest) or f"the objects of {self.shard_uri(i)}"
                    raise error_for(kind, f"{what}: {error}", self.access.endpoint())
            if out.returncode != 0 and not out.failed and not out.unplaced:
                raise error_from_exit(
                    out.returncode, out.stderr, f"the objects of {self.shard_uri(i)}", self.access.endpoint()
                )
        skipped: set[int] = set()
        for (j, _), (path, uri) in sorted(where.items()):
            if j in skipped or os.path.exists(path):
                continue
            if self.missing != "skip":
                raise ObjectNotFoundError(
                    f"{uri}: listed, but gone before it was downloaded; run the pack again to pack what is "
                    "there now, or skip such samples (missing='skip', --skip-missing)"
                )
            log.warning(
                "%s: gone since it was listed; its sample %r is left out of %s",
                uri,
                samples[j].key,
                self.shard_uri(i),
            )
            skipped.add(j)
        return {jk: path for jk, (path, _) in where.items()}, skipped

    def upload(self, path: str, uri: str, size: int) -> None:
        """Upload the shard at ``path`` to ``uri`` (a multipart upload for a large one, aborted if
        it does not finish)."""

        def start() -> Any:
            return _start_copy(
                self.s5, path, uri, concurrency=min(16, self.numworkers), part_size=0, size=size
            )

        if size <= MIN_PART_SIZE:  # one PUT: nothing to abort if it is cut short
            _transfer.run(self.work.start(start), uri)
            return
        with _transfer.UploadGuard(uri, self.access) as guard:
            proc = self.work.start(start)
            guard.attach(proc)
            _transfer.run(proc, uri)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Built(NamedTuple):
    """A shard written and waiting for its upload."""

    shard: int
    path: str
    writer: ShardWriter
    skipped: list[str]


Job = tuple[int, Sequence[int], Sequence[PlannedSample], int]  # shard, sample numbers, samples, disk


def run_shards(packer: Packer, jobs: Sequence[Job], gate: Gate, parallel: int) -> list[dict[str, Any]]:
    """Pack ``jobs`` (shard number, its samples' numbers and plans, the disk it takes) in order,
    within the gate's budget: ``parallel`` shards download and are written at once, and as
    many upload behind them. A shard reserves its disk only when a build slot is free (a shard
    waiting for its turn holds nothing), keeps only its tar's once it is written, and releases
    that once it is uploaded, so the gate's peak is the disk the shards under way can take. The
    first error stops the rest and is raised here."""
    errors: list[BaseException] = []
    slots = threading.BoundedSemaphore(max(1, parallel))  # shards being downloaded and written
    builds: list[Future[Built]] = []
    uploads: list[Future[dict[str, Any]]] = []
    lock = threading.Lock()

    def failed(f: Future[Any]) -> bool:
        if f.cancelled():  # stopped before it began: by the first error, or Ctrl-C
            return True
        exc = f.exception()
        if exc is not None:
            with lock:
                errors.append(exc)
            packer.work.kill()  # the other shards' transfers stop now; the first error is raised
        return exc is not None

    def uploaded(tar: int, f: Future[dict[str, Any]]) -> None:
        gate.release(tar)
        failed(f)

    def built(need: int, f: Future[Built]) -> None:
        slots.release()
        if failed(f):
            gate.release(need)
            return
        tar = min(need, f.result().writer.size)  # the objects are gone; the tar waits for its upload
        gate.release(need - tar)
        up = up_pool.submit(packer.ship, f.result())
        with lock:
            uploads.append(up)
        up.add_done_callback(functools.partial(uploaded, tar))

    def take_slot() -> bool:
        while not slots.acquire(timeout=0.2):
            if errors:
                return False
        return True

    down_pool = ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="s5loader-pack-down")
    up_pool = ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="s5loader-pack-up")
    try:
        for i, numbers, samples, need in jobs:
            if errors or not take_slot():
                break
            if not gate.acquire(need, errors.__len__):
                slots.release()
                break
            f = down_pool.submit(packer.build, i, numbers, samples)
            f.add_done_callback(functools.partial(built, need))
            builds.append(f)
        for f in builds:
            f.exception()
        down_pool.shutdown(wait=True)  # every upload is submitted
        for u in list(uploads):
            u.exception()
    except BaseException:
        packer.work.kill()  # the transfers under way end with an error, not later
        raise
    finally:
        down_pool.shutdown(wait=True, cancel_futures=True)
        up_pool.shutdown(wait=True, cancel_futures=True)
    if errors:
        raise errors[0]
    return sorted((u.result() for u in uploads), key=lambda e: str(e["url"]))
