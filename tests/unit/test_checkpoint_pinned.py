"""A save of CUDA tensors copies them to the host through pinned memory: torch's setting is on
only while the save runs, is left as the user set it, and the pinned buffers torch cached are
released afterwards. (The save itself, on a GPU, is in tests/test_gpu.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils.serialization import config

from s5loader import checkpoint


@pytest.fixture
def emptied(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    calls: list[bool] = []
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append(True), raising=False)
    was = config.save.use_pinned_memory_for_d2h  # torch's config module: set and put back by hand
    config.save.use_pinned_memory_for_d2h = False
    try:
        yield calls
    finally:
        config.save.use_pinned_memory_for_d2h = was


def test_pinned_copies_only_while_the_save_runs_then_the_cache_is_emptied(emptied: list[bool]) -> None:
    with checkpoint._pinned_host_copies(True):
        assert config.save.use_pinned_memory_for_d2h is True
        assert not emptied
    assert config.save.use_pinned_memory_for_d2h is False
    assert emptied == [True]


def test_restored_and_emptied_when_the_save_fails(emptied: list[bool]) -> None:
    with pytest.raises(ValueError, match="boom"), checkpoint._pinned_host_copies(True):
        raise ValueError("boom")
    assert config.save.use_pinned_memory_for_d2h is False
    assert emptied == [True]


def test_off_and_a_setting_the_user_made_are_left_alone(emptied: list[bool]) -> None:
    with checkpoint._pinned_host_copies(False):
        assert config.save.use_pinned_memory_for_d2h is False
    config.save.use_pinned_memory_for_d2h = True  # the user's own choice: pinned, and cached
    with checkpoint._pinned_host_copies(True):
        assert config.save.use_pinned_memory_for_d2h is True
    assert config.save.use_pinned_memory_for_d2h is True
    assert not emptied


def test_tensors_on_the_host_do_not_ask_for_pinned_copies() -> None:
    state = {"w": torch.ones(4), "nested": [torch.zeros(2, device="meta"), {"b": b"xy"}]}
    size, on_cuda = checkpoint._inspect(state)
    assert not on_cuda
    assert size == checkpoint.estimate_size(state) >= 16 + 2


def test_a_whole_module_counts_by_its_parameters_and_buffers() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.BatchNorm1d(512))
    size, on_cuda = checkpoint._inspect({"model": model, "step": 3})
    tensors = [*model.parameters(), *model.buffers()]
    assert not on_cuda
    assert size >= sum(t.numel() * t.element_size() for t in tensors) > 512 * 1024
