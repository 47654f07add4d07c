"""What a pack keeps under its destination, so that it can be stopped at any point and run
again, and so that no reader ever sees half a result::

    DEST/shard-000000.tar ...           the shards, each uploaded under its final name when
                                        complete (an S3 PUT or multipart upload is atomic)
    DEST/.s5pack/plan.json              the plan's fingerprint, written before any shard
    DEST/.s5pack/done/shard-000000.json one per finished shard: samples, size, MD5
    DEST/wids.json                      the shard index, written last, once every shard is done;
                                        it records the plan (key ``s5loader_pack``)

A rerun with the same arguments finds the plan, skips the shards that have a ``done`` marker
and packs the others again (a shard uploaded but not yet marked is made again, to the same
bytes). Under several ranks, rank 0 writes the plan and the index; the other ranks wait for
the plan before they upload anything.

Once the index is written, ``.s5pack/`` is removed (the plan first): the index's record of
the plan is what tells a rerun that DEST holds this very pack, finished, so it does nothing.
A pack stopped while it removes them leaves a plan (it finishes as before) or markers without
a plan (the next run sees the pack finished and removes them).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._index.listing import list_prefix
from .._s3api.client import s3_client
from .._s3api.errors import boto3_error
from .._s5cmd import S5cmd
from .._shards.index import DEFAULT_INDEX, PACK_RECORD, WIDS_KIND
from .._util.uri import SHARD_SUFFIXES, parse_s3_uri
from ..config import Access
from ..exceptions import ConfigError, EmptySourceError, ObjectNotFoundError, ShardIndexError
from .plan import SHARD_NAME, ranks_of

log = logging.getLogger(__name__)

STATE = ".s5pack/"
PLAN = STATE + "plan.json"
DONE = STATE + "done/"
_POLL, _POLL_MAX = 0.1, 5.0  # the pause between LISTs while waiting for another rank: grows to 5 s
_SHARD = re.compile(r"shard-(\d{6,})\.tar")


class DestState:
    """The pack's state under ``dest`` (an ``s3://`` folder URI ending in ``/``)."""

    def __init__(self, dest: str, access: Access) -> None:
        self.dest, self.access = dest, access
        self.bucket, self.key = parse_s3_uri(dest)
        self.client = s3_client(access)

    # -- objects -----------------------------------------------------------------------
    def _get(self, rel: str) -> bytes | None:
        try:
            return bytes(self.client.get_object(Bucket=self.bucket, Key=self.key + rel)["Body"].read())
        except Exception as exc:
            err = boto3_error(exc, self.dest + rel)
            if isinstance(err, ObjectNotFoundError):
                return None
            raise err from exc

    def _put(self, rel: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self.key + rel, Body=data)
        except Exception as exc:
            raise boto3_error(exc, self.dest + rel) from exc

    def listed(self) -> list[str]:
        """The keys below DEST, relative to it."""
        try:
            return [o.key[len(self.key) :] for o in list_prefix(self.dest, S5cmd(access=self.access))]
        except EmptySourceError:
            return []

    # -- the plan ----------------------------------------------------------------------
    def claim(self, doc: dict[str, Any], rank: int, timeout: float) -> dict[str, Any] | None:
        """Check that DEST is empty or holds this very pack; rank 0 records the plan first.

        Returns:
            the index, where DEST holds this pack finished (nothing is left to do); else None.

        Raises:
            ConfigError: DEST holds shards or an index of something else, or the plan or
                the finished index of another pack (other samples, other options); names
                what is there.
        """
        if rank != 0:
            return self._wait_plan(doc, timeout)
        listed = self.listed()  # listed before the plan is read: see the module docstring
        theirs = self._plan()
        if theirs is not None:
            self._same(theirs, doc)
            foreign = [k for k in listed if k.endswith(SHARD_SUFFIXES) and not _ours(k, doc.get("shards"))]
            if foreign:
                raise ConfigError(
                    f"{self.dest} holds {self.dest}{foreign[0]}, which this pack does not write; "
                    "pack into a prefix of its own"
                )
            return None
        finished = self._finished(doc) if DEFAULT_INDEX in listed else None
        if finished is not None:
            if any(k.startswith(STATE) for k in listed):
                self.finish()  # a pack stopped while it removed them
            return finished
        other = [k for k in listed if k.endswith(SHARD_SUFFIXES) or k == DEFAULT_INDEX]
        if other:
            raise ConfigError(
                f"{self.dest} already holds {self.dest}{other[0]} ({len(other)} shard(s) or index), "
                "which no pack of this source wrote; pack into an empty prefix"
            )
        self._put(PLAN, json.dumps(doc, sort_keys=True).encode())
        return None

    def _plan(self) -> dict[str, Any] | None:
        data = self._get(PLAN)
        if data is None:
            return None
        try:
            doc = json.loads(data)
        except ValueError as exc:
            raise ConfigError(
                f"{self.dest}{PLAN} is not a pack plan ({exc}); remove it or pack elsewhere"
            ) from exc
        return doc if isinstance(doc, dict) else {}

    def _same(self, theirs: dict[str, Any], doc: dict[str, Any]) -> None:
        if theirs.get("fingerprint") != doc["fingerprint"]:
            raise ConfigError(
                f"{self.dest} holds a pack of other samples or options (its plan: source "
                f"{theirs.get('source')!r}, {theirs.get('options')}); rerun with the same source and "
                "options to finish it, or pack into an empty prefix"
            )

    def _finished(self, doc: dict[str, Any]) -> dict[str, Any] | None:
        """The index, where a pack wrote it and that pack is this one; None where no pack
        wrote it (or there is none).

        Raises:
            ConfigError: the index of a pack of other samples or options.
        """
        data = self._get(DEFAULT_INDEX)
        try:
            index = json.loads(data) if data is not None else None
        except ValueError:
            return None
        if not isinstance(index, dict) or not isinstance(index.get(PACK_RECORD), dict):
            return None
        if not isinstance(index.get("shardlist"), list):
            return None
        self._same(index[PACK_RECORD], doc)
        return index

    def _wait_plan(self, doc: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        deadline, pause = time.monotonic() + timeout, _POLL
        while (theirs := self._plan()) is None:
            if (finished := self._finished(doc)) is not None:
                return finished
            if time.monotonic() > deadline:
                raise ShardIndexError(f"waited {timeout:g}s for rank 0 to write the plan {self.dest}{PLAN}")
            time.sleep(pause)
            pause = min(_POLL_MAX, pause * 1.5)
        self._same(theirs, doc)
        return None

    # -- finished shards ---------------------------------------------------------------
    def mark_done(self, shard: int, entry: dict[str, Any]) -> None:
        self._put(f"{DONE}{SHARD_NAME.format(shard)}.json", json.dumps(entry, sort_keys=True).encode())

    def done(self) -> set[int]:
        """The shard numbers with a ``done`` marker (one LIST)."""
        out = set()
        for k in self.listed():
            if k.startswith(DONE) and k.endswith(".tar.json"):
                try:
                    out.add(int(k[len(DONE) + 6 : -len(".tar.json")]))
                except ValueError:
                    continue
        return out

    def wait_all(self, nshards: int, world: int, timeout: float, stop: Callable[[], None]) -> None:
        """Wait until every shard has its marker; ``stop()`` is called while waiting (it
        raises to give up).

        Raises:
            ShardIndexError: ``timeout`` passed; names the ranks whose shards are missing.
        """
        deadline, pause = time.monotonic() + timeout, _POLL
        while True:
            missing = set(range(nshards)) - self.done()
            if not missing:
                return
            if time.monotonic() > deadline:
                ranks = ", ".join(map(str, ranks_of(missing, world)))
                raise ShardIndexError(
                    f"waited {timeout:g}s for the shards of rank(s) {ranks} under {self.dest} "
                    f"({len(missing)} of {nshards} shards missing, "
                    f"such as {SHARD_NAME.format(min(missing))}); "
                    "run the pack again with the same arguments to finish them"
                )
            stop()
            time.sleep(pause)
            pause = min(_POLL_MAX, pause * 1.5)

    def entries(self, nshards: int) -> list[dict[str, Any]]:
        """The markers of shards ``0 .. nshards-1``, in order (read side by side)."""

        def one(i: int) -> dict[str, Any]:
            data = self._get(f"{DONE}{SHARD_NAME.format(i)}.json")
            if data is None:
                raise ShardIndexError(f"{self.dest}: the marker of {SHARD_NAME.format(i)} is gone")
            return dict(json.loads(data))

        with ThreadPoolExecutor(max_workers=16) as pool:
            return list(pool.map(one, range(nshards)))

    def write_index(
        self, entries: list[dict[str, Any]], name: str, plan: dict[str, Any], classes: list[str] | None = None
    ) -> str:
        """Write ``DEST/wids.json`` (sizes, sample counts and MD5 of every shard, the ``plan``
        with the keys of the samples left out, and the ``classes`` of int labels); last."""
        shardlist = [
            {"url": e["url"], "nsamples": e["nsamples"], "filesize": e["filesize"], "md5sum": e["md5sum"]}
            for e in entries
        ]
        record = {**plan, "skipped": [k for e in entries for k in e.get("skipped", [])]}
        doc = {
            "__kind__": WIDS_KIND,
            "wids_version": 1,
            "name": name,
            "shardlist": shardlist,
            PACK_RECORD: record,
        }
        if classes:
            doc["classes"] = list(classes)  # label i is classes[i]: S5Dataset.from_shards(...).classes
        self._put(DEFAULT_INDEX, (json.dumps(doc, indent=1) + "\n").encode())
        return self.dest + DEFAULT_INDEX

    def finish(self) -> None:
        """Remove ``DEST/.s5pack/`` once the index is written, the plan first (see the module
        docstring). A key that cannot be removed is named in a warning: the pack is done."""
        keys = sorted((k for k in self.listed() if k.startswith(STATE)), key=lambda k: k != PLAN)
        try:
            if keys[:1] == [PLAN]:
                self.client.delete_object(Bucket=self.bucket, Key=self.key + PLAN)
                keys = keys[1:]
            for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
                batch = [{"Key": self.key + k} for k in keys[i : i + 1000]]
                out = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
                for e in out.get("Errors", []) or []:
                    log.warning(
                        "could not remove %s (%s); the pack is finished: remove it by hand",
                        f"s3://{self.bucket}/{e.get('Key')}",
                        e.get("Message") or e.get("Code"),
                    )
        except Exception as exc:  # noqa: BLE001 - the index is written: the pack is done
            log.warning(
                "could not remove %s%s (%s); the pack is finished: remove it by hand",
                self.dest,
                STATE,
                boto3_error(exc, self.dest + STATE),
            )


def _ours(key: str, nshards: int | None) -> bool:
    """Whether ``key`` (relative to DEST) is a shard name this pack writes."""
    m = _SHARD.fullmatch(key)
    return m is not None and (nshards is None or int(m[1]) < nshards)
