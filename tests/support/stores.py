"""What the real-path tests share: a bucket on a local server with a fresh prefix per test
(:class:`Store`), a toy data set, and measurements of a staging directory while it runs."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import boto3
import pytest


@contextlib.contextmanager
def mount_tmpfs(size: str, prefix: str = "s5loader-smallfs-") -> Iterator[str]:
    """A tmpfs of ``size`` (``"256k"``, ``"4m"``) mounted for a test (as root), removed after;
    the test is skipped where no tmpfs can be mounted."""
    d = tempfile.mkdtemp(prefix=prefix)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", d], capture_output=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", d])
        os.rmdir(d)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_disk(path: str) -> int:
    """Bytes the staged files below ``path`` take now (not the control files): a tar shard whose
    read samples were punched out counts the blocks it still takes, at most its size.

    The files found are looked at again once the walk is done, and only those still there count:
    a walk is not a snapshot, and under load a file deleted behind it and one made ahead of it (a
    shard released, then the next one staged in its room) would otherwise both count, as if they
    had been on disk together."""
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d != ".calls"]
        found += [os.path.join(root, f) for f in files if not f.startswith(".")]
    return live_bytes(found)


def live_bytes(paths: list[str]) -> int:
    """The bytes of the ``paths`` that are still there (see :func:`on_disk`), each file once."""
    seen: dict[int, int] = {}
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(p)
            seen[st.st_ino] = min(st.st_size, st.st_blocks * 512)
    return sum(seen.values())


def staged_bytes(path: str) -> int:
    """Bytes of staged objects below ``path``, s5cmd's temporary files included; the small
    control files (the lock, the command files of calls in flight) are not objects. A file
    renamed while the walk runs (out of a block's scratch folder) is counted once, by inode."""
    seen: dict[int, int] = {}
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d != ".calls"]
        for f in files:
            if f != ".lock":
                try:
                    st = os.lstat(os.path.join(root, f))
                except FileNotFoundError:
                    continue
                seen[st.st_ino] = st.st_size
    return sum(seen.values())


def staged_samples(path: str) -> list[str]:
    """The sample folders left in a sampler's staging directory, as ``PASS/INDEX`` (each
    staging pass of a sampler has a folder of its own)."""
    out = []
    for p in sorted(os.listdir(path)):
        if not p.startswith(".") and os.path.isdir(os.path.join(path, p)):
            out += [f"{p}/{n}" for n in sorted(os.listdir(os.path.join(path, p))) if not n.startswith(".")]
    return out


def scratch_folders(path: str) -> list[str]:
    """s5cmd scratch folders of wildcard lines (``.cN``) anywhere below ``path``."""
    return [os.path.join(r, d) for r, dirs, _ in os.walk(path) for d in dirs if re.fullmatch(r"\.c\d+", d)]


class Peak:
    """Calls ``measure`` in a thread until the ``with`` block ends; :attr:`peak` is the most
    it returned and :attr:`looks` how often it looked."""

    def __init__(self, measure: Callable[[], int], interval: float = 0.001) -> None:
        self.measure, self.interval = measure, interval
        self.peak = self.looks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.measure())
            self.looks += 1
            time.sleep(self.interval)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Store:
    """A bucket on a real local S3 server, with a fresh prefix per test."""

    name: str
    endpoint: str
    bucket: str
    prefix: str

    @property
    def client(self):  # type: ignore[no-untyped-def]
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def uri(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"

    def put(self, objects: dict[str, bytes]) -> dict[str, bytes]:
        """Upload ``{relative key: bytes}`` under the prefix; returns them by full key."""
        c = self.client
        for k, v in objects.items():
            c.put_object(Bucket=self.bucket, Key=self.prefix + k, Body=v)
        return {self.prefix + k: v for k, v in objects.items()}


def make_pairs(n: int, size: int = 100) -> dict[str, bytes]:
    """A toy data set like the field report's: ``NNNN.image`` + ``NNNN.label`` pairs."""
    out = {}
    for i in range(n):
        out[f"{i:04d}.image"] = hashlib.sha256(str(i).encode()).digest() * (size // 32 + 1)
        out[f"{i:04d}.label"] = str(i % 10).encode()
    return out


def only_folder(root: str) -> str:
    """The one folder a loader made under ``root`` (a test gives each loader a root of its own):
    its staging directory, found as a user finds it, by looking."""
    names = [n for n in os.listdir(root) if not n.startswith(".")]
    assert len(names) == 1, f"one folder expected under {root}, found {names}"
    return os.path.join(root, names[0])
