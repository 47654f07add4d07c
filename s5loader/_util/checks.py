"""The checks the option objects share: each raises a :class:`~s5loader.exceptions.ConfigError`
that names the option and the value it got."""

from __future__ import annotations

from typing import Any

from ..exceptions import ConfigError


def optional_str(name: str, value: Any) -> None:
    """``value`` is ``None`` or a non-empty string."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{name} must be a non-empty string or None, got {value!r}")


def boolean(name: str, value: Any) -> None:
    """``value`` is ``True`` or ``False`` (not a truthy stand-in)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")


def positive_int(name: str, value: Any) -> None:
    """``value`` is an int above zero (not a bool)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def seconds(name: str, value: Any, *, positive: bool) -> None:
    """``value`` is a number of seconds, above zero where ``positive``, else at least zero."""
    if positive and not (_is_number(value) and value > 0):
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
    if not positive and not (_is_number(value) and not value < 0):
        raise ConfigError(f"{name} must be a number of seconds >= 0, got {value!r}")
