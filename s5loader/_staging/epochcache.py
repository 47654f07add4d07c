"""The epoch cache on disk: samples kept staged after they were read, for a later epoch.

One folder per node and job below the staging root, shared by the local ranks that stage there::

    ROOT/s5loader-cache-<ID>/<index>/<field>   a cached sample, the files of its staged folder
    ROOT/s5loader-cache-<ID>/.manifest.json    the fingerprint of the index the entries belong to
    ROOT/s5loader-cache-<ID>/.users/<pid>-<n>  one lock file per live sampler using the cache

Entries only ever arrive and leave by ``rename`` (a sample folder read in a pass, handed back
by its reader, is renamed into the cache; a hit is renamed back into the next pass's folder),
so an entry is always a whole sample. An entry is named by its index only; the manifest ties
every entry to one index (keys, URIs, sizes, ETags, see :func:`index_fingerprint`), and a
folder whose manifest names another is emptied before use, so a different data set or a
changed object never reads as a hit. A hit is checked like a staged file (sizes; the MD5 ETag
with ``verify``) before it is used.

The folder outlives a crash (a restarted run on the same staging root finds it), and is
removed by the last sampler that closes it, unless it is to be kept. A cache folder that no
live process uses and nobody meant to keep (a killed run's, whose job then changed its seed or
data) is removed when another cache is opened below the same root.

Opening a cache (creating its folder, checking its manifest, removing stale caches, taking the
user lock) and leaving it (the last user removing the folder) happen under an exclusive
``flock`` on the staging root itself (:func:`node_lock`), which every process of the node that
stages there takes, whatever launched it: no opener meets a folder half made or removed under
it, and no sweep takes a cache whose opener has not locked its user file yet for a dead one's.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .._index.sample import Sample
from .layout import field_names, file_problem

log = logging.getLogger(__name__)

CACHE_PREFIX = "s5loader-cache-"
MANIFEST = ".manifest.json"
USERS = ".users"
KEPT = ".kept"  # written by a user that leaves the folder behind on purpose
_VERSION = 1
_seq = itertools.count()


def index_fingerprint(samples: Sequence[Sample]) -> str:
    """A digest of the sample index (keys, fields, URIs, sizes, ETags)."""
    h = hashlib.sha256()
    for s in samples:
        for f in s.fields:
            h.update(f"{s.key}\0{f.name}\0{f.uri}\0{f.size}\0{f.etag}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def entry_problem(folder: str, sample: Sample, md5: bool) -> str:
    """Why the files in ``folder`` are not sample ``sample``'s, or '' when they are: each field's
    file must have its listed size and (``md5``) its single-part MD5 ETag."""
    for f, name in zip(sample.fields, field_names(sample), strict=True):
        path = f"{folder}/{name}"
        problem = file_problem(path, f, md5)
        if problem:
            return f"{path}: {problem}"
    return ""


class EpochCache:
    """The cache folder ``ROOT/s5loader-cache-<cache_id>`` of :mod:`this module <.epochcache>`.

    Args:
        root: the staging root (the cache must be on the file system of the staging passes:
            samples move by rename).
        cache_id: names the folder: one per index, job settings and node.
        fingerprint: :func:`index_fingerprint` of the index the entries belong to.
        keep: leave the folder behind on :meth:`close`.
    """

    def __init__(self, root: str, cache_id: str, fingerprint: str, keep: bool = False) -> None:
        self.root, self.cache_id = root, cache_id
        self.path = os.path.join(root, f"{CACHE_PREFIX}{cache_id}")
        self.fingerprint = fingerprint
        self.keep = keep
        self.sharing = False  # a sharer's: it neither removes the folder nor marks it kept
        self._user: str | None = None
        self._fd: int | None = None
        self._owner = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": None, "_user": None}

    def sharer(self) -> EpochCache:
        """Another user of the same folder that never removes it (a DataLoader worker's, while
        the process that made this one owns the folder's lifetime)."""
        other = EpochCache(self.root, self.cache_id, self.fingerprint, keep=True)
        other.sharing = True
        return other

    def entry(self, index: int) -> str:
        return f"{self.path}/{int(index)}"

    def open(self) -> None:
        """Create the folder (or take it over), check its manifest, register this process as
        a user, under the node's lock (see the module docstring). A manifest of another index
        empties the folder first. Idempotent."""
        if self._fd is not None and os.path.isdir(self.path):
            return
        with node_lock(self.root):
            self._open()

    def _open(self) -> None:
        os.makedirs(os.path.join(self.path, USERS), mode=0o700, exist_ok=True)
        man = os.path.join(self.path, MANIFEST)
        want = {"version": _VERSION, "fingerprint": self.fingerprint}
        try:
            with open(man, encoding="utf-8") as fh:
                found = json.load(fh)
        except (OSError, ValueError):
            found = None
        if found != want:
            if found is not None:
                log.info("epoch cache %s belongs to another index; emptying it", self.path)
            for name in self.names():
                shutil.rmtree(self.entry(name), ignore_errors=True)
            tmp = f"{man}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(want, fh)
            os.replace(tmp, man)
        clean_stale_caches(self.root, self.path)
        if not self.keep:  # kept for this run: from now on, this run decides
            try:
                os.unlink(os.path.join(self.path, KEPT))
            except FileNotFoundError:
                pass
        user = os.path.join(self.path, USERS, f"{os.getpid()}-{next(_seq)}")
        fd = os.open(user, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._fd, self._user = fd, user

    def names(self) -> list[int]:
        """The indices of the entries now in the cache."""
        try:
            return [int(n) for n in os.listdir(self.path) if n.isdigit()]
        except FileNotFoundError:
            return []

    def take(self, index: int, dest: str, sample: Sample, md5: bool, stray: str | None = None) -> bool:
        """Move entry ``index`` (or the ``stray`` folder: a sample another local rank handed
        back after its engine stopped, not yet admitted) to ``dest``, a staged sample's folder;
        False when there is none or it does not check out (then it is removed)."""
        for src in (self.entry(index), stray):
            if src is None:
                return False
            try:
                os.rename(src, dest)
                break
            except OSError:
                continue
        problem = entry_problem(dest, sample, md5)
        if problem:
            log.warning("epoch cache entry of %s dropped: %s", sample.key, problem)
            shutil.rmtree(dest, ignore_errors=True)
            return False
        return True

    def admit(self, folder: str, index: int, missing_ok: bool = False) -> bool:
        """Rename a read sample's ``folder`` into the cache as entry ``index`` (a folder that
        cannot be is deleted); whether it is there now. ``missing_ok``: no folder is no error."""
        try:
            os.rename(folder, self.entry(index))
        except FileNotFoundError:
            if not missing_ok:
                log.debug("epoch cache: %s vanished before it was admitted", folder)
            return False
        except OSError as exc:
            log.debug("epoch cache: cannot admit %s: %s", folder, exc.strerror)
            shutil.rmtree(folder, ignore_errors=True)
            return False
        return True

    def link(self, folder: str, index: int, sample: Sample) -> bool:
        """Hard-link the files of ``sample`` staged in ``folder`` into the cache as entry
        ``index`` (no copy: the entry shares the files' blocks); whether it is there now."""
        tmp = os.path.join(self.path, f".in-{int(index)}")
        try:
            for name in field_names(sample):
                dest = os.path.join(tmp, name)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                os.link(os.path.join(folder, name), dest)
            os.rename(tmp, self.entry(index))
        except OSError as exc:
            log.debug("epoch cache: cannot keep %s: %s", folder, exc.strerror)
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        return True

    def drop(self, index: int) -> None:
        shutil.rmtree(self.entry(index), ignore_errors=True)

    def close(self) -> None:
        """Leave the cache: the last live user removes the folder unless ``keep``. Safe to call
        twice; a forked child does nothing."""
        if os.getpid() != self._owner:
            return
        fd, self._fd = self._fd, None
        user, self._user = self._user, None
        if user is not None:
            try:
                os.unlink(user)
            except OSError:
                pass
        if fd is not None:
            os.close(fd)
        if user is None:
            return
        if self.keep:
            if not self.sharing:
                with open(os.path.join(self.path, KEPT), "w", encoding="utf-8"):
                    pass
            return
        with node_lock(self.root):  # no other process is opening it meanwhile
            if not _live_users(os.path.join(self.path, USERS)):
                shutil.rmtree(self.path, ignore_errors=True)


@contextmanager
def node_lock(root: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the directory ``root`` (the staging root the node's
    processes share); nothing is created for it, and a process that dies lets it go. A file
    system that cannot lock a directory is run without it."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield  # no root yet, or not ours to open: the caller's own steps say what is wrong
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            log.debug("cannot lock %s (%s); opening the epoch cache without the node's lock", root, exc)
        yield
    finally:
        os.close(fd)  # releases the lock


def clean_stale_caches(root: str, keep: str) -> list[str]:
    """Remove the cache folders below ``root`` but ``keep`` that no live process uses and that
    were not left on purpose; returns their paths. Call it under :func:`node_lock`."""
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        if not name.startswith(CACHE_PREFIX) or path == keep or os.path.islink(path):
            continue
        if os.path.exists(os.path.join(path, KEPT)) or not os.path.isdir(os.path.join(path, USERS)):
            continue
        if _live_users(os.path.join(path, USERS)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed the epoch cache %s, which no live loader uses", path)
        removed.append(path)
    return removed


def _live_users(folder: str) -> bool:
    """Whether a process still holds a lock in the users ``folder`` (dead ones are removed)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    alive = False
    for name in names:
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            alive = True
            continue
        finally:
            os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
    return alive
