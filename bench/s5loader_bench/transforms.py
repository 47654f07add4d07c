"""Per-sample functions for the conversion benchmark's transform runs (``bench/pack.py``): the
same work for every method, module-level so that worker processes import them by name."""

from __future__ import annotations

import hashlib
import zlib
from typing import Any


def recode(sample: dict[str, Any]) -> dict[str, Any]:
    """A stand-in for re-encoding an image: the ``jpg`` field compressed again (zlib level 6) and
    its SHA-256 added as ``sha``; the label kept."""
    image = sample["jpg"]
    return {"jpg": zlib.compress(image, 6), "sha": hashlib.sha256(image).hexdigest(), "cls": sample["cls"]}
