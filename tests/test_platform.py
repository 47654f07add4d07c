"""Linux only: elsewhere the sampler and the daemon refuse to start, saying why.

A private module (``s5loader._daemon``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

import pickle
import sys

import pytest
from support.stores import Store, make_pairs

from s5loader import PlatformError, S5Dataset, S5LoaderError, S5Sampler
from s5loader._daemon import PrefetchDaemon, PrefetchOptions
from s5loader._daemon import main as daemon_main


@pytest.mark.parametrize("platform", ["darwin", "win32", "freebsd14"])
def test_sampler_and_daemon_refuse_other_platforms(moto: Store, tmp_path, monkeypatch, platform: str) -> None:
    moto.put(make_pairs(3, size=10))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    monkeypatch.setattr(sys, "platform", platform)
    with pytest.raises(PlatformError) as e:
        S5Sampler(ds, staging_dir=str(tmp_path / "staging"))
    msg = str(e.value)
    assert "S5Sampler runs on Linux only" in msg and platform in msg
    assert "flock" in msg and "/proc/PID/io" in msg and "prctl" in msg
    assert isinstance(e.value, S5LoaderError) and isinstance(e.value, OSError)
    assert str(pickle.loads(pickle.dumps(e.value))) == msg
    assert not (tmp_path / "staging").exists()
    with pytest.raises(PlatformError, match="the prefetch daemon runs on Linux only"):
        PrefetchDaemon(
            PrefetchOptions.of(moto.uri(), str(tmp_path / "cache"), 10**6, endpoint_url=moto.endpoint)
        )
    with pytest.raises(PlatformError):
        daemon_main([moto.uri(), "--cache", str(tmp_path / "cache"), "--budget", "1MiB"])
    assert not (tmp_path / "cache").exists()
