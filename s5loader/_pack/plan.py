"""The plan of a pack, pure logic: its options, the tar member names of each sample (checked
so that a reader gets back the key and fields it was given), the sample order (seeded) and
the cut into shards, the plan's fingerprint, and which rank packs which shard.

The plan is a function of the listing and the options only: a rerun with the same arguments
makes the same shards, byte for byte, so finished shards can be skipped and a shard packed
again replaces its earlier upload with the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .._index.sample import GROUP_BY, Sample
from .._shards.tar import split_name
from .._util.uri import format_size, parse_s3_uri, parse_size
from ..exceptions import BudgetError, ConfigError, UnsafeArchiveError
from .transform import Transform, transform_name

VERSION = 1
SHARD_NAME = "shard-{:06d}.tar"
BLOCK = 512
RECORD = 10240  # tarfile pads an archive to a multiple of this
MISSING = ("raise", "skip")


@dataclass(frozen=True)
class PackOptions:
    """How to pack, checked once.

    Args:
        shard_size: the size a shard is cut at (``"100MB"``, bytes): samples are added while
            the shard stays within it; a sample larger than it is a shard of its own.
        group_by: ``stem``, ``folder`` or ``object``, as :meth:`S5Dataset.from_prefix`.
        label: ``"folder"``: the class index of each sample's first folder, as a ``cls`` member.
        shuffle: shuffle the samples across shards (seeded) before they are cut into shards.
        seed: the shuffle's seed.
        budget: the most bytes of local disk the pack takes at once, a limit it keeps (see
            :func:`disk_bytes`); a sample or a shard that cannot fit is refused before
            anything is written (:func:`check_budget`).
        workers: parallel requests of the downloads and uploads.
        missing: an object gone between listing and download: ``"raise"`` (default) or
            ``"skip"`` its sample (logged by URI; the index counts what was written).
        index_timeout: seconds rank 0 waits for the other ranks' shards.
        transform: a module-level function run on each sample while it is packed (see
            :mod:`s5loader._pack.transform`); part of the plan, by name.
        transform_workers: the processes that run ``transform`` (default: one per CPU).
    """

    shard_size: int | str = "100MB"
    group_by: str = "stem"
    label: str | None = None
    shuffle: bool = False
    seed: int = 0
    budget: int | str = "1GiB"
    workers: int = 64
    missing: str = "raise"
    index_timeout: float = 3600.0
    transform: Transform | None = None
    transform_workers: int | None = None

    def __post_init__(self) -> None:
        if self.transform is not None:
            transform_name(self.transform)  # a function worker processes can import
        if self.transform_workers is not None and (
            not isinstance(self.transform_workers, int) or self.transform_workers < 1
        ):
            raise ConfigError(f"transform_workers must be an int >= 1, got {self.transform_workers!r}")
        object.__setattr__(self, "shard_size", parse_size(self.shard_size, "shard_size"))
        object.__setattr__(self, "budget", parse_size(self.budget, "budget"))
        if int(self.shard_size) < BLOCK:
            raise ConfigError(f"shard_size must be at least {BLOCK} bytes, got {self.shard_size}")
        if int(self.budget) < 1:
            raise ConfigError(f"budget must be at least 1 byte, got {self.budget}")
        if self.group_by not in GROUP_BY:
            raise ConfigError(f"group_by must be one of {', '.join(GROUP_BY)}; got {self.group_by!r}")
        if self.label not in (None, "folder"):
            raise ConfigError(f"label must be None or 'folder', got {self.label!r}")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(f"workers must be an int >= 1, got {self.workers!r}")
        if self.missing not in MISSING:
            raise ConfigError(f"missing must be 'raise' or 'skip', got {self.missing!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")
        if not self.index_timeout > 0:
            raise ConfigError(
                f"index_timeout must be a positive number of seconds, got {self.index_timeout!r}"
            )

    def content(self) -> dict[str, Any]:
        """The options that decide what the shards hold (not how fast they are made)."""
        return {
            "shard_size": self.shard_size,
            "group_by": self.group_by,
            "label": self.label,
            "shuffle": bool(self.shuffle),
            "seed": self.seed if self.shuffle else None,
            **({"transform": transform_name(self.transform)} if self.transform is not None else {}),
        }


class Member(NamedTuple):
    """One tar member of a planned sample: its name, and where its bytes come from (an
    object's URI and size, or ``data`` made by the plan: a label)."""

    name: str
    uri: str
    size: int
    etag: str
    data: bytes | None = None


class PlannedSample(NamedTuple):
    key: str
    members: tuple[Member, ...]

    @property
    def tar_bytes(self) -> int:
        return sum(member_bytes(m.name, m.size) for m in self.members)


def member_bytes(name: str, size: int) -> int:
    """The bytes a member takes in a pax tar: its header, a pax header for a long or
    non-ASCII name, its data padded to a block."""
    raw = name.encode("utf-8")
    pax = 0 if len(raw) <= 100 and raw.isascii() else BLOCK + -(-(len(raw) + 40) // BLOCK) * BLOCK
    return BLOCK + pax + -(-size // BLOCK) * BLOCK


def check_member(key: str, field: str, where: str) -> str:
    """The tar member name ``KEY.FIELD``, checked: a WebDataset reader must get back exactly
    ``key`` and ``field`` (fields read back lower-cased, as webdataset does).

    Raises:
        UnsafeArchiveError: a name no tar can carry safely or no reader would split back: not
            UTF-8, an absolute path, a ``..`` or empty component, a dot in the key's file name,
            a ``/`` in the field; the message names ``where`` (the object's URI).
    """
    name = f"{key}.{field}"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsafeArchiveError(
            f"{where}: its key is not UTF-8, so it cannot be a tar member name"
        ) from None
    parts = key.split("/")
    why = ""
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        why = "an absolute path, or an empty, '.' or '..' component"
    elif any(c in name for c in "\x00\n\r"):
        why = "a NUL character or a line break"
    elif split_name(name) != (key, field.lower()):
        why = (
            f"the sample key {key!r} and field {field!r} would read back as "
            f"{split_name(name)!r} (a dot in the key's last part, or a '/' in the field)"
        )
    if why:
        raise UnsafeArchiveError(
            f"{where}: cannot be the tar member {name!r}: {why}; rename it, or pick another --group-by"
        )
    return name


def relative_key(sample: Sample, base: str) -> str:
    """The sample's key inside the shards: relative to the listed prefix's key ``base``."""
    return sample.key[len(base) :] if base and sample.key.startswith(base) else sample.key


def plan_samples(samples: Iterable[Sample], base: str) -> list[PlannedSample]:
    """Each sample's tar members, checked; a ``label`` (``label="folder"``) becomes a ``cls``
    member and other manifest fields a ``json`` member.

    Raises:
        UnsafeArchiveError: a key that cannot be a member name (see :func:`check_member`).
        ConfigError: two samples with one key, or two fields of a sample that read back the same.
    """
    out: list[PlannedSample] = []
    seen: dict[str, str] = {}
    for s in samples:
        key = relative_key(s, base)
        first = s.fields[0].uri if s.fields else key
        if key in seen:
            raise ConfigError(
                f"{first}: its sample key {key!r} is also the key of {seen[key]}; "
                "shards need one sample per key"
            )
        seen[key] = first
        members = [Member(check_member(key, f.name, f.uri), f.uri, f.size, f.etag) for f in s.fields]
        extra = dict(s.extra or {})
        if "label" in extra:
            members.append(_made(key, "cls", str(extra.pop("label")).encode(), first))
        extra = {k: v for k, v in extra.items() if not k.startswith("__")}
        if extra:
            members.append(_made(key, "json", json.dumps(extra, sort_keys=True).encode(), first))
        fields = [m.name[len(key) + 1 :].lower() for m in members]
        if len(set(fields)) != len(fields):
            raise ConfigError(
                f"{first}: sample {key!r} has fields that read back the same ({', '.join(fields)})"
            )
        out.append(PlannedSample(key, tuple(members)))
    return out


def _made(key: str, field: str, data: bytes, where: str) -> Member:
    return Member(check_member(key, field, where), "", len(data), "", data)


def order(n: int, shuffle: bool, seed: int) -> np.ndarray:
    """The order samples go into shards: key order, or a permutation seeded by ``seed``."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng(seed).permutation(n).astype(np.int64)


def cut(sizes: Sequence[int], shard_size: int) -> list[tuple[int, int]]:
    """Cut a run of samples (their tar bytes, in shard order) into shards: ``(start, stop)``
    positions. A shard takes samples while its members and the tar's end stay within
    ``shard_size``; a sample larger than that is a shard of its own."""
    out: list[tuple[int, int]] = []
    start, filled = 0, 0
    for i, size in enumerate(sizes):
        if i > start and filled + size + 2 * BLOCK > shard_size:
            out.append((start, i))
            start, filled = i, 0
        filled += size
    if len(sizes) > start:
        out.append((start, len(sizes)))
    return out


def shard_bytes(samples: Sequence[PlannedSample]) -> int:
    """An upper bound of a shard's tar size (members, end blocks, record padding)."""
    body = sum(s.tar_bytes for s in samples) + 2 * BLOCK
    return -(-body // RECORD) * RECORD


def disk_bytes(samples: Sequence[PlannedSample]) -> int:
    """The most local disk that building a shard of ``samples`` takes: its tar (an upper bound,
    :func:`shard_bytes`) and its largest object once more, since a staged object is deleted
    only once it has been copied into the tar. Until its upload ends the shard holds it."""
    largest = max((m.size for s in samples for m in s.members if m.data is None), default=0)
    return shard_bytes(samples) + largest


def check_budget(
    planned: Sequence[PlannedSample],
    order: Sequence[int] | np.ndarray,
    cuts: Sequence[tuple[int, int]],
    budget: int,
    dest: str,
) -> None:
    """Refuse, before anything is written, a plan that the disk budget cannot hold: a sample
    (never split) or a shard whose :func:`disk_bytes` exceed ``budget``.

    Raises:
        BudgetError: names the sample's object (its first) or the shard's URI, what it takes
            and the budget, and what to change.
    """
    alone = [disk_bytes((s,)) for s in planned]
    big = max(range(len(alone)), key=alone.__getitem__, default=None)
    if big is not None and (need := alone[big]) > budget:
        s = planned[big]
        first = next((m.uri for m in s.members if m.uri), s.key)
        raise BudgetError(
            f"{first}: its sample {s.key!r} takes {_size(need)} of local disk to pack (its tar and its "
            f"largest object once more, while it is copied in), more than the budget of {_size(budget)}; a "
            f"sample is never split: pass a budget of at least {format_size(need, exact=True)}"
        )
    needs = [disk_bytes([planned[order[k]] for k in range(a, b)]) for a, b in cuts]
    worst = max(range(len(needs)), key=needs.__getitem__, default=None)
    if worst is not None and needs[worst] > budget:
        raise BudgetError(
            f"{dest}{SHARD_NAME.format(worst)} takes {_size(needs[worst])} of local disk to build (its tar "
            f"and its largest object once more), more than the budget of {_size(budget)}: pass a smaller "
            f"--shard-size (shard_size) or a budget of at least {format_size(needs[worst], exact=True)}"
        )


def _size(n: int) -> str:
    return format_size(n, exact=True)


def fingerprint(planned: Sequence[PlannedSample], options: PackOptions) -> str:
    """What identifies a pack: its samples (keys, member names, sizes, ETags) in order, and the
    options that decide the shards. A rerun with the same fingerprint makes the same shards."""
    h = hashlib.sha256(json.dumps([VERSION, options.content()], sort_keys=True).encode())
    for s in planned:
        for m in s.members:
            h.update(f"{m.name}\0{m.size}\0{m.etag}\0".encode("utf-8", "surrogatepass"))
            if m.data is not None:
                h.update(m.data)
        h.update(b"\1")
    return h.hexdigest()


def rank_shards(nshards: int, rank: int, world: int) -> list[int]:
    """The shard numbers rank ``rank`` of ``world`` packs: every ``world``-th, from ``rank``."""
    return list(range(rank, nshards, world))


def ranks_of(shards: Iterable[int], world: int) -> list[int]:
    """The ranks that pack the given shard numbers, sorted."""
    return sorted({s % world for s in shards})


def check_places(source: str, dest: str) -> None:
    """Refuse a DEST inside SOURCE (the shards would be listed as samples on a rerun) or a
    SOURCE inside DEST.

    Raises:
        ConfigError: they overlap; names both.
    """
    s, d = parse_s3_uri(source), parse_s3_uri(dest)
    if s.bucket != d.bucket:
        return
    if d.key.startswith(s.key) or s.key.startswith(d.key):
        raise ConfigError(
            f"the destination {dest} and the source {source} overlap (one is inside the other); "
            "pack into a prefix of its own"
        )
