"""Access options end to end, through the real s5cmd and real local servers: each option
reaches the listing (s5cmd ls), the staging (s5cmd cp) and the direct GET (boto3), as a
recording proxy in front of the server sees them.

Private modules (``s5loader._index``, ``s5loader._daemon``) are imported only where they are the
seam under test; the rest goes through the public API."""

from __future__ import annotations

import json
import logging
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.faults import FaultProxy
from support.stores import Store, make_pairs

from s5loader import Access, S5Dataset, S5Sampler
from s5loader._index.listing import _list_boto3
from s5loader.exceptions import AccessDeniedError, EndpointError


@pytest.fixture
def proxy(moto: Store) -> Iterator[FaultProxy]:
    p = FaultProxy(moto.endpoint)
    yield p
    p.close()


def through_every_path(ds: S5Dataset, staging_root: str, data: dict[str, bytes]) -> None:
    """Stage every sample with the sampler (s5cmd), then read one directly (boto3)."""
    with S5Sampler(ds, staging_dir=staging_root, shuffle=False, samples_per_call=2) as sampler:
        staged = {ds[i]["__key__"] for i in sampler}
    assert staged == {s.key for s in ds.samples}
    direct = ds[0]  # a plain index: not staged, so a GET through boto3
    assert direct["image"] == data[ds.samples[0].key + ".image"]


def kinds(proxy: FaultProxy) -> set[str]:
    """Which paths the recorded requests took: s5cmd's listing and copies, boto3's GETs."""
    out = set()
    for method, path, headers in proxy.requests:
        agent = headers.get("user-agent", "")
        client = "boto3" if "Boto3" in agent or "Botocore" in agent else "s5cmd"
        out.add(f"{client} {'list' if '?' in path and 'prefix=' in path else method}")
    return out


EVERY_PATH = {"s5cmd list", "s5cmd GET", "boto3 GET"}


def test_anonymous_reaches_a_public_store_unsigned(moto: Store, proxy: FaultProxy, staging_root: str) -> None:
    data = moto.put(make_pairs(3))
    for key in data:  # a public data set: moto lists for anyone, and serves objects anyone may read
        moto.client.put_object_acl(Bucket=moto.bucket, Key=key, ACL="public-read")
    ds = S5Dataset.from_prefix(moto.uri(), access=Access(proxy.endpoint, anonymous=True))
    through_every_path(ds, staging_root, data)
    assert EVERY_PATH <= kinds(proxy)
    signed = [(m, p) for m, p, h in proxy.requests if "authorization" in h or "x-amz-signature" in p.lower()]
    assert not signed


KEY, SECRET = "AKIATRAINPROFILE0001", "train-secret"


@pytest.fixture(scope="module")
def private_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """A SeaweedFS that answers only requests signed with one key (403 otherwise), as a
    private bucket does; the shared test servers accept anything."""
    from s5loader.testing import SeaweedFS

    with SeaweedFS(str(tmp_path_factory.mktemp("weed-private")), ("data",), identity=(KEY, SECRET)) as server:
        yield Store("private", server.endpoint, "data", "train/")


def _put(store: Store, objects: dict[str, bytes]) -> dict[str, bytes]:
    import boto3

    c = boto3.client(
        "s3",
        endpoint_url=store.endpoint,
        region_name="us-east-1",
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
    )
    for k, v in objects.items():
        c.put_object(Bucket=store.bucket, Key=store.prefix + k, Body=v)
    return {store.prefix + k: v for k, v in objects.items()}


def _credentials(tmp_path: Path) -> str:
    path = tmp_path / "credentials"
    path.write_text(
        "[default]\naws_access_key_id = AKIAWRONGDEFAULT0001\naws_secret_access_key = wrong-secret\n\n"
        f"[train]\naws_access_key_id = {KEY}\naws_secret_access_key = {SECRET}\n"
    )
    return str(path)


def test_anonymous_against_a_private_store_is_a_clear_error(private_store: Store) -> None:
    _put(private_store, make_pairs(1))
    anonymous = Access(private_store.endpoint, anonymous=True)
    with pytest.raises(AccessDeniedError, match=re.escape(private_store.uri())):
        S5Dataset.from_prefix(private_store.uri(), access=anonymous)  # s5cmd ls
    with pytest.raises(AccessDeniedError, match=re.escape(private_store.uri("0000.image"))):
        S5Dataset.from_objects([private_store.uri("0000.image")], access=anonymous)  # boto3 HEAD


def test_profile_and_credentials_file_reach_both_clients(
    private_store: Store, staging_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _put(private_store, make_pairs(3))
    creds = _credentials(tmp_path)
    # The file's default profile holds keys the store refuses; the profile "train" its own.
    with pytest.raises(AccessDeniedError, match=re.escape(private_store.uri())):
        S5Dataset.from_prefix(
            private_store.uri(), access=Access(private_store.endpoint, credentials_file=creds)
        )
    with pytest.raises(AccessDeniedError, match=re.escape(private_store.uri("0000.image"))):
        S5Dataset.from_objects(
            [private_store.uri("0000.image")], access=Access(private_store.endpoint, credentials_file=creds)
        )
    ds = S5Dataset.from_prefix(
        private_store.uri(), access=Access(private_store.endpoint, profile="train", credentials_file=creds)
    )
    through_every_path(ds, staging_root, data)
    # The standard environment: AWS_PROFILE and AWS_SHARED_CREDENTIALS_FILE, for both clients.
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", creds)
    monkeypatch.setenv("AWS_PROFILE", "train")
    ds = S5Dataset.from_prefix(private_store.uri(), endpoint_url=private_store.endpoint)
    through_every_path(ds, staging_root, data)


def test_region_signs_every_request(moto: Store, proxy: FaultProxy, staging_root: str) -> None:
    data = moto.put(make_pairs(3))
    ds = S5Dataset.from_prefix(moto.uri(), access=Access(proxy.endpoint, region="eu-west-3"))
    through_every_path(ds, staging_root, data)
    assert EVERY_PATH <= kinds(proxy)
    scopes = {
        re.search(r"Credential=[^/]+/\d+/([^/]+)/s3/", h.get("authorization", ""))
        for _, _, h in proxy.requests
    }
    assert {m.group(1) if m else None for m in scopes} == {"eu-west-3"}


def test_requester_pays_header_on_every_request(moto: Store, proxy: FaultProxy, staging_root: str) -> None:
    data = moto.put(make_pairs(3))
    ds = S5Dataset.from_prefix(moto.uri(), access=Access(proxy.endpoint, requester_pays=True))
    through_every_path(ds, staging_root, data)
    S5Dataset.from_objects(
        [moto.uri("0000.image")], access=Access(proxy.endpoint, requester_pays=True)
    )  # HEAD
    assert EVERY_PATH | {"boto3 HEAD"} <= kinds(proxy)
    unpaid = [(m, p) for m, p, h in proxy.requests if h.get("x-amz-request-payer") != "requester"]
    assert not unpaid


def test_list_objects_v1_and_path_style(moto: Store, proxy: FaultProxy, staging_root: str) -> None:
    data = moto.put(make_pairs(3))
    old_store = Access(proxy.endpoint, list_objects_v1=True, addressing_style="path")
    ds = S5Dataset.from_prefix(moto.uri(), access=old_store)
    through_every_path(ds, staging_root, data)
    assert (
        len(list(_list_boto3(moto.bucket, moto.prefix, old_store))) == 6
    )  # the API listing, for glob prefixes
    lists = [p for m, p, _ in proxy.requests if "prefix=" in p]
    assert {"s5cmd list", "boto3 list"} <= kinds(proxy)
    assert lists and not [p for p in lists if "list-type=2" in p]  # ListObjectsV2 sends list-type=2
    host = proxy.endpoint.split("://", 1)[1]
    assert {h["host"] for _, _, h in proxy.requests} == {host}
    assert all(p.startswith(f"/{moto.bucket}") for _, p, _ in proxy.requests)


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("tls")
    cert, key = str(d / "cert.pem"), str(d / "key.pem")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            key,
            "-out",
            cert,
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_self_signed_tls_store(
    moto: Store, self_signed: tuple[str, str], staging_root: str, caplog: pytest.LogCaptureFixture
) -> None:
    data = moto.put(make_pairs(3))
    tls = FaultProxy(moto.endpoint, tls=self_signed)
    try:
        assert tls.endpoint.startswith("https://")
        with pytest.raises(EndpointError, match=r"s3://data/train/.*verify_ssl=False"):
            S5Dataset.from_prefix(moto.uri(), endpoint_url=tls.endpoint)  # s5cmd ls
        with pytest.raises(EndpointError, match=r"s3://data/train/0000.image.*verify_ssl=False"):
            S5Dataset.from_objects([moto.uri("0000.image")], endpoint_url=tls.endpoint)  # boto3 HEAD
        assert not tls.requests
        with caplog.at_level(logging.WARNING, logger="s5loader"):
            ds = S5Dataset.from_prefix(moto.uri(), access=Access(tls.endpoint, verify_ssl=False))
            through_every_path(ds, staging_root, data)
        assert any("TLS certificate verification is off" in r.getMessage() for r in caplog.records)
        assert EVERY_PATH <= kinds(tls)
    finally:
        tls.close()


def test_daemon_and_fetch_take_the_access_flags(private_store: Store, tmp_path: Path) -> None:
    from s5loader._daemon import PrefetchDaemon, build_parser, options_from_args
    from s5loader.fetch import main as fetch_main

    data = _put(private_store, make_pairs(3))
    flags = [
        "--endpoint-url",
        private_store.endpoint,
        "--profile",
        "train",
        "--credentials-file",
        _credentials(tmp_path),
    ]
    args = build_parser().parse_args(
        [private_store.uri(), "--cache", str(tmp_path / "cache"), "--budget", "1MiB", *flags]
    )
    with PrefetchDaemon(options_from_args(args)) as p:
        p.open()
        assert p.run().delivered == 3
    key = private_store.prefix + "0001.image"
    assert fetch_main([f"s3://{private_store.bucket}/{key}", str(tmp_path / "out"), "--verify", *flags]) == 0
    assert (tmp_path / "out").read_bytes() == data[key]  # one object: DEST is the file
    with pytest.raises(AccessDeniedError, match=re.escape(private_store.uri())):
        fetch_main(
            [
                private_store.uri(),
                str(tmp_path / "denied"),
                "--endpoint-url",
                private_store.endpoint,
                "--no-sign-request",
            ]
        )


def test_bench_takes_the_access_flags(private_store: Store, tmp_path: Path) -> None:
    from s5loader_bench import cli as bench

    _put(private_store, make_pairs(8))
    out = tmp_path / "r.json"
    argv = [
        private_store.uri(),
        "--endpoint-url",
        private_store.endpoint,
        "--profile",
        "train",
        "--credentials-file",
        _credentials(tmp_path),
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--num-workers",
        "0",
        "--samples-per-call",
        "4",
        "--methods",
        "s5loader,boto3,s5cmd-run,s3torchconnector",
        "--json",
        str(out),
    ]
    assert bench.main(argv) == 0
    by = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert [by[m]["status"] for m in ("s5loader", "boto3", "s5cmd-run")] == ["ok"] * 3, by
    assert by["s3torchconnector"]["status"] == "skipped"  # not installed, or not given the access options
