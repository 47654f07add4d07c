"""What a new user meets in the first hour: no silent wrong data, no hang, messages that say what
to do. Each test runs the path a user runs (real s5cmd, a real local server, the CLI)."""

from __future__ import annotations

import lzma
import os
import re
import subprocess
import sys

import pytest
from support.stores import Store, free_port, make_pairs
from torch.utils.data import DataLoader

from s5loader import BudgetError, EmptySourceError, S5Dataset, S5Sampler, ShardError


# torch's queue feeder thread complains when a loader's iterator fails while it starts
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_budget_below_the_loaders_batch_is_an_error_at_once(moto: Store, staging_root: str) -> None:
    # 8 pairs of 1 KiB + a label; a budget of 3 samples, a DataLoader batch of 4, and no
    # batch_size= on the sampler: the sampler learns the batch from the loader.
    moto.put(make_pairs(8, size=1024))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    size = ds.samples[0].size
    with S5Sampler(ds, budget=3 * size + 10, staging_dir=staging_root) as sampler:
        loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=2)
        with pytest.raises(BudgetError) as err:  # the first batch is refused, not waited for
            next(iter(loader))
    msg = str(err.value)
    assert "budget" in msg and "batch_size=4" in msg and moto.uri() in msg
    # a batch that fits still runs
    with S5Sampler(ds, budget=4 * size + 10, staging_dir=staging_root) as sampler:
        got = [k for b in DataLoader(ds, sampler=sampler, batch_size=4) for k in b["__key__"]]
    assert sorted(got) == [f"{moto.prefix}{i:04d}" for i in range(8)]


def _classes_layout(store: Store) -> None:
    # the real folder, and siblings that share its name
    store.client.put_object(Bucket=store.bucket, Key=f"{store.prefix}cat/1.jpg", Body=b"c1")
    store.client.put_object(Bucket=store.bucket, Key=f"{store.prefix}dog/2.jpg", Body=b"d2")
    base = store.prefix.rstrip("/")
    store.client.put_object(Bucket=store.bucket, Key=f"{base}-old/cat/9.jpg", Body=b"old")
    store.client.put_object(Bucket=store.bucket, Key=f"{base}val/x/8.jpg", Body=b"val")


def test_a_prefix_without_its_slash_is_the_folder_never_its_siblings(seaweed: Store) -> None:
    _classes_layout(seaweed)
    bare = seaweed.uri().rstrip("/")  # s3://data/t-.../train
    ds = S5Dataset.from_prefix(bare, endpoint_url=seaweed.endpoint, group_by="object", label="folder")
    assert ds.classes == ["cat", "dog"]
    assert sorted(s.key for s in ds.samples) == [f"{seaweed.prefix}cat/1.jpg", f"{seaweed.prefix}dog/2.jpg"]
    assert [ds[i]["label"] for i in range(len(ds))] == [0, 1]


def test_cli_ls_of_a_prefix_without_its_slash(seaweed: Store, capsys: pytest.CaptureFixture[str]) -> None:
    from s5loader.cli import main

    _classes_layout(seaweed)
    assert (
        main(["ls", seaweed.uri().rstrip("/"), "--group-by", "object", "--endpoint-url", seaweed.endpoint])
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("2 samples") and "-old/" not in out and "val/" not in out


def test_an_empty_folder_names_the_keys_beside_it(seaweed: Store) -> None:
    base = seaweed.prefix.rstrip("/")
    seaweed.client.put_object(Bucket=seaweed.bucket, Key=f"{base}-2024/a.jpg", Body=b"a")
    with pytest.raises(EmptySourceError) as err:
        S5Dataset.from_prefix(seaweed.uri().rstrip("/"), endpoint_url=seaweed.endpoint)
    msg = str(err.value)
    assert msg.startswith(f"no object under {seaweed.uri()}")
    assert f"s3://{seaweed.bucket}/{base}-2024/a.jpg" in msg and "names a folder" in msg


def test_a_compressed_shard_is_named_as_such_first(
    seaweed: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    from s5loader.cli import main

    gz = seaweed.uri("shard-000000.tar.xz")  # gzip shards are read; others are named first
    seaweed.put({"shard-000000.tar.xz": lzma.compress(b"\0" * 1024)})
    for source in (gz, [gz], seaweed.uri("shard-{000000..000000}.tar.xz")):
        named = source if isinstance(source, str) else gz
        with pytest.raises(ShardError, match=rf"^{re.escape(named)} is a compressed tar shard .*decompress"):
            S5Dataset.from_shards(source, endpoint_url=seaweed.endpoint)
    # index-shards on it says the same, not "no *.tar shard under" it as if it were a folder
    assert main(["index-shards", gz, "--endpoint-url", seaweed.endpoint]) == 1
    err = capsys.readouterr().err
    assert "is a compressed tar shard" in err and "no *.tar shard under" not in err


def test_an_unreachable_endpoint_says_what_to_check() -> None:
    # a port nobody listens on, as when the local server was not started in this shell
    port = free_port()
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    r = subprocess.run(
        [sys.executable, "-m", "s5loader", "ls", "s3://demo/train/"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 1
    assert f"http://127.0.0.1:{port}" in r.stderr
    assert (
        "AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL or S3_ENDPOINT_URL" in r.stderr
        and "bin/s3-local start" in r.stderr
    )


def test_the_cli_does_not_log_the_aws_libraries_routine(moto: Store) -> None:
    moto.put(make_pairs(2, size=10))
    r = subprocess.run(
        [sys.executable, "-m", "s5loader", "ls", moto.uri(), "--endpoint-url", moto.endpoint],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("2 samples")
    assert "Found credentials" not in r.stderr


def test_index_shards_on_an_object_says_it_is_an_object(
    seaweed: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    from s5loader.cli import main

    seaweed.put({"data.zip": b"PK"})
    assert main(["index-shards", seaweed.uri("data.zip"), "--endpoint-url", seaweed.endpoint]) == 1
    err = capsys.readouterr().err
    assert (
        f"{seaweed.uri('data.zip')} is an object, not a tar shard" in err
        and "no *.tar shard under" not in err
    )


def test_a_near_miss_prefix_names_the_closest_folders(seaweed: Store) -> None:
    from s5loader.cli import main

    base = seaweed.prefix  # ends in "/"
    seaweed.put({"train/0001.jpg": b"a", "train/0001.cls": b"1", "val/0001.jpg": b"b", "test.csv": b"c"})
    typo = f"s3://{seaweed.bucket}/{base}trian/"
    with pytest.raises(EmptySourceError) as err:
        S5Dataset.from_prefix(typo, endpoint_url=seaweed.endpoint)
    msg = str(err.value)
    assert msg.startswith(f"no object under {typo}")
    assert f"did you mean s3://{seaweed.bucket}/{base}train/?" in msg and "val/" not in msg, msg
    # a name nothing is near gets no guess
    with pytest.raises(EmptySourceError) as err:
        S5Dataset.from_prefix(f"s3://{seaweed.bucket}/{base}images/", endpoint_url=seaweed.endpoint)
    assert "did you mean" not in str(err.value)
    # the same hint for shards and from the command line
    with pytest.raises(EmptySourceError, match="did you mean"):
        S5Dataset.from_shards(typo, endpoint_url=seaweed.endpoint)
    assert main(["ls", typo, "--endpoint-url", seaweed.endpoint]) == 1
