"""Packing a split archive (``data.tar.gz.000``, ``.001``, ... with their ``.md5`` files) into
shards without storing it whole: the volumes are downloaded ahead and checked as ``s5loader
fetch --verify --extract`` does, and the archive's members stream, one after another, into
the shard being written. A sample is a run of consecutive members sharing a key (the
WebDataset convention: ``dir/0001.jpg``, ``dir/0001.cls``); a shard is cut before the sample
that would take it past the shard size. Folders are left out; a file without an extension,
which no WebDataset reader can read as a field, is left out with a warning that names it.

A rerun reads the archive again and writes only the shards that are not done (the others
are measured, not written, so each shard is cut at the same member)."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tarfile
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .._largeobj import verify as _verify
from .._largeobj.archive import is_zstd
from .._largeobj.fetch_sources import checker_for, resolve
from .._largeobj.volumes import FetchWork, Volumes
from .._s5cmd import S5cmd
from .._shards.tar import split_name
from .._util.uri import format_size
from ..exceptions import BudgetError, ConfigError, FetchError
from .pipeline import Gate, Packer
from .plan import BLOCK, RECORD, SHARD_NAME, VERSION, check_member, member_bytes
from .shard import ShardWriter

log = logging.getLogger(__name__)


def volumes_of(
    uris: list[str], s5: S5cmd, verify: bool
) -> tuple[list[Any], dict[str, _verify.Checker | None]]:
    """The archive's volumes in natural key order, and a checker for each (``.md5`` file,
    else ETag) when ``verify``."""
    objects, _, md5_files = resolve(uris, s5, s5.settings, skip_md5=True, verify=verify)
    checkers = {o.uri: checker_for(o, md5_files, s5.settings) if verify else None for o in objects}
    return objects, checkers


def fingerprint(
    objects: list[Any], checkers: dict[str, _verify.Checker | None], content: dict[str, Any]
) -> str:
    """An archive pack's identity: its volumes (URI, size, and the MD5 their ``.md5`` files
    give, else the ETag) and the options. A volume replaced by one that matches its ``.md5``
    file leaves the pack the same, so a rerun finishes it."""
    ids = []
    for o in objects:
        c = checkers.get(o.uri)
        ids.append((o.uri, o.size, c.expected if c is not None and c.source.endswith(".md5") else o.etag))
    text = json.dumps([VERSION, content, ids])
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class ArchivePacker:
    """Streams the members of one archive into shards ``0, 1, ...``; ``done`` are skipped."""

    def __init__(self, packer: Packer, shard_size: int, gate: Gate, done: set[int], archive: str) -> None:
        self.packer, self.shard_size, self.gate, self.done = packer, shard_size, gate, done
        self.archive = archive
        self.entries: dict[int, dict[str, Any]] = {}
        self.skipped: list[str] = []
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="s5loader-pack-upload")
        self._uploads: list[Future[None]] = []
        self._errors: list[BaseException] = []
        # uploaded shards waiting for the volumes they came from to be checked: (volume, shard, entry)
        self._unmarked: list[tuple[int, int, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._stream: Any = None
        self._held = 0  # the gate's bytes that the shard being written holds

    def run(self, stream: Any) -> int:
        """Read the archive from ``stream``; returns the number of shards."""
        mode = "r|*"
        if is_zstd(self.archive):
            raise ConfigError(
                f"{self.archive}: a zstandard archive; pack reads .tar, .tar.gz, .tar.bz2 and .tar.xz"
            )
        self._stream = stream
        shard = 0
        writer = self._open(shard)
        key: str | None = None
        try:
            with tarfile.open(fileobj=stream, mode=mode) as src:  # type: ignore[call-overload]
                for member in src:
                    if member.isdir():
                        continue
                    parts = split_name(member.name) if member.isreg() else None
                    if parts is None:
                        self.skipped.append(member.name)
                        log.warning(
                            "%s: member %r left out (%s)",
                            self.archive,
                            member.name,
                            "not a regular file" if not member.isreg() else "no extension: no field name",
                        )
                        continue
                    k, field = parts
                    check_member(k, member.name[len(k) + 1 :], f"{self.archive}: member {member.name!r}")
                    if (
                        k != key
                        and writer.nsamples
                        and writer.offset + member.size + 3 * 512 > self.shard_size
                    ):
                        self._finish(shard, writer)
                        shard += 1
                        writer = self._open(shard)
                    key = k
                    self._room(shard, writer, member)
                    writer.add(member.name, k, member.size, src.extractfile(member))
                    self.mark(final=False)
        except (tarfile.TarError, EOFError, zlib.error) as exc:
            writer.abandon()
            raise FetchError(
                f"{self.archive}: not a readable tar archive ({type(exc).__name__}: {exc})"
            ) from exc
        except BaseException:
            writer.abandon()
            raise
        if writer.nsamples or shard == 0:
            self._finish(shard, writer)
            shard += 1
        else:
            writer.abandon()
        return shard

    def _open(self, shard: int) -> ShardWriter:
        if self._errors:
            raise self._errors[0]
        self._held = 0
        if shard in self.done:
            return ShardWriter(None)  # measured only: it is already in DEST
        if not self.gate.acquire(self.shard_size, lambda: bool(self._errors)):
            raise self._errors[0]
        self._held = self.shard_size
        return ShardWriter(os.path.join(self.packer.work.path, f"{shard:06d}.tar"))

    def _room(self, shard: int, writer: ShardWriter, member: tarfile.TarInfo) -> None:
        """Hold more of the gate when ``member`` takes the shard past what it holds (a sample
        larger than the shard size, or the last members of one that began near its end).

        Raises:
            BudgetError: the shard would take more than the gate's whole share of the budget;
                names the member, both sizes and the budget to pass.
        """
        if writer.path is None:
            return
        need = -(-(writer.offset + member_bytes(member.name, member.size) + 2 * BLOCK) // RECORD) * RECORD
        if need <= self._held:
            return
        if need > self.gate.budget:
            raise BudgetError(
                f"{self.archive}: its member {member.name!r} ({format_size(member.size)}) makes "
                f"{self.packer.shard_uri(shard)} take {format_size(need, exact=True)} of local disk, more "
                f"than the {format_size(self.gate.budget)} that half the budget holds for shards; a sample "
                f"is never split: pass a budget of at least {format_size(2 * need, exact=True)}"
            )
        if not self.gate.acquire(need - self._held, lambda: bool(self._errors)):
            raise self._errors[0]
        self._held = need

    def _finish(self, shard: int, writer: ShardWriter) -> None:
        writer.close()
        if writer.path is None:
            return
        self.gate.release(self._held - writer.size)  # what it holds now: its tar
        self._held = 0
        path = writer.path
        volume = int(getattr(self._stream, "index", 0))  # its last bytes came from this volume, or earlier
        f = self._pool.submit(self._upload, shard, path, writer, volume)
        f.add_done_callback(functools.partial(self._ended, writer.size))
        self._uploads.append(f)

    def _ended(self, held: int, f: Future[None]) -> None:
        self.gate.release(held)
        if f.cancelled():  # dropped before it began (an error, or Ctrl-C, stops the pack)
            return
        exc = f.exception()
        if exc is not None:
            self._errors.append(exc)

    def _upload(self, shard: int, path: str, writer: ShardWriter, volume: int) -> None:
        uri = self.packer.shard_uri(shard)
        try:
            self.packer.upload(path, uri, writer.size)
        finally:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        entry = {
            "url": SHARD_NAME.format(shard),
            "nsamples": writer.nsamples,
            "filesize": writer.size,
            "md5sum": writer.md5,
            "skipped": [],
        }
        with self._lock:
            self._unmarked.append((volume, shard, entry))

    def mark(self, final: bool) -> None:
        """Mark done the uploaded shards whose volumes are all checked (``final``: every volume
        is). A shard is uploaded as soon as it is written, but marked done only then: a volume
        that fails its check leaves no shard of its bytes marked, so a rerun makes them again."""
        checked = int(getattr(self._stream, "index", 0))  # volumes before this one are checked
        with self._lock:
            ready = [u for u in self._unmarked if final or u[0] < checked]
            self._unmarked = [u for u in self._unmarked if u not in ready]
        for _, shard, entry in ready:
            self.packer.state.mark_done(shard, entry)
            self.packer.on_shard(int(entry["nsamples"]), int(entry["filesize"]))

    def close(self, wait: bool = True) -> None:
        """Wait for the uploads under way (raise the first error), or drop them."""
        try:
            if wait:
                for f in self._uploads:
                    f.exception()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=not wait)
        if wait and self._errors:
            raise self._errors[0]


def pack_archive(
    objects: list[Any],
    checkers: dict[str, _verify.Checker | None],
    packer: Packer,
    shard_size: int,
    budget: int,
    done: set[int],
    concurrency: int,
) -> tuple[int, int]:
    """Pack the split archive whose volumes (:func:`volumes_of`) are ``objects`` into shards;
    returns how many shards it makes, and the most bytes of local disk it held at once.

    Half the budget holds volumes ahead of the reader (a larger volume is streamed, not
    staged), half the shards behind it: each holds the shard size, or more while a sample
    larger than that is written into it.

    Raises:
        ChecksumError: a volume does not match its ``.md5`` file or ETag; names it.
        BudgetError: a sample that half the budget cannot hold in a shard; names its member.
        UnsafeArchiveError: a member name with ``..``, an absolute path, or one a reader
            would not split back into its key and field.
        FetchError: not a readable tar archive.
    """
    work: FetchWork = packer.work
    volumes = Volumes(objects, checkers, packer.s5, work, max(1, budget // 2), concurrency, 0)
    archive = ArchivePacker(packer, shard_size, Gate(max(1, budget - budget // 2)), done, objects[0].uri)
    try:
        nshards = archive.run(volumes)
        volumes.finish()  # every volume read to its end and checked
    except BaseException:
        work.kill()
        archive.close(wait=False)
        raise
    finally:
        volumes.close()
        volumes.thread.join()
    archive.close(wait=True)
    archive.mark(final=True)  # every volume was read to its end and checked
    if archive.skipped:
        log.warning(
            "%s: %d member(s) left out, such as %r", objects[0].uri, len(archive.skipped), archive.skipped[0]
        )
    return nshards, volumes.peak + archive.gate.peak
