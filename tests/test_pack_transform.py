"""``s5loader pack --transform``: a user function run on each sample while packing, in worker
processes, against a local SeaweedFS and the real s5cmd: the shards hold what it returns, byte
for byte; a rerun with it makes the same shards; a pack killed midway continues; another
function is another pack; its errors name the sample."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from support.stores import Store, make_pairs
from support.transforms import fails_on_0003, upper_and_digest
from support.waits import wait_for
from test_pack import as_dict, listed, read_back

import s5loader
from s5loader import ConfigError

TESTS = str(Path(__file__).resolve().parent)


def expected(objects: dict[str, bytes], prefix: str) -> dict[str, dict[str, bytes]]:
    out = {}
    for i in range(len(objects) // 2):
        image, label = objects[f"{prefix}{i:04d}.image"], objects[f"{prefix}{i:04d}.label"]
        out[f"{i:04d}"] = {
            "image": image[::-1],
            "label": str(int(label)).encode(),
            "sha": hashlib.sha256(image).hexdigest().encode(),
        }
    return out


def shards_of(store: Store, prefix: str) -> dict[str, bytes]:
    return {k: v for k, v in listed(store, prefix).items() if k.endswith(".tar")}


def test_the_shards_hold_what_the_transform_returns_and_a_rerun_makes_the_same(
    seaweed: Store, tmp_path: Path
) -> None:
    objects = seaweed.put(make_pairs(30, size=1500))
    src = seaweed.uri()
    kw = {
        "shard_size": "8KB",
        "budget": "40KB",
        "shuffle": True,
        "seed": 2,
        "endpoint_url": seaweed.endpoint,
        "staging_dir": str(tmp_path),
        "transform": upper_and_digest,
        "transform_workers": 2,
    }
    first = s5loader.pack(src, src.replace("/train/", "/t1/"), **kw)
    assert first.samples == 30 and first.shards > 3
    got = as_dict(read_back(src.replace("/train/", "/t1/"), seaweed.endpoint))
    assert got == expected(objects, seaweed.prefix)
    again = s5loader.pack(src, src.replace("/train/", "/t2/"), **kw)
    assert again.shards == first.shards
    one = shards_of(seaweed, seaweed.prefix.replace("/train/", "/t1/"))
    two = shards_of(seaweed, seaweed.prefix.replace("/train/", "/t2/"))
    assert one == two and len(one) == first.shards  # byte for byte
    assert os.listdir(tmp_path) == []
    # the same DEST with another function (or none) is another pack: refused, nothing written
    with pytest.raises(ConfigError):
        s5loader.pack(src, src.replace("/train/", "/t1/"), **{**kw, "transform": fails_on_0003})
    with pytest.raises(ConfigError):
        s5loader.pack(src, src.replace("/train/", "/t1/"), **{**kw, "transform": None})


def test_a_pack_with_a_transform_killed_midway_continues(seaweed: Store, tmp_path: Path) -> None:
    objects = seaweed.put(make_pairs(40, size=1500))
    src, dest = seaweed.uri(), seaweed.uri().replace("/train/", "/tk/")
    dest_prefix = seaweed.prefix.replace("/train/", "/tk/")
    args = [src, dest, "--shard-size", "6KB", "--budget", "30KB", "--endpoint-url", seaweed.endpoint]
    args += ["--staging-dir", str(tmp_path), "--transform", "support.transforms:upper_and_digest"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "s5loader", "pack", *args, "--workers", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )

    def two_shards_done() -> bool:
        assert proc.poll() is None, "the pack ended before it could be killed"
        done = seaweed.client.list_objects_v2(Bucket=seaweed.bucket, Prefix=dest_prefix + ".s5pack/done/")
        return len(done.get("Contents", [])) >= 2

    wait_for(two_shards_done, 120, "two shards packed", interval=0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    def others() -> list[int]:  # the killed pack's transform workers (forked: the same command line)
        return [
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if p.pid != os.getpid() and str(tmp_path) in " ".join(p.info["cmdline"] or ())
        ]

    wait_for(lambda: others() == [], 30, "the killed pack's transform workers to end")
    r = subprocess.run(
        [sys.executable, "-m", "s5loader", "pack", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert as_dict(read_back(dest, seaweed.endpoint)) == expected(objects, seaweed.prefix)


def test_a_transform_that_fails_names_the_sample_and_one_that_cannot_run_is_refused(
    seaweed: Store, tmp_path: Path
) -> None:
    seaweed.put(make_pairs(6, size=500))
    src = seaweed.uri()
    kw = {"endpoint_url": seaweed.endpoint, "staging_dir": str(tmp_path)}
    with pytest.raises(ValueError, match="cannot read this one") as info:
        s5loader.pack(src, src.replace("/train/", "/tf/"), transform=fails_on_0003, **kw)
    assert any("0003" in note for note in getattr(info.value, "__notes__", [])), info.value
    with pytest.raises(ConfigError, match="module-level function"):
        s5loader.pack(src, src.replace("/train/", "/tl/"), transform=lambda s: s, **kw)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "s5loader",
            "pack",
            src,
            src.replace("/train/", "/tm/"),
            "--transform",
            "nope",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "MODULE:FUNCTION" in r.stderr and "Traceback" not in r.stderr, r.stderr
