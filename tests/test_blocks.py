"""Blocks: samples that share a key prefix are fetched with one wildcard line."""

from __future__ import annotations

import os

from support.stores import Store, make_pairs, scratch_folders, staged_samples  # noqa: F401
from torch.utils.data import DataLoader

from s5loader import S5Dataset, S5Sampler


def test_wildcard_lines_never_write_outside(moto: Store, staging_root: str, tmp_path) -> None:
    # a key with ".." that grouping drops, added after the listing, must not be fetched by a
    # wildcard line into ../../ (s5cmd joins keys onto the destination as they are)
    source = moto.put(make_pairs(20, size=50))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    escape = os.path.join(str(tmp_path), "escaped")
    moto.client.put_object(Bucket="data", Key=f"{moto.prefix}000{'/..' * 12}{escape}", Body=b"x")
    moto.client.put_object(Bucket="data", Key=f"{moto.prefix}0005.extra", Body=b"late")
    with S5Sampler(ds, shuffle=False, block_size=10, staging_dir=staging_root) as sampler:
        got = [ds[i] for i in sampler]
    assert sorted(s["__key__"] for s in got) == sorted({k.rsplit(".", 1)[0] for k in source})
    assert all("extra" not in s for s in got)
    assert not os.path.exists(escape)


def test_block_shuffle_end_to_end(seaweed: Store, staging_root: str, tmp_path) -> None:
    source = seaweed.put(make_pairs(120, size=300))
    ds = S5Dataset.from_prefix(seaweed.uri(), endpoint_url=seaweed.endpoint)
    orders = []
    with S5Sampler(
        ds, shuffle="block", block_size=10, samples_per_call=40, staging_dir=staging_root
    ) as sampler:
        files = sampler.write_command_files(str(tmp_path / "plan"))
        text = "".join(open(f).read() for f in files)
        assert text.count("*' ") >= 9  # whole blocks go as wildcard lines
        for epoch in range(2):
            sampler.set_epoch(epoch)
            loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=2, collate_fn=lambda b: b)
            got = [s for b in loader for s in b]
            assert sorted(s["__key__"] for s in got) == sorted({k.rsplit(".", 1)[0] for k in source})
            assert all(s["image"] == source[s["__key__"] + ".image"] for s in got)
            assert all(s["label"] == source[s["__key__"] + ".label"] for s in got)
            orders.append([s["__key__"] for s in got])
            assert staged_samples(sampler.staging_dir) == []
            assert scratch_folders(sampler.staging_dir) == []  # scratch folders gone
    assert orders[0] != orders[1]
    assert orders[0] != sorted(orders[0])


def test_block_shuffle_resume_and_folder_samples(moto: Store, staging_root: str) -> None:
    source = moto.put({f"f{i:03d}/{n}": f"{i}{n}".encode() for i in range(30) for n in ("a.txt", "b.bin")})
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint, group_by="folder")
    full = list(S5Sampler(ds, shuffle="block", seed=4, staging_dir=staging_root, block_size=10))
    s = S5Sampler(ds, shuffle="block", seed=4, staging_dir=staging_root, block_size=10)
    it = iter(s)
    first = [next(it) for _ in range(7)]
    state = s.state_dict()
    s.close()
    r = S5Sampler(ds, shuffle="block", seed=4, staging_dir=staging_root, block_size=10)
    r.load_state_dict(state)
    rest = []
    for idx in r:
        rest.append(idx)
        sample = ds[idx]
        assert sample["a.txt"] == source[sample["__key__"] + "/a.txt"]
    r.close()
    assert first + rest == full


def test_a_block_state_resumes_only_over_the_blocks_it_was_cut_into(moto: Store, staging_root: str) -> None:
    import pytest

    from s5loader import StateError

    moto.put({f"raw/{i:04d}.bin": bytes([i % 251]) * 10 for i in range(120)})
    ds = S5Dataset.from_prefix(moto.uri("raw/"), endpoint_url=moto.endpoint)
    opts = {"shuffle": "block", "seed": 3, "staging_dir": staging_root, "block_size": 64}
    full = list(S5Sampler(ds, **opts))
    s = S5Sampler(ds, **opts)
    it = iter(s)
    first = [next(it) for _ in range(5)]
    state = s.state_dict()
    s.close()
    assert (state["block_size"], state["block_rule"]) == (64, 2)
    with S5Sampler(ds, **{**opts, "block_size": 8}) as other:  # tens, not the hundred: another order
        with pytest.raises(StateError, match=r"64 samples \(rule 2\), this run into blocks of at most 8"):
            other.load_state_dict(state)
    # a state of an s5loader that cut no block past block_size (the hundred 0000-0099 is one now)
    older = {k: v for k, v in state.items() if k not in ("block_size", "block_rule")}
    with S5Sampler(ds, **opts) as r:
        with pytest.raises(StateError, match="an s5loader before blocks could grow"):
            r.load_state_dict(older)
        r.load_state_dict(state)
        assert first + list(r) == full
