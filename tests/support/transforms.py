"""Functions for ``s5loader pack --transform``: module-level, so that the pack's worker
processes import them by name."""

from __future__ import annotations

import hashlib
from typing import Any


def upper_and_digest(sample: dict[str, Any]) -> dict[str, Any]:
    """The image's bytes reversed, a ``sha`` field of its digest (str), the label as an int."""
    image = sample["image"]
    return {"image": image[::-1], "sha": hashlib.sha256(image).hexdigest(), "label": int(sample["label"])}


def fails_on_0003(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["__key__"].endswith("0003"):
        raise ValueError("cannot read this one")
    return {"image": sample["image"]}
