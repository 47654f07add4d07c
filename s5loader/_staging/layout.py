"""The contract between the staging engine and the readers of one staging pass.

Both sides use :class:`StagingLayout`: the engine to know where to put sample ``i``'s files,
the reader (:class:`~s5loader.S5Dataset`, in a DataLoader worker) to find them and to hand the
sample back once read. A pass folder looks like this::

    PASS/<index>/<field>     the staged files of one sample (names from :func:`field_names`)
    PASS/.released           a FIFO: each reader writes "<index>\\n" after deleting a sample
    PASS/.calls/, PASS/.c*/  the engine's command files and scratch folders
    PASS/.h/<index>/         a read sample handed back for the epoch cache
                             (see :meth:`StagingLayout.hand_back`)
    PASS/.w                  a Unix socket: the sampler's words on the samples it handed out
                             before they were staged (see :mod:`.words`)

A pass over tar shards stages each shard as the engine's unit: ``PASS/<shard>/tar`` is the
shard, ``PASS/<shard>/.members`` its member table (written once the shard is checked; for
the first shard of a pass, read while it downloads, rewritten longer as its samples land), and
``PASS/<shard>/.need/<j>`` one empty file per sample ``j`` of the shard that this pass still
has to read. A reader deletes its sample's file after reading; whoever then removes the empty
``.need`` folder (``rmdir`` succeeds for exactly one process) deletes the shard and writes
the shard's index to ``.released``, so a shard is freed once every sample of it that the pass
needs was read, by any worker. Every other reader punches what its read made whole out of the
shard (``fallocate``'s hole punching; which blocks: :mod:`.holes`) and writes
``"<shard> <bytes freed>\n"``, so a shard's bytes come back as its samples are read.

Releasing deletes the sample's files and then writes its index to ``.released``, which the
engine reads in its select loop (:class:`ReleaseEvents`), so budget comes back as soon as a
sample is read, without the engine polling ``stat`` on what it handed out. A write of a
short line to a FIFO is atomic (below ``PIPE_BUF``); a writer never blocks (``O_NONBLOCK``):
when no engine reads (the pass was closed) or the pipe is full, the event is dropped and the
folder that vanished still tells the engine, which checks for that slowly while its budget is
full. Consumers that only delete folders (the prefetch daemon's) keep working that way.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .holes import SampleSpans, give_back, shard_lock

if TYPE_CHECKING:
    from .._index.sample import Field, Sample

RELEASED = ".released"
HANDED_BACK = ".h"
MEMBERS = ".members"
NEED = ".need"


def file_problem(path: str, f: Field, md5: bool = True) -> str:
    """Why a staged file does not match its listing, or '' when it does: its size, and with
    ``md5`` its MD5 against a single-part ETag (the check of ``verify=True``)."""
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        return f"staged file missing: {exc.strerror}"
    if size != f.size:
        return f"size mismatch: listed {f.size} bytes, staged {size} (truncated transfer)"
    etag = f.etag
    if md5 and etag and "-" not in etag and len(etag) == 32:
        h = hashlib.md5(usedforsecurity=False)
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != etag.lower():
            return f"MD5 mismatch: ETag {etag}, staged file {h.hexdigest()}"
    return ""


def field_names(sample: Sample) -> list[str]:
    """File names of a sample's fields inside its staging folder.

    Field names that are plain relative paths are kept (``image``, ``video.mp4``,
    ``sub/x.txt``); if any is not (``..``, absolute, NUL, a component over 255 bytes), every
    field of the sample is named by its position instead. Names never come from anything a
    key can use to leave the sample's folder.
    """
    names = [f.name for f in sample.fields]
    for n in names:
        parts = n.split("/")
        if any(
            not p
            or p in (".", "..")
            or "\x00" in p
            or len(p.encode("utf-8", "surrogatepass")) > 255
            or p.startswith(".")
            for p in parts
        ):
            return [f"_{j}" for j in range(len(names))]
    lowered = {n.lower() for n in names}  # keep distinct on case-insensitive file systems too
    if len(lowered) != len(names):
        return [f"_{j}" for j in range(len(names))]
    return names


class StagingLayout:
    """Where one staging pass keeps its samples, and how a reader releases one.

    Cheap to make from the pass folder alone (a worker makes one from the folder a
    :class:`~s5loader.dataset.StagedIndex` carries) and picklable.
    """

    __slots__ = ("folder",)

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __reduce__(self) -> tuple[type[StagingLayout], tuple[str]]:
        return (StagingLayout, (self.folder,))

    def __repr__(self) -> str:
        return f"StagingLayout({self.folder!r})"

    @property
    def releases(self) -> str:
        """The FIFO readers announce releases on."""
        return f"{self.folder}/{RELEASED}"

    def sample_dir(self, index: int) -> str:
        return f"{self.folder}/{int(index)}"

    def paths(self, index: int, sample: Sample) -> list[str]:
        """The staged file of each field of ``sample``, in field order."""
        folder = self.sample_dir(index)
        return [f"{folder}/{name}" for name in field_names(sample)]

    def path(self, index: int, sample: Sample, field: int) -> str:
        """The staged file of field number ``field`` of ``sample``."""
        return self.paths(index, sample)[field]

    def release(self, index: int, paths: Sequence[str]) -> None:
        """Delete sample ``index``'s staged files (``paths``, from :meth:`paths`), then tell
        the engine its bytes are free."""
        folder = self.sample_dir(index)
        if any("/" in p[len(folder) + 1 :] for p in paths):  # fields in sub-folders
            shutil.rmtree(folder, ignore_errors=True)
        else:
            for p in paths:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            try:
                os.rmdir(folder)
            except OSError:
                shutil.rmtree(folder, ignore_errors=True)
        self.notify(index)

    def handed_back(self, index: int) -> str:
        """Where :meth:`hand_back` puts sample ``index``'s folder."""
        return f"{self.folder}/{HANDED_BACK}/{int(index)}"

    def hand_back(self, index: int, paths: Sequence[str]) -> None:
        """Like :meth:`release`, but the read sample's folder is renamed to
        :meth:`handed_back` instead of deleted: the engine keeps it in its epoch cache or
        deletes it when it reads the announcement. If the rename fails the sample is deleted."""
        if self._move_back(index):
            self.notify(index)
        else:
            self.release(index, paths)

    # -- tar shards -------------------------------------------------------------------------
    def shard_table(self, shard: int) -> str:
        """The member table of a staged shard."""
        return f"{self.sample_dir(shard)}/{MEMBERS}"

    def open_shard(self, shard: int, table: bytes, needed: Sequence[int]) -> None:
        """Write a staged shard's member table and one claim per sample of it the pass needs
        (``needed``: positions in the shard); with no claims the shard is kept."""
        self.write_shard_table(shard, table)
        self.claim_shard(shard, needed)

    def write_shard_table(self, shard: int, table: bytes) -> None:
        """Write (or replace, whole) a shard's member table. A shard read while it downloads
        gets a longer table as its samples come in; readers look again for a sample past the
        end of the table they have."""
        tmp = f"{self.sample_dir(shard)}/{MEMBERS}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(table)
        os.replace(tmp, self.shard_table(shard))

    def claim_shard(self, shard: int, needed: Sequence[int]) -> None:
        """One claim per sample of ``shard`` the pass needs; with none the shard is kept."""
        if needed:
            need = f"{self.sample_dir(shard)}/{NEED}"
            shutil.rmtree(need, ignore_errors=True)  # the claims of an earlier pass (an epoch cache entry)
            os.mkdir(need)
            for j in needed:
                os.close(os.open(f"{need}/{int(j)}", os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600))

    def release_shard_sample(
        self, shard: int, j: int, fd: int = -1, spans: SampleSpans | None = None, back: bool = False
    ) -> bool:
        """Sample ``j`` of ``shard`` was read: drop its claim; the reader that drops the last
        deletes the shard (``back``: hands it back whole for the epoch cache, see
        :meth:`hand_back_shard`) and tells the engine. True for that reader.

        Any other reader given the shard open for writing as ``fd`` and its samples' ``spans``
        punches out what its read made whole (:func:`~s5loader._staging.holes.give_back`) and
        tells the engine the bytes (see :meth:`notify`), dropping its claim and looking at its
        neighbours' under the shard's lock (``flock`` on ``fd``), so each block counts once. A
        shard handed ``back`` is not punched (``fd`` may be open for reading only): the bytes
        are told all the same, as the epoch cache counts them from then on."""
        need = f"{self.sample_dir(shard)}/{NEED}"
        with shard_lock(fd if spans is not None else -1):
            try:
                os.unlink(f"{need}/{int(j)}")
            except FileNotFoundError:
                return False
            try:
                os.rmdir(need)
            except OSError:  # ENOTEMPTY: other samples are still to be read; ENOENT: another reader won
                freed = give_back(fd, spans, j, need, punch=not back) if spans is not None and fd >= 0 else 0
                if freed:
                    self.notify(shard, freed)
                return False
        if back:
            self.hand_back_shard(shard)
        else:
            self.drop_shard(shard)
        return True

    def hand_back_shard(self, shard: int) -> None:
        """Rename a staged shard's folder (read, its claims gone) to :meth:`handed_back` and tell
        the engine, which keeps it in its epoch cache or deletes it; if the rename fails the shard
        is deleted."""
        if self._move_back(shard):
            self.notify(shard)
        else:
            self.drop_shard(shard)

    def drop_shard(self, shard: int) -> None:
        """Delete a staged shard and tell the engine its bytes are free."""
        shutil.rmtree(self.sample_dir(shard), ignore_errors=True)
        self.notify(shard)

    def _move_back(self, index: int) -> bool:
        """Rename the folder of ``index`` to its :meth:`handed_back` place (making the hand-back
        folder once if it is missing); False when the folder is gone or the rename fails."""
        src, dest = self.sample_dir(index), self.handed_back(index)
        for _ in range(2):
            try:
                os.rename(src, dest)
                return True
            except FileNotFoundError:
                if not os.path.isdir(src):
                    return False
                os.makedirs(os.path.dirname(dest), exist_ok=True)
            except OSError:
                return False
        return False

    def notify(self, index: int, freed: int = 0) -> None:
        """Write ``index`` (released) or ``index freed`` (``freed`` bytes of it given back,
        the rest still held) to the pass's FIFO; dropped when nobody reads it or it is full."""
        try:
            fd = os.open(self.releases, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return  # ENXIO: no engine reads (the pass ended); ENOENT: no FIFO (a kept pass)
        try:
            os.write(fd, b"%d %d\n" % (int(index), int(freed)) if freed else b"%d\n" % int(index))
        except OSError:
            pass  # EAGAIN (full) or EPIPE: the vanished folder still tells the engine
        finally:
            os.close(fd)
