"""argparse types shared by the ``s5loader`` commands."""

from __future__ import annotations

import argparse
import difflib
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ..exceptions import ConfigError
from .uri import parse_size


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {v}")
        return v

    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


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


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, except that an option it does not know is named first, with the
    closest known one: argparse itself reports a missing required option before an unknown
    one, so ``--budjet 1GiB`` would read "the following arguments are required: --budget"."""

    _argv: list[str] = []

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._argv, namespace)

    def unknown_options(self) -> list[str]:
        """The option-like words of the command line that name no option of this parser
        (an unambiguous abbreviation, as argparse allows, counts as known)."""
        known = list(self._option_string_actions)
        out = []
        for word in self._argv:
            if word == "--":
                break
            if not word.startswith("-") or word == "-" or _is_number(word):
                continue
            name = word.split("=", 1)[0]
            if name in known or (name.startswith("--") and any(k.startswith(name) for k in known)):
                continue
            out.append(name)
        return out

    def error(self, message: str) -> NoReturn:
        unknown = self.unknown_options()
        if unknown:
            parts = []
            for name in unknown:
                close = difflib.get_close_matches(
                    name, [k for k in self._option_string_actions if k.startswith("--")], 1
                )
                parts.append(f"{name} (did you mean {close[0]}?)" if close else name)
            message = f"unrecognized option{'s' if len(parts) > 1 else ''}: {', '.join(parts)}"
        super().error(message)


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True
