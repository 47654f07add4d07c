"""On a machine with a CUDA device: checkpoints of CUDA tensors (a model and its optimizer
state) round trip byte-exact and land where ``map_location`` says, torch.distributed.checkpoint
loads into CUDA tensors in place, and a loader that pins memory feeds a model on the GPU every
sample once. Skipped where torch sees no CUDA device."""

from __future__ import annotations

import os

import pytest
import torch
from support.stores import Store
from torch.utils.data import DataLoader
from torch.utils.serialization import config as serialization_config

from s5loader import S5Dataset, S5Sampler, checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def trained_state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model on the GPU after two Adam steps: its parameters and the optimizer's
    moments are CUDA tensors (the bias in bfloat16)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    model[2].bias.data = model[2].bias.data.to(torch.bfloat16).float()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        loss = model(torch.randn(64, 256, device="cuda")).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def tensors(obj: object, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out |= tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for k, v in enumerate(obj):
            out |= tensors(v, f"{prefix}/{k}")
    return out


@pytest.mark.parametrize("stream", [True, False])
def test_a_checkpoint_of_cuda_tensors_round_trips_and_lands_where_map_location_says(
    moto: Store, tmp_path, stream: bool
) -> None:
    model, opt = trained_state()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 2}
    want = tensors(state)
    assert want and all(t.is_cuda for t in want.values() if t.dim() > 0)
    uri = moto.uri("run/step-2.pt")
    # each storage goes to the host through pinned memory, released once the save returns
    before = torch.cuda.host_memory_stats()
    checkpoint.save(
        state, uri, endpoint_url=moto.endpoint, stream=stream, staging_dir=str(tmp_path), part_size="5MiB"
    )
    after = torch.cuda.host_memory_stats()
    assert after["num_host_alloc"] > before["num_host_alloc"]
    assert after["allocated_bytes.current"] <= before["allocated_bytes.current"]
    assert serialization_config.save.use_pinned_memory_for_d2h is False
    for where, device in (
        (None, want["/model/0.weight"].device),
        ("cpu", torch.device("cpu")),
        ("cuda:0", torch.device("cuda:0")),
    ):
        got = checkpoint.load(
            uri, map_location=where, endpoint_url=moto.endpoint, stream=stream, staging_dir=str(tmp_path)
        )
        back = tensors(got)
        assert back.keys() == want.keys() and got["step"] == 2
        for k, t in want.items():
            assert back[k].device == (device if t.dim() > 0 or where is not None else t.device), (k, where)
            assert back[k].dtype == t.dtype and torch.equal(back[k].cpu(), t.cpu()), k
    # the loaded state drives the same model on: one more step from it matches one from the original
    m2, o2 = trained_state()
    m2.load_state_dict(got["model"])
    o2.load_state_dict(got["optim"])
    x = torch.randn(8, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    assert torch.equal(m2(x), model(x))
    assert os.listdir(tmp_path) == []


def test_dcp_loads_into_cuda_tensors_in_place(moto: Store, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    from s5loader.dcp import S5StorageReader, S5StorageWriter

    model, _ = trained_state()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    uri = moto.uri("dcp/step-2/")
    dcp.save(sd, storage_writer=S5StorageWriter(uri, endpoint_url=moto.endpoint, staging_dir=str(tmp_path)))
    out = {k: torch.zeros_like(v) for k, v in sd.items()}  # CUDA tensors, filled in place
    ptrs = {k: v.data_ptr() for k, v in out.items()}
    dcp.load(out, storage_reader=S5StorageReader(uri, endpoint_url=moto.endpoint, staging_dir=str(tmp_path)))
    for k, v in sd.items():
        assert out[k].is_cuda and out[k].data_ptr() == ptrs[k] and torch.equal(out[k], v), k


def test_a_pinned_loader_feeds_a_model_on_the_gpu_every_sample_once(moto: Store, staging_root: str) -> None:
    n, dim = 96, 128
    g = torch.Generator().manual_seed(3)
    rows = {i: torch.randn(dim, generator=g) for i in range(n)}
    moto.put(
        {f"{i:04d}.x": rows[i].numpy().tobytes() for i in range(n)}
        | {f"{i:04d}.y": b"%d" % (i % 10) for i in range(n)}
    )

    def decode(sample: dict) -> dict:
        return {
            "x": torch.frombuffer(bytearray(sample["x"]), dtype=torch.float32),
            "y": int(sample["y"]),
            "key": int(sample["__key__"].rsplit("/", 1)[-1]),
        }

    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint, group_by="stem", transform=decode)
    model = torch.nn.Linear(dim, 10).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with S5Sampler(
        ds, shuffle=True, seed=0, budget="1MiB", batch_size=8, staging_dir=staging_root
    ) as sampler:
        loader = DataLoader(ds, sampler=sampler, batch_size=8, num_workers=2, pin_memory=True)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            seen: list[int] = []
            for batch in loader:
                assert batch["x"].is_pinned()
                x = batch["x"].cuda(non_blocking=True)
                y = batch["y"].cuda(non_blocking=True)
                for k, row in zip(batch["key"].tolist(), x.cpu(), strict=True):
                    assert torch.equal(row, rows[k]), k  # the bytes that reach the GPU are the sample's
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                seen += batch["key"].tolist()
            assert sorted(seen) == list(range(n)), epoch
    assert torch.isfinite(model.weight).all()


def test_an_iterable_over_shards_feeds_pinned_batches_to_the_gpu_every_sample_once(
    moto: Store, staging_root: str
) -> None:
    from support.shards import put_indexed, tar_of

    from s5loader import S5IterableDataset

    g = torch.Generator().manual_seed(4)
    rows = {f"s{s}-{j:03d}": torch.randn(64, generator=g) for s in range(4) for j in range(50)}
    shards = {
        f"shard-{s}.tar": tar_of(
            [(f"{k}.x", rows[k].numpy().tobytes()) for k in rows if k.startswith(f"s{s}-")]
        )
        for s in range(4)
    }
    source = put_indexed(moto, shards)
    with S5IterableDataset.from_shards(
        source,
        endpoint_url=moto.endpoint,
        shuffle=True,
        seed=1,
        budget=3 * max(map(len, shards.values())),
        staging_dir=staging_root,
        transform=lambda s: (s["__key__"], torch.frombuffer(bytearray(s["x"]), dtype=torch.float32)),
    ) as it:
        seen: list[str] = []
        for keys, x in DataLoader(it, batch_size=16, num_workers=2, pin_memory=True):
            assert x.is_pinned()
            on_gpu = x.cuda(non_blocking=True)
            torch.cuda.synchronize()
            for k, row in zip(keys, on_gpu.cpu(), strict=True):
                assert torch.equal(row, rows[k]), k
            seen += keys
    assert sorted(seen) == sorted(rows)
