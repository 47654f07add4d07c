"""argparse types shared by the ``s5loader`` commands."""

from __future__ import annotations

import argparse
import math

from ._uri import parse_size
from .exceptions import ConfigError


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {v}")
    return v


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0 or not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return v


def size_arg(text: str) -> int:
    """A size such as ``2GiB``, ``500MB`` or a number of bytes."""
    try:
        return parse_size(text, "size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
