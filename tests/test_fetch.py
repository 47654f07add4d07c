"""``s5loader fetch``: objects, prefixes and split archives through a small disk; verification
against .md5 files and ETags; escaping members; interruption; space checked up front.

A private module (``s5loader._largeobj``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import sys
import tarfile
from collections.abc import Iterator

import boto3.s3.transfer
import psutil
import pytest
from support.faults import FaultProxy, Rule
from support.stores import Store, mount_tmpfs
from support.waits import wait_for

from s5loader import ChecksumError, ConfigError, StagingSpaceError, UnsafeArchiveError
from s5loader.fetch import fetch

KiB, MiB = 1024, 1024**2


def tree_files() -> dict[str, bytes]:
    files = {f"data/shard-{i:02d}.bin": os.urandom(40 * KiB + i) for i in range(12)}
    files["data/zeros.bin"] = bytes(300 * KiB)  # compresses well
    files["README.txt"] = b"twelve shards\n"
    files["deep/a/b/c/leaf.txt"] = b"leaf"
    return files


def make_tar(
    files: dict[str, bytes], mode: str = "w:gz", extra: list[tuple[tarfile.TarInfo, bytes]] = ()
) -> bytes:
    buf = io.BytesIO()
    if mode == "w:zst":
        zstd = pytest.importorskip("zstandard")
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w") as tar:
            _add(tar, files, extra)
        return zstd.ZstdCompressor().compress(raw.getvalue())
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        _add(tar, files, extra)
    return buf.getvalue()


def _add(tar: tarfile.TarFile, files: dict[str, bytes], extra) -> None:
    for name, data in files.items():
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    for info, data in extra:
        tar.addfile(info, io.BytesIO(data) if data else None)


def put_volumes(store: Store, name: str, blob: bytes, volume: int, md5: bool = True) -> list[str]:
    """Split ``blob`` like ``split -b VOLUME -d`` and upload the volumes (and .md5 files)."""
    keys = []
    c = store.client
    for i in range(0, len(blob), volume):
        part = blob[i : i + volume]
        key = f"{store.prefix}{name}.part{i // volume:02d}"
        c.put_object(Bucket=store.bucket, Key=key, Body=part)
        if md5:
            line = f"{hashlib.md5(part).hexdigest()}  {key.rsplit('/', 1)[1]}\n"
            c.put_object(Bucket=store.bucket, Key=key + ".md5", Body=line.encode())
        keys.append(key)
    return keys


def read_tree(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


@pytest.mark.parametrize("mode,suffix", [("w:gz", ".tar.gz"), ("w", ".tar"), ("w:zst", ".tar.zst")])
def test_extract_split_archive_within_budget(store: Store, tmp_path, mode: str, suffix: str) -> None:
    files = tree_files()
    blob = make_tar(files, mode)
    keys = put_volumes(store, "set" + suffix, blob, volume=100 * KiB)
    assert len(keys) >= 4
    dest = tmp_path / "out"
    seen = []
    r = fetch(
        store.uri("set" + suffix + ".part"),
        str(dest),
        extract=True,
        verify=True,
        budget=250 * KiB,
        endpoint_url=store.endpoint,
        progress=lambda done, total: seen.append((done, total)),
    )
    assert read_tree(str(dest)) == files  # file by file, byte by byte
    assert r.objects == len(keys) and r.verified == len(keys) and r.bytes == len(blob)
    assert 0 < r.peak_staged <= 250 * KiB  # never more than the budget of volumes on disk
    assert r.members == len(files)
    assert seen[-1] == (len(blob), len(blob))


def test_volumes_larger_than_the_budget_are_streamed(moto: Store, tmp_path) -> None:
    files = tree_files()
    blob = make_tar(files)
    keys = put_volumes(moto, "s.tgz", blob, volume=100 * KiB)
    r = fetch(
        moto.uri("s.tgz.part"),
        str(tmp_path / "o"),
        extract=True,
        verify=True,
        budget=64 * KiB,
        endpoint_url=moto.endpoint,
    )
    assert read_tree(str(tmp_path / "o")) == files
    assert r.peak_staged == 0 and r.verified == len(keys)  # read with s5cmd cat, nothing staged


def test_fetch_objects_prefix_and_multipart_etag(store: Store, tmp_path) -> None:
    big = os.urandom(11 * MiB + 123)  # three 5 MiB parts: a multipart ETag
    c = store.client
    cfg = boto3.s3.transfer.TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    c.upload_fileobj(io.BytesIO(big), store.bucket, store.prefix + "set/big.bin", Config=cfg)
    assert c.head_object(Bucket=store.bucket, Key=store.prefix + "set/big.bin")["ETag"].endswith('-3"')
    small = store.put({"set/sub/small.txt": b"hello", "set/other.bin": b"x" * 1000})
    r = fetch(
        store.uri("set/"), str(tmp_path / "all"), verify=True, endpoint_url=store.endpoint, part_size="5MiB"
    )
    assert r.objects == 3 and r.verified == 3
    got = read_tree(str(tmp_path / "all"))
    assert got == {
        "big.bin": big,
        "sub/small.txt": small[store.prefix + "set/sub/small.txt"],
        "other.bin": small[store.prefix + "set/other.bin"],
    }
    one = tmp_path / "one.bin"
    fetch(store.uri("set/big.bin"), str(one), verify=True, endpoint_url=store.endpoint)
    assert one.read_bytes() == big
    assert [n for n in os.listdir(tmp_path) if n.startswith(".s5loader")] == []


def test_one_large_object_in_parallel_parts_picked_from_its_size(
    store: Store, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from s5loader import find_s5cmd

    big = os.urandom(17 * MiB + 5)
    store.client.put_object(Bucket=store.bucket, Key=store.prefix + "big.bin", Body=big)
    # s5cmd through a wrapper that writes down its arguments
    argv_log = tmp_path / "argv.log"
    wrapper = tmp_path / "s5cmd"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {argv_log}\nexec {find_s5cmd()} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("S5LOADER_S5CMD", str(wrapper))
    fetch(store.uri("big.bin"), str(tmp_path / "auto.bin"), endpoint_url=store.endpoint)
    fetch(
        store.uri("big.bin"),
        str(tmp_path / "set.bin"),
        endpoint_url=store.endpoint,
        part_size="6MiB",
        concurrency=2,
    )
    assert (tmp_path / "auto.bin").read_bytes() == big and (tmp_path / "set.bin").read_bytes() == big
    copies = [ln.split() for ln in argv_log.read_text().splitlines() if " cp " in f" {ln} "]
    flags = [(a[a.index("--concurrency") + 1], a[a.index("--part-size") + 1]) for a in copies]
    # 17 MiB: four parts of S3's smallest size, all four at once; then as asked
    assert flags == [("4", "5"), ("2", "6")]


def test_corrupted_volume_fails_verification_naming_it(moto: Store, tmp_path) -> None:
    files = tree_files()
    keys = put_volumes(moto, "a.tar.gz", make_tar(files), volume=128 * KiB)
    bad = keys[2]
    moto.client.put_object(
        Bucket=moto.bucket, Key=bad + ".md5", Body=b"0" * 32 + b"  " + bad.rsplit("/", 1)[1].encode()
    )
    dest = tmp_path / "out"
    with pytest.raises(ChecksumError, match=f"s3://data/{bad}: MD5 [0-9a-f]{{32}} does not match 0{{32}}"):
        fetch(moto.uri("a.tar.gz.part"), str(dest), extract=True, verify=True, endpoint_url=moto.endpoint)
    assert os.listdir(dest) == []  # nothing extracted is left, nor any volume
    # the same through the command line: one line naming the volume, exit code 1
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "s5loader",
            "fetch",
            moto.uri("a.tar.gz.part"),
            str(dest),
            "--extract",
            "--verify",
            "--endpoint-url",
            moto.endpoint,
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and f"s3://data/{bad}" in r.stderr and "ChecksumError" not in r.stderr
    assert os.listdir(dest) == []


def test_corrupted_in_transit_fails_the_etag_check(moto: Store, tmp_path) -> None:
    keys = put_volumes(moto, "b.tar", make_tar(tree_files(), "w"), volume=256 * KiB, md5=False)
    proxy = FaultProxy(moto.endpoint, [Rule(keys[1], "corrupt")])
    try:
        with pytest.raises(ChecksumError, match=f"s3://data/{keys[1]}: MD5 .* its ETag"):
            fetch(moto.uri("b.tar.part"), str(tmp_path / "o"), verify=True, endpoint_url=proxy.endpoint)
    finally:
        proxy.close()
    assert os.listdir(tmp_path / "o") == []


def link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, b""


def member(name: str) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = 4
    return info, b"evil"


@pytest.mark.parametrize(
    "bad,why",
    [
        (member("../escape.txt"), "leaves the destination"),
        (member("ok/../../escape.txt"), "leaves the destination"),
        (member("/tmp/s5loader-abs-escape.txt"), "absolute path"),
        (link("passwd", "/etc/passwd"), "symbolic link to the absolute path"),
        (link("up", "../../outside"), "symbolic link to '../../outside'"),
        (link("sub/up", "../../x"), "outside the destination"),
        (link("hard", "../outside.txt", tarfile.LNKTYPE), "hard link"),
    ],
)
def test_escaping_members_are_refused(moto: Store, tmp_path, bad, why: str) -> None:
    blob = make_tar({"fine.txt": b"fine"}, "w", extra=[bad])
    put_volumes(moto, "evil.tar", blob, volume=len(blob))
    dest = tmp_path / "a" / "dest"
    with pytest.raises(UnsafeArchiveError, match=why) as e:
        fetch(moto.uri("evil.tar.part"), str(dest), extract=True, endpoint_url=moto.endpoint)
    assert repr(bad[0].name) in str(e.value) and moto.uri("evil.tar.part00") in str(e.value)
    assert os.listdir(dest) == []  # not even the members before it
    assert os.listdir(tmp_path / "a") == ["dest"]
    assert not os.path.exists("/tmp/s5loader-abs-escape.txt")


def test_links_inside_the_destination_are_kept(moto: Store, tmp_path) -> None:
    blob = make_tar(
        {"d/real.txt": b"real"},
        "w",
        extra=[link("d/alias", "real.txt"), link("hard", "d/real.txt", tarfile.LNKTYPE)],
    )
    put_volumes(moto, "ok.tar", blob, volume=len(blob))
    fetch(moto.uri("ok.tar.part"), str(tmp_path / "o"), extract=True, endpoint_url=moto.endpoint)
    assert os.readlink(tmp_path / "o" / "d" / "alias") == "real.txt"
    assert (tmp_path / "o" / "hard").read_bytes() == b"real"


@pytest.fixture
def small_fs() -> Iterator[str]:
    """A 2 MiB tmpfs made for the test."""
    with mount_tmpfs("2m", "s5loader-smallfs-") as d:
        yield d


def test_space_is_checked_before_the_first_byte(moto: Store, small_fs: str) -> None:
    moto.put({"big/one.bin": os.urandom(3 * MiB)})
    with pytest.raises(
        StagingSpaceError, match=r"needs 3\.0 MiB \(1 objects\); 1\.\d MiB free|needs 3\.0 MiB .*free there"
    ):
        fetch(moto.uri("big/"), small_fs, endpoint_url=moto.endpoint)
    assert os.listdir(small_fs) == []


def test_archive_larger_than_the_disk_is_one_clear_error(moto: Store, small_fs: str) -> None:
    # 1 MiB of gzip that expands to 8 MiB: only the extraction finds out
    files = {f"z{i}.bin": bytes(1 * MiB) for i in range(8)}
    put_volumes(moto, "zeros.tar.gz", make_tar(files), volume=64 * KiB)
    with pytest.raises(StagingSpaceError, match=r"needs 1\.0 MiB; .* free in .*after") as e:
        fetch(
            moto.uri("zeros.tar.gz.part"),
            small_fs,
            extract=True,
            budget=128 * KiB,
            endpoint_url=moto.endpoint,
        )
    assert "zeros.tar.gz.part00" in str(e.value)
    assert os.listdir(small_fs) == []


def test_zstd_without_the_module_is_a_clear_error(
    moto: Store, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    put_volumes(moto, "x.tar.zst", b"\x28\xb5\x2f\xfd" + b"0" * 100, volume=1000)
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ConfigError, match="zstandard archive; install the 'zstandard' module"):
        fetch(moto.uri("x.tar.zst.part"), str(tmp_path / "o"), extract=True, endpoint_url=moto.endpoint)
    assert os.listdir(tmp_path / "o") == []


FETCHER = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even in the background
from s5loader.fetch import fetch
fetch(sys.argv[1], sys.argv[2], extract=True, verify=True, endpoint_url=sys.argv[3], budget="3MiB",
      concurrency=1, part_size="5MiB")
print("finished")
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_fetch_leaves_nothing(moto: Store, tmp_path, sig: int) -> None:
    files = {f"f{i}.bin": os.urandom(1 * MiB) for i in range(6)}
    put_volumes(moto, "i.tar", make_tar(files, "w"), volume=1 * MiB)
    script = tmp_path / "fetcher.py"
    script.write_text(FETCHER)
    dest = tmp_path / "dest"
    dest.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(script), moto.uri("i.tar.part"), str(dest), moto.endpoint],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Freeze a volume's download (s5cmd cp) so the fetch cannot finish before the signal
        # lands; by then the work directory holds a volume or part of one.
        s5: list[psutil.Process] = []

        def stop_a_download() -> list[psutil.Process]:
            assert proc.poll() is None, proc.communicate()
            for c in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if c.name() == "s5cmd" and "cp" in c.cmdline():
                        c.send_signal(signal.SIGSTOP)
                        if c.status() == psutil.STATUS_STOPPED:
                            s5.append(c)
                except psutil.NoSuchProcess:
                    continue
            return s5

        wait_for(stop_a_download, 60, "a download to start", interval=0.002)
        assert [d for d in os.listdir(dest) if d.startswith(".s5loader-fetch-")]
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "finished" not in out and proc.returncode != 0, err
    assert os.listdir(dest) == []  # no volume, no partial file, no work directory
    _, alive = psutil.wait_procs(s5, timeout=10)
    assert not alive
