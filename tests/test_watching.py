"""Watching a run: the TensorBoard recipe writes real event files, and the Lightning example's
data path runs (with or without Lightning)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
from support.stores import Store

from s5loader import S5Dataset, S5Sampler, log_metrics

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def test_log_metrics_writes_tensorboard_events(moto: Store, staging_root: str, tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    moto.put({f"{i:04d}.bin": b"x" * 500 for i in range(8)})
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    written, positions = [], {}
    with S5Sampler(ds, staging_dir=staging_root, shuffle=False, budget=2000) as sampler:
        writer = SummaryWriter(str(tmp_path / "tb"))
        for step, idx in enumerate(sampler):
            ds[idx]
            if log_metrics(writer, sampler, step, every=3):
                written.append(step)
                positions[step] = step + 1  # the sampler has handed out step + 1 samples
        writer.close()
    assert written == [0, 3, 6]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"s5loader/mb_s", "s5loader/ready_ahead", "s5loader/staged_bytes", "s5loader/waited_s"} <= set(
        tags
    )
    assert [(e.step, e.value) for e in acc.Scalars("s5loader/position")] == sorted(positions.items())
    assert {e.value for e in acc.Scalars("s5loader/budget")} == {2000}
    assert all(e.value <= 2000 for e in acc.Scalars("s5loader/staged_bytes"))


def test_lightning_example_data_path(moto: Store, staging_root: str) -> None:
    moto.put(
        {f"{i:04d}.image": bytes([i]) * 300 for i in range(10)}
        | {f"{i:04d}.label": str(i % 3).encode() for i in range(10)}
    )
    spec = importlib.util.spec_from_file_location(
        "lightning_datamodule", os.path.join(EXAMPLES, "lightning_datamodule.py")
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules["lightning_datamodule"] = example
    try:
        spec.loader.exec_module(example)
        loader, sampler = example.build_loader(
            moto.uri(),
            endpoint_url=moto.endpoint,
            batch_size=4,
            num_workers=0,
            budget="64KB",
            staging_dir=staging_root,
        )
        with sampler:
            labels = [int(x) for batch in loader for x in batch["label"]]
            assert sorted(labels) == sorted(i % 3 for i in range(10))
            assert sampler.metrics().fetched_units == 10
        if example.HAVE_LIGHTNING:  # the DataModule itself, where Lightning is installed
            dm = example.S5DataModule(
                moto.uri(), endpoint_url=moto.endpoint, batch_size=4, staging_dir=staging_root
            )
            dm.setup("fit")
            assert sum(len(b["label"]) for b in dm.train_dataloader()) == 10
            dm.teardown("fit")
    finally:
        sys.modules.pop("lightning_datamodule", None)
