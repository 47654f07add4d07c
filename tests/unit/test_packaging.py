"""The wheel holds the whole package: pyproject.toml's package list, as setuptools expands it,
names every package of ``s5loader`` (each folder with an ``__init__.py``) and the benchmark's
``s5loader_bench`` (a list of the top-level packages alone would leave the sub-packages out of
the wheel, and ``import s5loader`` would fail after ``pip install``)."""

from __future__ import annotations

from pathlib import Path

from setuptools.config.pyprojecttoml import read_configuration

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_takes_every_package() -> None:
    config = read_configuration(ROOT / "pyproject.toml", expand=True)["tool"]["setuptools"]
    packages = set(config["packages"])
    expected = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "s5loader").rglob("__init__.py")
    } | {"s5loader_bench"}
    assert expected - packages == set()
    assert config["package-dir"]["s5loader_bench"] == "bench/s5loader_bench"
