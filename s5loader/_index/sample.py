"""The sample types every layer shares: a :class:`Sample` is a key, its :class:`Field` objects and
the extra fields a manifest gave it; ``group_by`` names how objects make samples."""

from __future__ import annotations

from typing import Any, NamedTuple

from ..exceptions import ConfigError

GROUP_BY = ("stem", "folder", "object")
# A grouping that puts more objects than this into a sample on average is probably a
# folder-per-class layout grouped by folder (an ImageFolder read with group_by="folder").


class Field(NamedTuple):
    """One object of a sample: the field name, its URI, size and ETag."""

    name: str
    uri: str
    size: int
    etag: str


#: The extra of a staging unit that takes more disk than its objects: a compressed tar shard,
#: which is decompressed beside itself once staged. The budget counts this size.
DISK = "__disk__"


class Sample(NamedTuple):
    """One sample: its key, its objects and the extra fields a manifest carried."""

    key: str
    fields: tuple[Field, ...]
    extra: dict[str, Any] | None = None

    @property
    def size(self) -> int:
        """The bytes the sample takes staged: its objects' sizes (or its :data:`DISK` extra)."""
        if self.extra and DISK in self.extra:
            return int(self.extra[DISK])
        return sum(f.size for f in self.fields)


def check_group_by(group_by: str) -> str:
    if group_by not in GROUP_BY:
        raise ConfigError(f"group_by must be one of {', '.join(GROUP_BY)}; got {group_by!r}")
    return group_by
