"""The prefetch daemon over tar shards against local S3 servers: samples delivered as folders
within the budget, a cut mid-shard continued, member names kept as bytes, gzip shards
unpacked.

Private modules (``s5loader._sampling``, ``s5loader._util``, ``s5loader._daemon``) are imported
only where they are the seam under test; the rest goes through the public API."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.shards import CONSUMER, class_sorted_shards, gzip_shards, make_shards, put_indexed, tar_of
from support.stores import Store, live_bytes, on_disk

from s5loader import BudgetError, S5Dataset


def cache_bytes(cache: Path) -> int:
    """Bytes of samples in a daemon's cache, as :func:`support.stores.on_disk` counts them (the
    files still there once the walk is done): a staged shard's less what was punched out of it
    (the blocks it takes, at most its size), a delivered file's size; not the control files (a
    shard's member table, the lock, the state), which the guide says the budget leaves out."""
    found = []
    for root, _, files in os.walk(cache):
        if "/.calls" not in root:
            skip = (".lock", ".state.json", ".released", ".members")
            found += [os.path.join(root, f) for f in files if f not in skip]
    return live_bytes(found)


def blocks_slack(budget: int, big: int) -> int:
    """The whole 4 KiB blocks beyond the budget's byte count that open shards take on disk (a
    sample's block shared with a neighbour still being read stays; the sampler's tests allow the
    same): one per shard the budget holds open."""
    return 4096 * (budget // big + 1)


def test_the_daemon_delivers_shard_samples_as_folders_within_budget(seaweed: Store, tmp_path) -> None:
    from support.stores import Peak

    from s5loader._daemon import sample_folder_name
    from s5loader._sampling.order import Order
    from s5loader._sampling.units import units_of
    from s5loader._util.platform import punches_holes
    from s5loader.consume import END_MARKER, ready_names

    shards, expected = make_shards(4, 5, size=2000)
    source = put_indexed(seaweed, shards)
    big = max(len(v) for v in shards.values())
    budget = 2 * big + 3000
    cache, out = tmp_path / "cache", tmp_path / "got.jsonl"
    env = dict(os.environ)
    consumer = subprocess.Popen([sys.executable, "-c", CONSUMER, str(cache), str(out)], env=env)

    with Peak(lambda: cache_bytes(cache), interval=0.002) as peak:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "s5loader",
                "prefetch",
                "--shards",
                source,
                "--cache",
                str(cache),
                "--budget",
                str(budget),
                "--endpoint-url",
                seaweed.endpoint,
                "--shuffle",
                "--seed",
                "3",
                "--epochs",
                "2",
                "--samples-per-call",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert r.returncode == 0, r.stderr
        assert consumer.wait(60) == 0
    # the shared shard order (as many shards open as the daemon's state says, counting what the
    # samples written out of a shard give back where the file system punches them out), every epoch
    ds = S5Dataset.from_shards(source, endpoint_url=seaweed.endpoint)
    window = json.loads((cache / ".state.json").read_text())["window"]
    units = units_of(ds)
    cost = units.order_cost() if punches_holes(str(tmp_path)) else None
    want = []
    for epoch in range(2):
        for i in units.plan(Order(True, 3, 1, 0, False), epoch, 0, None, window, cost)[0]:
            want.append(sample_folder_name(len(want), ds[i]["__key__"]))
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["name"] for g in got] == want
    epoch_keys = [sorted(n.split("-", 1)[1] for n in want[e * 20 : (e + 1) * 20]) for e in range(2)]
    assert epoch_keys[0] == epoch_keys[1] == sorted(expected)  # each sample once an epoch
    for g in got:
        key = g["name"].split("-", 1)[1]
        assert g["files"] == {f: hashlib.sha256(v).hexdigest() for f, v in expected[key].items()}
    assert peak.peak <= budget + blocks_slack(budget, big), (peak.peak, budget)
    assert ready_names(str(cache)) == [] and (cache / END_MARKER).exists()
    # a budget that cannot hold a shard beside the delivery window of samples written out of it
    # is refused before any download
    from s5loader._daemon import PrefetchDaemon, PrefetchOptions

    opts = PrefetchOptions.of(
        source, str(tmp_path / "c2"), big + 10, endpoint_url=seaweed.endpoint, shards=True
    )
    with (
        PrefetchDaemon(opts) as p,
        pytest.raises(BudgetError, match=r"shard s3://.*shard-00\d.tar.*must hold at least"),
    ):
        p.open()
    assert not list((tmp_path / "c2" / ".staging").glob("*/tar"))


def test_a_shard_daemon_cut_mid_shard_continues_without_loss_or_repeat(moto: Store, tmp_path) -> None:
    import threading

    from s5loader._daemon import PrefetchDaemon, PrefetchOptions, sample_folder_name
    from s5loader.consume import consume

    shards, expected = make_shards(3, 5, size=1000)
    source = put_indexed(moto, shards)
    big = max(len(v) for v in shards.values())
    cache = tmp_path / "cache"
    opts = PrefetchOptions.of(
        source, str(cache), 2 * big + 2000, endpoint_url=moto.endpoint, shards=True, samples_per_call=1
    )

    class Cut(Exception):
        pass

    class CutAtSeven(PrefetchDaemon):
        def _deliver(self, seq: int, staged) -> int:  # type: ignore[no-untyped-def]
            if seq == 7:  # the third sample of the second shard: the process dies here
                raise Cut()
            return super()._deliver(seq, staged)

    got: list[tuple[str, dict[str, bytes]]] = []

    def consumer() -> None:
        for s in consume(str(cache), timeout=60):
            got.append((s.name, {f: s.read(f) for f in s.files}))

    reader = threading.Thread(target=consumer)
    reader.start()
    with CutAtSeven(opts) as first, pytest.raises(Cut):
        first.open()
        first.run()
    with PrefetchDaemon(opts) as second:
        second.open()
        assert second.summary.resumed_from == 7
        assert second.run().delivered == 8
    reader.join(60)
    keys = sorted(expected)
    assert [name for name, _ in got] == [sample_folder_name(i, k) for i, k in enumerate(keys)]
    for name, files in got:
        assert files == expected[name.split("-", 1)[1]]


def test_a_member_name_that_is_not_utf8_keeps_its_bytes_through_the_daemon(moto: Store, tmp_path) -> None:
    # an old tar's Latin-1 name: tarfile gives it as surrogates, which UTF-8 cannot encode
    from s5loader._daemon import PrefetchDaemon, PrefetchOptions
    from s5loader.consume import consume

    name = b"caf\xe9".decode("utf-8", "surrogateescape")
    data = tar_of([(f"{name}.cls", b"1"), (f"{name}.txt", b"t"), ("plain.cls", b"2")])
    source = put_indexed(moto, {"shard-000.tar": data})
    opts = PrefetchOptions.of(
        source, str(tmp_path / "cache"), 4 * len(data), endpoint_url=moto.endpoint, shards=True
    )
    with PrefetchDaemon(opts) as daemon:
        daemon.open()
        assert daemon.run().delivered == 2
    got, raw = [], []
    for s in consume(str(tmp_path / "cache"), timeout=60):
        got.append((s.key, {f: s.read(f) for f in s.files}))
        with open(os.path.join(s.path, "__key__"), "rb") as fh:
            raw.append(fh.read())
    assert got == [(name, {"cls": b"1", "txt": b"t"}), ("plain", {"cls": b"2"})]
    assert raw == [b"caf\xe9", b"plain"]


def test_the_daemon_unpacks_gzip_shards_within_a_budget_that_counts_their_tar(
    seaweed: Store, tmp_path
) -> None:
    from support.stores import Peak

    source, shards, expected = gzip_shards(seaweed, n_shards=4, per_shard=5)
    tars = {n: len(gzip.decompress(d)) for n, d in shards.items()}
    # a staged shard, its tar beside it, and the samples unpacked from the tar
    budget = max(len(d) + 2 * tars[n] for n, d in shards.items())
    cache, out = tmp_path / "cache", tmp_path / "got.jsonl"
    consumer = subprocess.Popen([sys.executable, "-c", CONSUMER, str(cache), str(out)])
    with Peak(lambda: on_disk(str(cache)), interval=0.002) as peak:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "s5loader",
                "prefetch",
                "--shards",
                source,
                "--cache",
                str(cache),
                "--budget",
                str(budget),
                "--endpoint-url",
                seaweed.endpoint,
                "--shuffle",
                "--seed",
                "3",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert consumer.wait(60) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(g["name"].split("-", 1)[1] for g in got) == sorted(expected)
    for g in got:
        fields = expected[g["name"].split("-", 1)[1]]
        assert {k.rsplit(".", 1)[-1]: v for k, v in g["files"].items()} == {
            f: hashlib.sha256(v).hexdigest() for f, v in fields.items()
        }
    assert 0 < peak.peak <= budget + blocks_slack(budget, max(tars.values())), (peak.peak, budget)
    # a budget that cannot hold the largest shard with its tar beside it
    staged = max(len(d) + tars[n] for n, d in shards.items())
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "s5loader",
            "prefetch",
            "--shards",
            source,
            "--cache",
            str(tmp_path / "c2"),
            "--budget",
            str(staged - 1),
            "--endpoint-url",
            seaweed.endpoint,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "decompressed" in r.stderr and "raise --budget" in r.stderr, r.stderr[-2000:]


def test_a_folder_of_shards_without_shards_flag_gets_a_hint(moto: Store, tmp_path) -> None:
    shards, _ = make_shards(2, 3, size=500)
    source = put_indexed(moto, shards)
    cache = tmp_path / "cache"
    argv = [sys.executable, "-m", "s5loader", "prefetch", source, "--cache", str(cache)]
    r = subprocess.run(
        [*argv, "--budget", "1MB", "--endpoint-url", moto.endpoint],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "holds tar shards" in r.stderr and "pass --shards" in r.stderr and source in r.stderr, r.stderr
    # the delivered samples are the shards, whole (what the hint warns of)
    delivered = [n for n in os.listdir(cache / ".claimed") + os.listdir(cache) if n[:1].isdigit()]
    assert len(delivered) == 3 and all(os.listdir(cache / n) for n in delivered)  # and wids.json
    # with --shards, no hint
    r = subprocess.run(
        [*argv, "--fresh", "--shards", "--budget", "1MB", "--endpoint-url", moto.endpoint],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "holds tar shards" not in r.stderr, r.stderr


def test_the_daemon_mixes_small_samples_as_the_sampler_does_and_bounds_what_its_consumer_holds(
    seaweed: Store, tmp_path
) -> None:
    """Samples of 1 KB written out of class-sorted shards: the daemon keeps open about as many
    shards as ``S5Sampler`` at the same budget (it once kept half: each written-out sample was
    counted as a second copy beside its shard), and what a slow consumer holds of them stays
    near the delivery window, within the budget."""
    import time

    from support.stores import Peak
    from torch.utils.data import DataLoader

    from s5loader import S5Sampler
    from s5loader._sampling.units import units_of
    from s5loader.consume import consume

    source, _, big = class_sorted_shards(seaweed, 16, 24, 1000)
    budget = 6 * big
    ds = S5Dataset.from_shards(source, endpoint_url=seaweed.endpoint)
    window = units_of(ds).delivery_window(budget)
    cache = tmp_path / "cache"

    def held() -> int:  # bytes of delivered samples, in the cache and claimed
        total = 0
        for d in (cache, cache / ".claimed"):
            with contextlib.suppress(OSError):
                for name in [n for n in os.listdir(d) if n[:1].isdigit()]:  # SEQ-KEY folders
                    for f in ("bin", "cls"):
                        with contextlib.suppress(OSError):  # consumed meanwhile
                            total += os.path.getsize(d / name / f)
        return total

    argv = [sys.executable, "-m", "s5loader", "prefetch", "--shards", source, "--cache", str(cache)]
    argv += ["--budget", str(budget), "--shuffle", "--seed", "5", "--endpoint-url", seaweed.endpoint]
    daemon = subprocess.Popen([*argv, "--no-progress"], stderr=subprocess.PIPE, text=True)
    classes = []
    with Peak(held, interval=0.002) as peak, Peak(lambda: cache_bytes(cache), interval=0.002) as total:
        for sample in consume(str(cache), timeout=60):
            classes.append(int(open(sample.files["cls"], "rb").read()))
            time.sleep(0.002)  # slower than the daemon
    assert daemon.wait(60) == 0, daemon.stderr.read() if daemon.stderr else ""
    assert sorted(classes) == sorted(s for s in range(16) for _ in range(24))  # every sample once
    # the copies stay near the window: beyond it only where the budget has room beside what is
    # staged (at the start of the epoch, and at its end, once the pass has staged its last shard:
    # 110.7 KB of a 430 KB budget seen once under load), and all of it within the budget
    assert peak.peak <= budget // 2, (peak.peak, window)
    assert total.peak <= budget + blocks_slack(budget, big), (total.peak, budget)
    with (
        S5Sampler(ds, shuffle=True, seed=5, budget=budget, staging_dir=str(tmp_path)) as sampler,
        pytest.warns(UserWarning, match="holds about 6 of its shards"),
    ):
        ordered = [int(x["cls"]) for x in DataLoader(ds, sampler=sampler, batch_size=None)]

    def per_16(seq: list[int]) -> float:
        return sum(len(set(seq[a : a + 16])) for a in range(0, len(seq) - 15, 16)) / (len(seq) // 16)

    assert per_16(classes) >= 0.9 * per_16(ordered), (per_16(classes), per_16(ordered))
