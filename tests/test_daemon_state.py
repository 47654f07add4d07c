"""The prefetch daemon's state file: synced to disk, written once per delivery.

A private module (``s5loader._daemon``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.stores import Store, make_pairs

from s5loader._daemon import STATE_FILE, PrefetchDaemon, PrefetchOptions


def test_state_file_written_once_per_delivery_and_synced(
    moto: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    moto.put(make_pairs(12, size=100))
    cache = tmp_path / "cache"
    state_path = str(cache / STATE_FILE)
    replaced: list[str] = []
    synced: list[str] = []
    real_replace, real_fsync = os.replace, os.fsync

    def replace(src, dst, *args, **kw):  # type: ignore[no-untyped-def]
        replaced.append(os.fspath(dst))
        return real_replace(src, dst, *args, **kw)

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    opts = PrefetchOptions.of(moto.uri(), str(cache), 10**6, endpoint_url=moto.endpoint, samples_per_call=5)
    with PrefetchDaemon(opts) as p:
        p.open()
        before, synced_before = replaced.count(state_path), len(synced)
        summary = p.run()
    assert summary.delivered == 12
    assert replaced.count(state_path) - before == 12 + 1  # one write per delivery, one at the end
    run_syncs = synced[synced_before:]
    # each write: the new file before its rename, then the directory that holds the name
    assert run_syncs.count(state_path + ".tmp") == 13 and run_syncs.count(str(cache)) >= 13
    final = json.loads(Path(state_path).read_text())
    assert final["delivered"] == 12 and final["done"] is True and final["pending"] is None
