"""Public names stay importable: a renamed one keeps working for a release, with a warning."""

from __future__ import annotations


def test_the_daemon_engine_is_private_and_not_the_public_prefetcher() -> None:
    import s5loader
    from s5loader import _daemon

    assert _daemon.PrefetchDaemon.__name__ == "PrefetchDaemon"
    assert not hasattr(_daemon, "Prefetcher")  # the public one is s5loader.Prefetcher
    assert s5loader.Prefetcher is not _daemon.PrefetchDaemon  # it runs the daemon in a process


def test_no_two_modules_share_a_file_name() -> None:
    from pathlib import Path

    names = [p.name for p in Path(s5loader_root()).rglob("*.py") if p.name != "__init__.py"]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def s5loader_root() -> str:
    import os

    import s5loader

    return os.path.dirname(s5loader.__file__)


def test_the_public_api_is_all_there() -> None:
    import s5loader

    assert "S5Sampler" in s5loader.__all__ and "S5Dataset" in s5loader.__all__
    for name in s5loader.__all__:
        assert getattr(s5loader, name) is not None, name
