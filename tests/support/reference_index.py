"""A straightforward model of the sample index: the list of NamedTuples that s5loader built
before the compact index, kept as the reference the compact index is tested against."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from s5loader._index.sample import Field, Sample, check_group_by
from s5loader._s5cmd import ObjectInfo
from s5loader.exceptions import ConfigError

log = logging.getLogger(__name__)


def group(
    objects: Iterable[ObjectInfo],
    group_by: str,
    base: str = "",
    extras: dict[str, dict[str, Any]] | None = None,
    source: str = "",
) -> list[Sample]:
    """Group objects into samples, sorted by sample key.

    Args:
        objects: the objects, in any order.
        group_by: ``stem`` (``0001.jpg`` + ``0001.cls``), ``folder`` (one sub-folder per sample)
            or ``object`` (one object per sample).
        base: the listed key prefix; ``folder`` samples are its sub-folders. Empty for
            object lists, where a sample is the folder an object lies in.
        extras: extra fields per object URI (from a manifest), merged into its sample.
        source: what was listed, for messages.
    """
    check_group_by(group_by)
    groups: dict[tuple[str, str], list[Field]] = {}
    sample_extra: dict[tuple[str, str], dict[str, Any]] = {}
    skipped: list[str] = []
    for obj in objects:
        if obj.key.endswith("/") and obj.size == 0:
            continue  # a "directory marker", not data
        bucket = obj.uri[5:].split("/", 1)[0]
        if group_by == "object":
            skey, field = obj.key, "data"
        elif group_by == "stem":
            head, _, base_name = obj.key.rpartition("/")
            stem, dot, ext = base_name.partition(".")
            if not dot or not stem or not ext:
                skipped.append(obj.uri)
                continue
            skey, field = (f"{head}/{stem}" if head else stem), ext
        else:
            rel = obj.key[len(base) :] if base and obj.key.startswith(base) else obj.key
            if base:
                folder, slash, field = rel.partition("/")
                if not slash or not field:
                    skipped.append(obj.uri)
                    continue
                skey = base + folder
            else:
                skey, slash, field = obj.key.rpartition("/")
                if not slash:
                    skipped.append(obj.uri)
                    continue
        gkey = (bucket, skey)
        groups.setdefault(gkey, []).append(Field(field, obj.uri, obj.size, obj.etag))
        if extras and obj.uri in extras:
            sample_extra.setdefault(gkey, {}).update(extras[obj.uri])
    if skipped:
        why = {
            "stem": "no extension to name a field (expected NAME.FIELD)",
            "folder": "not inside a sub-folder",
        }[group_by]
        log.warning(
            "group_by=%r left out %d object(s) of %s with %s, e.g. %s",
            group_by,
            len(skipped),
            source or "the source",
            why,
            ", ".join(skipped[:3]),
        )
    buckets = {b for b, _ in groups}
    samples = []
    for gkey in sorted(groups):
        fields = tuple(sorted(groups[gkey]))
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ConfigError(
                f"sample {gkey[1]!r} has the field {dup!r} twice "
                f"({', '.join(f.uri for f in fields if f.name == dup)}); use another group_by"
            )
        key = gkey[1] if len(buckets) == 1 else f"{gkey[0]}/{gkey[1]}"
        samples.append(Sample(key, fields, sample_extra.get(gkey)))
    return samples
