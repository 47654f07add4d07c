"""What lies near a prefix that names nothing, for the hint of an ``EmptySourceError``: the
keys beside an empty folder that share its name (``train-old/``, ``train.csv`` beside
``train/``), else the names in its parent closest to it by edit distance (``train/`` for
``trian/``). One LIST each, only on the way to an error; a LIST that fails gives no hint."""

from __future__ import annotations

from .._s3api.client import s3_client
from ..config import Access

# A name counts as a near miss within this many edits, and at most a third of its length.
_MOST_EDITS = 3


def edit_distance(a: str, b: str) -> int:
    """Levenshtein's distance: the fewest insertions, deletions and substitutions from ``a`` to
    ``b``, a swap of two neighbours counting as one (a typed ``trian`` for ``train``)."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def keys_beside(bucket: str, folder: str, access: Access | str | None, most: int = 3) -> list[str]:
    """Up to ``most`` URIs of keys beside the folder ``folder`` (ending in ``/``) that share
    its name without the slash (``train-old/x``, ``train.csv`` beside ``train/``); one LIST,
    for an error message's hint (none where the LIST fails)."""
    if not folder.endswith("/"):
        return []
    try:
        client = s3_client(Access.coerce(access))
        found = client.list_objects_v2(Bucket=bucket, Prefix=folder[:-1], MaxKeys=most).get("Contents", [])
    except Exception:  # noqa: BLE001 - only a hint for a message that is raised anyway
        return []
    return [f"s3://{bucket}/{o['Key']}" for o in found]


def closest_beside(bucket: str, prefix: str, access: Access | str | None, most: int = 2) -> list[str]:
    """Up to ``most`` URIs of the folders and keys in the parent of ``prefix`` whose names are
    closest to its last part by edit distance, near misses only (at most three edits, and a
    third of the name); one LIST of the parent with a delimiter (its first 1000 names)."""
    path = prefix.rstrip("/")
    name = path.rsplit("/", 1)[-1]
    parent = path[: len(path) - len(name)]
    if not name:
        return []
    try:
        client = s3_client(Access.coerce(access))
        page = client.list_objects_v2(Bucket=bucket, Prefix=parent, Delimiter="/", MaxKeys=1000)
    except Exception:  # noqa: BLE001 - only a hint for a message that is raised anyway
        return []
    names = [p["Prefix"] for p in page.get("CommonPrefixes", [])] + [
        o["Key"] for o in page.get("Contents", [])
    ]
    limit = min(_MOST_EDITS, max(1, len(name) // 3))
    scored = []
    for key in names:
        candidate = key[len(parent) :].rstrip("/")
        d = edit_distance(name, candidate)
        if candidate and candidate != name and d <= limit:
            scored.append((d, key))
    return [f"s3://{bucket}/{key}" for _, key in sorted(scored)[:most]]


def beside_hint(bucket: str, folder: str, access: Access | str | None) -> str:
    """The end of the message for an empty folder ``folder``: the keys beside it that share its
    name, which a prefix without its slash would have meant elsewhere; else the near misses in
    its parent (a typo in the folder's name). Empty when neither exists."""
    examples = keys_beside(bucket, folder, access)
    if examples:
        return (
            f"; a prefix names a folder, so s3://{bucket}/{folder[:-1]} reads only s3://{bucket}/{folder}, "
            f"not keys beside it such as {', '.join(examples)}: name the folder they are in, or list the "
            "objects in a manifest"
        )
    near = closest_beside(bucket, folder, access)
    if near:
        return f"; did you mean {' or '.join(near)}?"
    return ""
