"""Hostile keys, failing servers and bad input: clear errors, nothing lost, nothing escapes."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import psutil
import pytest
from support.faults import FaultProxy, Rule
from support.stores import Store, make_pairs
from torch.utils.data import DataLoader

from s5loader import (
    AccessDeniedError,
    ConfigError,
    EndpointError,
    FetchError,
    ManifestError,
    ObjectNotFoundError,
    S5Dataset,
    S5Sampler,
)
from s5loader.testing import SeaweedFS

HOSTILE = [
    "sp ace.bin",
    "tab\there.bin",
    "q'uote.bin",
    'dq"uote.bin',
    "back\\slash.bin",
    "star*.bin",
    "what?.bin",
    "br[acket].bin",
    "hash#.bin",
    "dollar$HOME.bin",
    "semi;colon.bin",
    "-leading.bin",
    "a/../b.bin",
    "../up.bin",
    "../../../../etc/passwd",
    "/abs.bin",
    "ünïcødé-日本.bin",
    "L" * 900 + ".bin",
    "Case.bin",
    "case.bin",
    "%41percent.bin",
    "plus+sign.bin",
    "amp&.bin",
    "trail space .bin",
    "$(touch pwned).bin",
    "`id`.bin",
    "x' ; rm -rf / ; '.bin",
]


def collate(b):
    return b


def load_all(ds: S5Dataset, staging_dir: str, **kw) -> list[dict]:
    with S5Sampler(ds, staging_dir=staging_dir, samples_per_call=5, **kw) as sampler:
        return [
            s
            for b in DataLoader(ds, sampler=sampler, batch_size=3, num_workers=2, collate_fn=collate)
            for s in b
        ]


def test_hostile_keys_load_with_right_bytes_and_stay_inside(moto: Store, tmp_path) -> None:
    source = moto.put({k: f"content of {k!r}".encode() for k in HOSTILE})
    parent = tmp_path / "a" / "b" / "c" / "parent"
    root = parent / "staging"
    root.mkdir(parents=True)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint, group_by="object")
    assert sorted(s.key for s in ds.samples) == sorted(source)
    got = load_all(ds, str(root))
    assert sorted(s["__key__"] for s in got) == sorted(source)
    for s in got:
        assert s["data"] == source[s["__key__"]], s["__key__"]
    assert os.listdir(parent) == ["staging"] and os.listdir(root) == []  # nothing written outside
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    assert not os.path.exists("pwned.bin") and not os.path.exists(os.path.join(str(tmp_path), "pwned.bin"))


def test_hostile_stems_group_and_load(moto: Store, staging_root: str) -> None:
    stems = ["a b", "q'x", 'd"q', "s*t", "h#", "$(x)", "-lead", "ü日"]
    source = moto.put({f"{s}.{field}": f"{s}/{field}".encode() for s in stems for field in ("jpg", "cls")})
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint, group_by="stem")
    got = load_all(ds, staging_root)
    assert sorted(s["__key__"] for s in got) == sorted(moto.prefix + s for s in stems)
    for s in got:
        assert s["jpg"] == source[s["__key__"] + ".jpg"] and s["cls"] == source[s["__key__"] + ".cls"]


def test_newline_keys_fetched_aside_and_injection_deletes_nothing(seaweed: Store, staging_root: str) -> None:
    victim = seaweed.put({"victim.bin": b"must survive"})
    evil = [
        "new\nline.bin",
        f"x'\nrm s3://{seaweed.bucket}/{seaweed.prefix}victim.bin\n'.bin",
        f"y\nrm -rf {staging_root}\n.bin",
    ]
    seaweed.put({k: k.encode() for k in evil})
    ds = S5Dataset.from_prefix(seaweed.uri(), endpoint_url=seaweed.endpoint, group_by="object")
    listed = {s.key: s for s in ds.samples}
    assert len(listed) == 4
    got = load_all(ds, staging_root)
    assert len(got) == 4
    by_key = {s["__key__"]: s["data"] for s in got}
    for key, data in by_key.items():
        if "victim" in key and "\n" not in key:
            assert data == b"must survive"
        else:
            assert b"\n" in data  # each newline key came back with its own bytes
    c = seaweed.client
    assert c.get_object(Bucket=seaweed.bucket, Key=list(victim)[0])["Body"].read() == b"must survive"
    assert os.path.isdir(staging_root)


@pytest.fixture
def proxy(moto: Store):
    p = FaultProxy(moto.endpoint)
    yield p
    p.close()


def via(proxy: FaultProxy, moto: Store) -> Store:
    return Store("proxy", proxy.endpoint, moto.bucket, moto.prefix)


def test_transient_503_500_truncation_and_drops_are_retried(
    moto: Store, proxy: FaultProxy, staging_root: str
) -> None:
    source = moto.put(make_pairs(20, size=2000))
    proxy.rules += [
        Rule("0003.image", "503", times=6),
        Rule("0005.image", "500", times=6),
        Rule("0007.image", "truncate", times=6),
        Rule("0009.label", "drop", times=6),
    ]
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=proxy.endpoint)
    got = load_all(ds, staging_root, retries=4, verify=True)
    assert sorted(s["__key__"] for s in got) == sorted({k.rsplit(".", 1)[0] for k in source})
    for s in got:
        assert s["image"] == source[s["__key__"] + ".image"]
    assert all(r.hits >= 4 for r in proxy.rules), [(r.match, r.hits) for r in proxy.rules]


def test_corruption_caught_by_verify(moto: Store, proxy: FaultProxy, staging_root: str) -> None:
    source = moto.put(make_pairs(6, size=1000))
    proxy.rules.append(Rule("0002.image", "corrupt", times=1))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=proxy.endpoint)
    got = load_all(ds, staging_root, verify=True)
    assert all(s["image"] == source[s["__key__"] + ".image"] for s in got)
    proxy.rules.append(Rule("0004.image", "corrupt"))  # always corrupt: a clear error after retries
    with pytest.raises(FetchError, match=r"s3://data/train/0004.image.*MD5 mismatch"):
        load_all(ds, staging_root, verify=True, retries=1)


def test_forbidden_object_raise_or_skip(moto: Store, proxy: FaultProxy, staging_root: str, caplog) -> None:
    source = moto.put(make_pairs(10, size=100))
    proxy.rules.append(Rule("0004.label", "403"))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=proxy.endpoint)
    with pytest.raises(AccessDeniedError, match=r"s3://data/train/0004.label.*Access ?Denied"):
        load_all(ds, staging_root)
    caplog.set_level(logging.WARNING)
    with S5Sampler(ds, staging_dir=staging_root, on_error="skip") as sampler:
        got = [s for b in DataLoader(ds, sampler=sampler, batch_size=3, collate_fn=collate) for s in b]
        assert sampler.stats is not None and sampler.stats.skipped == ["s3://data/train/0004.label"]
    assert sorted(s["__key__"] for s in got) == sorted({k.rsplit(".", 1)[0] for k in source} - {"train/0004"})
    assert "s3://data/train/0004.label" in caplog.text and "skipped 1 sample" in caplog.text


def test_object_gone_after_listing(moto: Store, staging_root: str) -> None:
    moto.put(make_pairs(8, size=100))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    moto.client.delete_object(Bucket="data", Key="train/0006.image")
    with pytest.raises(ObjectNotFoundError, match="s3://data/train/0006.image"):
        load_all(ds, staging_root)
    got = load_all(ds, staging_root, on_error="skip")
    assert len(got) == 7 and "train/0006" not in {s["__key__"] for s in got}


def test_bad_input_errors(moto: Store, proxy: FaultProxy, tmp_path, staging_root: str) -> None:
    moto.put(make_pairs(3))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('"s3://data/train/0000.image"\n{"uri": "s3://data/train/0001.image"}\n{broken\n')
    with pytest.raises(ManifestError, match=r"m.jsonl line 3: not valid JSON"):
        S5Dataset.from_manifest(str(manifest), endpoint_url=moto.endpoint)
    manifest.write_text('"s3://data/train/0000.image"\n"http://elsewhere/x"\n')
    with pytest.raises(ManifestError, match=r"line 2: not an s3 URI"):
        S5Dataset.from_manifest(str(manifest), endpoint_url=moto.endpoint)
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    for bad in (
        {"samples_per_call": 0},
        {"samples_per_call": -3},
        {"calls_in_flight": 0},
        {"budget": "lots"},
        {"budget": -1},
        {"on_error": "ignore"},
        {"stall_timeout": 0},
    ):
        with pytest.raises(ConfigError):
            S5Sampler(ds, staging_dir=staging_root, **bad)
    proxy.rules.append(Rule("", "badkey", method="*"))
    with pytest.raises(AccessDeniedError, match=r"s3://data/train/.*InvalidAccessKeyId"):
        S5Dataset.from_prefix(moto.uri(), endpoint_url=proxy.endpoint)
    with pytest.raises(EndpointError, match=r"s3://data/train/.*(refused|dial)"):
        S5Dataset.from_prefix(moto.uri(), endpoint_url="http://127.0.0.1:9")


def test_error_in_worker_process_keeps_type_and_uri(moto: Store) -> None:
    moto.put(make_pairs(4))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    moto.client.delete_object(Bucket="data", Key="train/0002.label")
    # no sampler: the worker fetches directly and meets the 404
    with pytest.raises(ObjectNotFoundError, match="s3://data/train/0002.label"):
        list(DataLoader(ds, batch_size=1, num_workers=2))


def test_s5cmd_killed_mid_call_recovers(seaweed: Store, staging_root: str) -> None:
    source = seaweed.put(make_pairs(300, size=3000))
    ds = S5Dataset.from_prefix(seaweed.uri(), endpoint_url=seaweed.endpoint)
    killed = []

    def killer() -> None:
        deadline = time.monotonic() + 20
        while not killed and time.monotonic() < deadline:
            for p in psutil.Process().children(recursive=True):
                try:
                    if p.name() == "s5cmd" and staging_root in " ".join(p.cmdline()):
                        p.send_signal(signal.SIGKILL)
                        killed.append(p.pid)
                        return
                except psutil.Error:
                    pass
            time.sleep(0.005)

    t = threading.Thread(target=killer)
    with S5Sampler(ds, staging_dir=staging_root, samples_per_call=100, calls_in_flight=1) as sampler:
        t.start()
        got = [
            s
            for b in DataLoader(ds, sampler=sampler, batch_size=4, num_workers=2, collate_fn=collate)
            for s in b
        ]
        t.join()
        assert killed
        assert sampler.stats is not None and sampler.stats.retries > 0
    assert sorted(s["__key__"] for s in got) == sorted({k.rsplit(".", 1)[0] for k in source})
    assert all(s["image"] == source[s["__key__"] + ".image"] for s in got)


def test_server_restarted_mid_epoch(tmp_path, staging_root: str) -> None:
    server = SeaweedFS(str(tmp_path / "weed"), ("data",)).start()
    try:
        store = Store("own", server.endpoint, "data", "train/")
        source = store.put(make_pairs(60, size=500))
        ds = S5Dataset.from_prefix(store.uri(), endpoint_url=store.endpoint)
        got = []
        with S5Sampler(
            ds,
            staging_dir=staging_root,
            samples_per_call=4,
            calls_in_flight=1,
            budget=8 * 600,
            retries=8,
            stall_timeout=5,
        ) as sampler:
            for i, b in enumerate(DataLoader(ds, sampler=sampler, batch_size=2, collate_fn=collate)):
                got += b
                if i == 3:
                    server.restart()
        assert sorted(s["__key__"] for s in got) == sorted({k.rsplit(".", 1)[0] for k in source})
        assert all(s["image"] == source[s["__key__"] + ".image"] for s in got)
    finally:
        server.stop()


def test_staging_directory_removed_by_someone_else(seaweed: Store, staging_root: str) -> None:
    import subprocess

    source = seaweed.put(make_pairs(40, size=500))
    ds = S5Dataset.from_prefix(seaweed.uri(), endpoint_url=seaweed.endpoint)
    got = []
    with S5Sampler(ds, staging_dir=staging_root, samples_per_call=5, budget=10 * 600) as sampler:
        for i, b in enumerate(DataLoader(ds, sampler=sampler, batch_size=2, collate_fn=collate)):
            got += b
            if i == 2:
                # s5cmd may add files while rm walks the tree ("Directory not
                # empty"): remove until it is gone, as a person would.
                for _ in range(20):
                    if subprocess.run(["rm", "-rf", sampler.staging_dir]).returncode == 0:
                        break
                else:
                    pytest.fail("rm -rf never removed the staging directory")
    assert sorted(s["__key__"] for s in got) == sorted({k.rsplit(".", 1)[0] for k in source})
    assert all(s["image"] == source[s["__key__"] + ".image"] for s in got)


def test_secrets_never_written_logged_or_shown(moto: Store, staging_root: str, monkeypatch, caplog) -> None:
    secret = "SECRETsecret1234567890abcdefXYZ"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDSECRETID0000")
    caplog.set_level(logging.DEBUG)
    moto.put(make_pairs(60, size=2000))
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    seen_argv, seen_files, modes = [], [], []
    with S5Sampler(ds, staging_dir=staging_root, samples_per_call=10, calls_in_flight=2) as sampler:
        for idx in sampler:
            for p in psutil.Process().children(recursive=True):
                try:
                    seen_argv.append(" ".join(p.cmdline()))
                except psutil.Error:
                    pass
            # command files: in each staging pass's folder, PASS/.calls/
            for calls in (r for r, _, _ in os.walk(sampler.staging_dir) if os.path.basename(r) == ".calls"):
                for name in os.listdir(calls) if os.path.isdir(calls) else []:
                    try:
                        with open(os.path.join(calls, name)) as f:
                            seen_files.append(f.read())
                        modes.append(os.stat(os.path.join(calls, name)).st_mode & 0o777)
                    except FileNotFoundError:
                        pass
            ds[idx]  # read and release, as a worker would
        assert os.stat(sampler.staging_dir).st_mode & 0o077 == 0  # not readable by others
    assert any("s5cmd" in a for a in seen_argv) and seen_files
    assert all(m == 0o600 for m in modes)
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("s5loader"))
    assert "staged" in ours  # s5loader did log at DEBUG and INFO
    for text in seen_argv + seen_files + [ours]:
        assert secret not in text and "AKIDSECRETID0000" not in text


def test_profile_secrets_stay_in_the_credentials_file(
    moto: Store, staging_root: str, tmp_path, caplog
) -> None:
    from s5loader import Access

    secret = "PROFILEsecret0987654321zyxwvuQRS"
    creds = tmp_path / "credentials"
    creds.write_text(f"[p]\naws_access_key_id = AKIDPROFILE00000\naws_secret_access_key = {secret}\n")
    caplog.set_level(logging.DEBUG)
    moto.put(make_pairs(20, size=2000))
    ds = S5Dataset.from_prefix(
        moto.uri(), access=Access(moto.endpoint, profile="p", credentials_file=str(creds))
    )
    seen_argv = []
    with S5Sampler(ds, staging_dir=staging_root, samples_per_call=5) as sampler:
        for idx in sampler:
            for p in psutil.Process().children(recursive=True):
                try:
                    seen_argv.append(" ".join(p.cmdline()))
                except psutil.Error:
                    pass
            ds[idx]
    assert any("--profile p" in a and f"--credentials-file {creds}" in a for a in seen_argv)
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("s5loader"))
    for text in seen_argv + [ours, str(ds.access), repr(ds.access)]:
        assert secret not in text and "AKIDPROFILE00000" not in text
