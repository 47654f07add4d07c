"""Public names stay importable: a renamed one keeps working for a release, with a warning."""

from __future__ import annotations

import pytest


def test_the_daemon_engine_is_prefetch_daemon_and_the_old_name_warns() -> None:
    import s5loader
    from s5loader import daemon

    assert daemon.PrefetchDaemon.__name__ == "PrefetchDaemon"
    with pytest.warns(DeprecationWarning, match="PrefetchDaemon"):
        old = daemon.Prefetcher
    assert old is daemon.PrefetchDaemon
    assert s5loader.Prefetcher is not daemon.PrefetchDaemon  # the public one runs it in a process


def test_the_public_api_is_all_there() -> None:
    import s5loader

    assert "S5Sampler" in s5loader.__all__ and "S5Dataset" in s5loader.__all__
    for name in s5loader.__all__:
        assert getattr(s5loader, name) is not None, name
