"""Every s5loader exception survives pickling (they cross DataLoader worker boundaries) with its
type and its message."""

from __future__ import annotations

import pickle

import pytest

from s5loader import exceptions as exc_mod


@pytest.mark.parametrize(
    "cls", [c for c in vars(exc_mod).values() if isinstance(c, type) and issubclass(c, exc_mod.S5LoaderError)]
)
def test_exceptions_survive_pickling(cls) -> None:
    e = cls("cannot stage s3://b/k: boom")
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is cls and str(e2) == str(e)
