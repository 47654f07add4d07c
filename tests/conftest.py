"""Shared fixtures: real S3 servers on loopback (moto's ThreadedMotoServer and SeaweedFS), a
store per test on them, a staging root. The helpers the tests share are in ``tests/support``."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.stores import Store, free_port
from support.tiers import unit_tier_guard  # noqa: F401 (an autouse fixture for tests/unit)

# Dummy credentials: both servers accept any. Set before anything reads the AWS chain.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing-secret")
os.environ.setdefault("AWS_REGION", "us-east-1")
for _var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "S3_ENDPOINT_URL", "AWS_PROFILE"):
    os.environ.pop(_var, None)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="session")
def seaweed_server() -> Iterator[str]:
    from s5loader.testing import SeaweedFS

    with tempfile.TemporaryDirectory(prefix="s5loader-test-weed-") as d:
        with SeaweedFS(d, ("data",)) as server:
            yield server.endpoint


@pytest.fixture
def moto(moto_server: str) -> Store:
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{moto_server}/moto-api/reset", method="POST")).close()
    store = Store("moto", moto_server, "data", "train/")
    store.client.create_bucket(Bucket="data")
    return store


@pytest.fixture
def seaweed(seaweed_server: str) -> Store:
    return Store("seaweedfs", seaweed_server, "data", f"t-{uuid.uuid4().hex[:8]}/train/")


@pytest.fixture(params=["moto", "seaweedfs"])
def store(request: pytest.FixtureRequest) -> Store:
    """Each test that takes ``store`` runs against both servers."""
    return request.getfixturevalue("moto" if request.param == "moto" else "seaweed")


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """An empty folder with a short path, for a child's TMPDIR: torch's DataLoader workers hand
    batches over AF_UNIX sockets made in TMPDIR, whose path may not exceed 107 bytes, and
    pytest's ``tmp_path`` (deeper still under pytest-xdist) can; a longer one drops the batch
    and the loader waits for it forever."""
    path = Path(tempfile.mkdtemp(prefix="s5t-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def staging_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("staging"))


@pytest.fixture
def counting_proxy(seaweed_server: str) -> Iterator[Any]:
    """The bench's request-counting proxy (no added latency) in front of the session's SeaweedFS."""
    from s5loader_bench.proxy import LatencyProxy

    host, port = seaweed_server.rsplit("/", 1)[-1].split(":")
    p = LatencyProxy(host, int(port), delay_s=0.0).start_thread()
    yield p
    p.stop()
