"""The unit tier (``tests/unit``): no server, no subprocess, no network. Every test there runs
with process creation and socket connections refused, so a test that needs either fails at
once instead of quietly making the tier slow."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

UNIT = Path(__file__).resolve().parent.parent / "unit"


class TierError(AssertionError):
    """A unit test started a subprocess or opened a connection."""


@pytest.fixture(autouse=True)
def unit_tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    # S5LOADER_TEST_PROBE_UNIT=1 applies the guard to every test: those that pass under it
    # are the ones that belong in the unit tier.
    if UNIT not in Path(str(request.node.path)).resolve().parents and not os.environ.get(
        "S5LOADER_TEST_PROBE_UNIT"
    ):
        return

    def refuse(what: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise TierError(f"a unit test may not {what}: it belongs in the real-path tiers")

        return call

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("start a subprocess"))
    monkeypatch.setattr(socket.socket, "connect", refuse("connect a socket"))
    monkeypatch.setattr(socket.socket, "connect_ex", refuse("connect a socket"))
