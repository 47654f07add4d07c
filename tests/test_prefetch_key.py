"""Each delivered daemon folder carries the sample's full key in ``__key__``: the folder name
keeps only a shortened, file-name-safe form of it."""

from __future__ import annotations

import os

from conftest import Store

from s5loader import consume
from s5loader.daemon import main

LONG = "a dir/ünï côde & more/" + "long-name-" * 9  # > 64 characters, spaces, non-ASCII


def test_delivered_folder_carries_the_full_key(moto: Store, tmp_path) -> None:
    moto.put({f"{LONG}{i}.bin": bytes([i]) * 100 for i in range(3)})
    cache = tmp_path / "cache"
    rc = main([moto.uri(), "--cache", str(cache), "--budget", "10000", "--endpoint-url", moto.endpoint,
               "--no-progress"])
    assert rc == 0
    got = []
    for sample in consume(cache, timeout=10):
        assert "ü" not in sample.name and len(sample.name) < len(sample.key)  # shortened and made safe
        with open(os.path.join(sample.path, "__key__"), encoding="utf-8") as f:
            assert f.read() == sample.key
        assert list(sample.files) == ["bin"]  # __key__ is not a field
        got.append((sample.key, sample.read("bin")))
    assert got == [(f"train/{LONG}{i}", bytes([i]) * 100) for i in range(3)]
