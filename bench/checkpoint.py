#!/usr/bin/env python3
"""The large-object benchmark: checkpoints and a split archive against the local SeaweedFS.

1. starts the embedded SeaweedFS (``bin/s3-local start``) in a temporary directory;
2. saves and loads state dicts (256 MiB and 1 GiB by default) with ``s5loader.checkpoint``
   (its load as is, and with ``mmap=True`` as ``s5loader-mmap``),
   with boto3's ``upload_fileobj``/``download_fileobj`` (default transfer settings, through an
   in-memory buffer) and, when installed, s3torchconnector's ``S3Checkpoint``, directly on
   loopback and through ``s5loader_bench/proxy.py`` (20 ms per request); checks every load
   tensor by tensor; with ``--repeat N``, N rounds of one save and load per method (methods
   side by side, not one method's runs after another's); reports the medians in seconds and
   MB/s, and the ratios;
3. writes a split ``.tar.gz`` (2 GiB of files by default, 64 MiB volumes with ``.md5`` files),
   runs ``s5loader fetch --extract --verify --budget 256MiB`` on it and reports the time and
   the peak disk use of the destination (volumes and extracted files), polled every 50 ms;
4. prints a table and writes bench/results/checkpoint.json; stops the server.

    .venv/bin/python bench/checkpoint.py [--sizes 256MiB 1GiB] [--archive 2GiB] [--budget 256MiB] [--repeat 1]
                                         [--device cuda]

Every method times the whole way from a state dict in memory to the object in the store and
back (serialisation included). Only the public API of s5loader is used.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = sys.executable
sys.path.insert(0, ROOT)

import s5loader  # noqa: E402
from s5loader import checkpoint, parse_size  # noqa: E402

MiB = 1024**2


# The latency proxy of the loading benchmark, run as a child process so that its event loop
# does not share this process's interpreter with the in-process clients it measures.
PROXY = """
import sys, time
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/s5loader_bench"]
try:
    from s5loader_bench.proxy import LatencyProxy
except ImportError:
    from latency_proxy import LatencyProxy
host, port = sys.argv[2].rsplit(":", 1)
proxy = LatencyProxy(host, int(port), float(sys.argv[3]) / 1000).start_thread()
print(proxy.endpoint, flush=True)
time.sleep(1e9)
"""


def check_run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``argv``; on a non-zero exit raise with the command, the code and stderr's tail."""
    proc = subprocess.run(argv, text=True, capture_output=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with code {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def start_proxy(endpoint: str, delay_ms: float) -> tuple[subprocess.Popen[str], str]:
    upstream = endpoint.split("://", 1)[1]
    proc = subprocess.Popen(
        [PY, "-c", PROXY, HERE, upstream, str(delay_ms)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("http://"):
        proc.kill()
        raise RuntimeError(f"the latency proxy did not start (exit code {proc.wait()})")
    return proc, line


def make_state_dict(size: int, device: str = "cpu") -> dict[str, Any]:
    import torch

    per = 64 * MiB if size >= 512 * MiB else 16 * MiB
    g = torch.Generator().manual_seed(0)
    return {
        f"layer{i:02d}.weight": torch.randn(per // 4, generator=g).to(device)
        for i in range(max(1, size // per))
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def method_s5loader(
    endpoint: str, device: str = "cpu"
) -> tuple[Callable[[Any, str], None], Callable[[str], Any]]:
    return (
        lambda sd, uri: checkpoint.save(sd, uri, endpoint_url=endpoint),
        lambda uri: checkpoint.load(uri, map_location=device, endpoint_url=endpoint),
    )


def method_s5loader_mmap(
    endpoint: str, device: str = "cpu"
) -> tuple[Callable[[Any, str], None], Callable[[str], Any]]:
    """s5loader's save, and its load with ``mmap=True``: the tensors are views of the object read
    into an in-memory file, not copies (as with ``torch.load(path, mmap=True)``)."""
    return (
        lambda sd, uri: checkpoint.save(sd, uri, endpoint_url=endpoint),
        lambda uri: checkpoint.load(uri, map_location=device, endpoint_url=endpoint, mmap=True),
    )


def method_boto3(
    endpoint: str, device: str = "cpu"
) -> tuple[Callable[[Any, str], None], Callable[[str], Any]]:
    import boto3
    import torch

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")

    def save(sd: Any, uri: str) -> None:
        bucket, key = uri[5:].split("/", 1)
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        client.upload_fileobj(buf, bucket, key)

    def load(uri: str) -> Any:
        bucket, key = uri[5:].split("/", 1)
        buf = io.BytesIO()
        client.download_fileobj(bucket, key, buf)
        buf.seek(0)
        return torch.load(buf, map_location=device, weights_only=True)

    return save, load


def method_s3torchconnector(
    endpoint: str, device: str = "cpu"
) -> tuple[Callable[[Any, str], None], Callable[[str], Any]]:
    import torch
    from s3torchconnector import S3Checkpoint, S3ClientConfig

    ck = S3Checkpoint(
        region="us-east-1", endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True)
    )

    def save(sd: Any, uri: str) -> None:
        with ck.writer(uri) as w:
            torch.save(sd, w)

    def load(uri: str) -> Any:
        with ck.reader(uri) as r:
            return torch.load(r, map_location=device, weights_only=True)

    return save, load


METHODS: dict[str, Callable[[str, str], tuple[Callable[[Any, str], None], Callable[[str], Any]]]] = {
    "s5loader": method_s5loader,
    "s5loader-mmap": method_s5loader_mmap,
    "boto3": method_boto3,
    "s3torchconnector": method_s3torchconnector,
}


def bench_checkpoints(
    endpoint: str,
    label: str,
    sd: dict[str, Any],
    size: int,
    repeat: int,
    order: list[str],
    device: str = "cpu",
) -> dict[str, Any]:
    """Save and load ``sd`` with each method in ``order``, ``repeat`` rounds of one each (so
    that a machine that slows down or speeds up meanwhile weighs on every method alike),
    loading onto ``device``; the medians, and every round's times in the order they ran."""
    rows: dict[str, Any] = {}
    methods: dict[str, tuple[Callable[[Any, str], None], Callable[[str], Any]]] = {}
    for name in order:
        try:
            methods[name] = METHODS[name](endpoint, device)
        except ImportError as exc:
            rows[name] = {"status": f"not installed ({exc.name})"}
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in methods}
    for r in range(repeat):
        for name, (save, load) in methods.items():
            uri = f"s3://bench/ckpt/{label}-{size}-{name}-{r}.pt"
            t_save, _ = timed(lambda uri=uri, save=save: save(sd, uri))
            t_load, got = timed(lambda uri=uri, load=load: load(uri))
            if not same(sd, got):
                raise RuntimeError(f"{name}: the loaded state dict differs from the saved one")
            del got
            times[name][0].append(t_save)
            times[name][1].append(t_load)
            subprocess.run(
                [s5loader.find_s5cmd(), "--endpoint-url", endpoint, "rm", uri],
                capture_output=True,
                check=False,
            )
    for name, (saves, loads) in times.items():
        save_s, load_s = sorted(saves)[len(saves) // 2], sorted(loads)[len(loads) // 2]
        rows[name] = {
            "status": "ok",
            "save_s": save_s,
            "load_s": load_s,
            "save_MBps": size / save_s / 1e6,
            "load_MBps": size / load_s / 1e6,
            "save_runs_s": saves,
            "load_runs_s": loads,
        }
        print(
            f"  {size / MiB:5.0f} MiB {label:7s} {name:17s} save {save_s:6.2f} s ({size / save_s / 1e6:5.0f} "
            f"MB/s)   load {load_s:6.2f} s ({size / load_s / 1e6:5.0f} MB/s)",
            flush=True,
        )
    return rows


def write_archive(tmp: str, total: int, volume: int) -> tuple[str, list[str], int, int]:
    """A .tar.gz of ``total`` bytes of files (half random, half text-like), split into
    volumes with md5sum files. Returns the folder, the volume names, file count and bytes."""
    vol_dir = os.path.join(tmp, "volumes")
    os.makedirs(vol_dir)
    name = "dataset.tar.gz"

    class Splitter(io.RawIOBase):
        def __init__(self) -> None:
            self.index, self.filled, self.names = 0, 0, []
            self.f: Any = None

        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            data = memoryview(b).cast("B")
            while len(data):
                if self.f is None:
                    n = f"{name}.part{self.index:03d}"
                    self.names.append(n)
                    self.f = open(os.path.join(vol_dir, n), "wb")  # noqa: SIM115
                take = min(len(data), volume - self.filled)
                self.f.write(data[:take])
                self.filled += take
                data = data[take:]
                if self.filled == volume:
                    self.f.close()
                    self.f, self.filled, self.index = None, 0, self.index + 1
            return len(memoryview(b))

        def close(self) -> None:
            if self.f is not None:
                self.f.close()
            super().close()

    sink = Splitter()
    files = written = 0
    file_size = 32 * MiB
    rnd = os.urandom(file_size)
    text = (b"s5loader " * (file_size // 9 + 1))[:file_size]
    with (
        gzip.GzipFile(fileobj=sink, mode="wb", compresslevel=1) as gz,
        tarfile.open(fileobj=gz, mode="w|") as tar,
    ):
        while written < total:
            data = rnd if files % 2 == 0 else text
            info = tarfile.TarInfo(f"dataset/{files // 16:03d}/file-{files:05d}.bin")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            files += 1
            written += len(data)
    sink.close()
    for n in sink.names:
        with open(os.path.join(vol_dir, n), "rb") as f:
            digest = hashlib.file_digest(f, "md5").hexdigest()
        with open(os.path.join(vol_dir, n + ".md5"), "w") as f:
            f.write(f"{digest}  {n}\n")
    return vol_dir, sink.names, files, written


def dir_bytes(path: str) -> int:
    n = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                n += os.lstat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return n


def bench_fetch(endpoint: str, tmp: str, total: int, volume: int, budget: int) -> dict[str, Any]:
    t = time.perf_counter()
    vol_dir, names, files, written = write_archive(tmp, total, volume)
    archive = sum(os.path.getsize(os.path.join(vol_dir, n)) for n in names)
    check_run([s5loader.find_s5cmd(), "--endpoint-url", endpoint, "cp", vol_dir + "/", "s3://bench/archive/"])
    shutil.rmtree(vol_dir)
    print(
        f"  archive: {files} files, {written / 2**30:.2f} GiB in {len(names)} volumes of "
        f"{volume / MiB:.0f} MiB ({archive / 2**30:.2f} GiB compressed), made and uploaded in "
        f"{time.perf_counter() - t:.0f} s",
        flush=True,
    )
    dest = os.path.join(tmp, "dest")
    os.makedirs(dest)
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], dir_bytes(dest))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    argv = [
        PY,
        "-m",
        "s5loader",
        "fetch",
        "s3://bench/archive/dataset.tar.gz.part",
        dest,
        "--extract",
        "--verify",
        "--budget",
        str(budget),
        "--endpoint-url",
        endpoint,
    ]
    t = time.perf_counter()
    proc = check_run(argv)
    elapsed = time.perf_counter() - t
    stop.set()
    watcher.join()
    line = proc.stdout.strip().splitlines()[-1]
    staged = int(re.search(r"peak staging .*?\((\d+) bytes\)", line).group(1))  # type: ignore[union-attr]
    got = sum(1 for _, _, fs in os.walk(dest) for _ in fs)
    got_bytes = dir_bytes(dest)
    if got != files:
        raise RuntimeError(f"fetch extracted {got} files, the archive has {files}")
    print(
        f"  fetch --extract --verify --budget {budget / MiB:.0f}MiB: {elapsed:.1f} s "
        f"({archive / elapsed / 1e9:.2f} GB/s of archive), peak staging of volumes "
        f"{staged / MiB:.0f} MiB, peak disk use of DEST {peak[0] / 2**30:.2f} GiB "
        f"(extracted {got_bytes / 2**30:.2f} GiB)\n  {line}",
        flush=True,
    )
    return {
        "files": files,
        "extracted_bytes": written,
        "archive_bytes": archive,
        "volumes": len(names),
        "volume_bytes": volume,
        "budget": budget,
        "seconds": elapsed,
        "peak_staged": staged,
        "peak_dest_bytes": peak[0],
        "command": " ".join(argv[1:]),
    }


def _parser() -> argparse.ArgumentParser:
    """The arguments of ``checkpoint.py``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sizes", nargs="+", default=["256MiB", "1GiB"], help="state dict sizes (default 256MiB 1GiB)"
    )
    p.add_argument("--archive", default="2GiB", help="bytes of files in the split archive (default 2GiB)")
    p.add_argument("--volume", default="64MiB", help="volume size (default 64MiB)")
    p.add_argument("--budget", default="256MiB", help="fetch --budget (default 256MiB)")
    p.add_argument("--repeat", type=int, default=1, help="save/load rounds per method; the median is kept")
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--skip-fetch", action="store_true")
    p.add_argument(
        "--device",
        default="cpu",
        help="where the state dict lives and loads go (cuda: a GPU's, as in training; default cpu)",
    )
    p.add_argument("--out", default=os.path.join(HERE, "results", "checkpoint.json"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for k, v in (
        ("AWS_ACCESS_KEY_ID", "bench"),
        ("AWS_SECRET_ACCESS_KEY", "bench"),
        ("AWS_REGION", "us-east-1"),
    ):
        os.environ.setdefault(k, v)
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "S3_ENDPOINT_URL", "AWS_PROFILE"):
        os.environ.pop(var, None)
    sizes = [parse_size(x) for x in args.sizes]
    results: dict[str, Any] = {
        "sizes": sizes,
        "delay_ms": args.delay_ms,
        "device": args.device,
        "cpus": os.cpu_count(),
        "runs": {},
    }
    t0 = time.perf_counter()
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # `timeout`, kill: the server and proxy stop below
    with tempfile.TemporaryDirectory(prefix="s5loader-bench-ckpt-") as tmp:
        s3dir = os.path.join(tmp, "s3")
        check_run([PY, os.path.join(ROOT, "bin", "s3-local"), "start", "--dir", s3dir, "--bucket", "bench"])
        with open(os.path.join(s3dir, "endpoint")) as f:  # the start command prints shell exports
            endpoint = f.read().strip()
        proxy = None
        try:
            proxy, proxied = start_proxy(endpoint, args.delay_ms)
            for i, size in enumerate(sizes):
                sd = make_state_dict(size, args.device)
                print(
                    f"state dict: {len(sd)} tensors, {size / MiB:.0f} MiB; SeaweedFS at {endpoint}, "
                    f"the {args.delay_ms:g} ms proxy at {proxied}",
                    flush=True,
                )
                if i == 0:
                    # A fresh SeaweedFS grows its volumes on the first writes: warm it up untimed,
                    # so that the first method measured does not pay for it.
                    warm_save, _ = method_boto3(endpoint, args.device)
                    warm_save(sd, "s3://bench/ckpt/warm-up.pt")
                    subprocess.run(
                        [
                            s5loader.find_s5cmd(),
                            "--endpoint-url",
                            endpoint,
                            "rm",
                            "s3://bench/ckpt/warm-up.pt",
                        ],
                        capture_output=True,
                        check=False,
                    )
                # The store may still be busy with the previous method's writes: the proxied
                # pass runs the methods in the reverse order, so no method is always first.
                order = list(METHODS)
                results["runs"][str(size)] = {
                    "direct": bench_checkpoints(
                        endpoint, "direct", sd, size, args.repeat, order, args.device
                    ),
                    "proxy": bench_checkpoints(
                        proxied, "proxy", sd, size, args.repeat, order[::-1], args.device
                    ),
                }
                del sd
            if not args.skip_fetch:
                results["fetch"] = bench_fetch(
                    endpoint, tmp, parse_size(args.archive), parse_size(args.volume), parse_size(args.budget)
                )
        finally:
            if proxy is not None:
                proxy.terminate()
                proxy.wait(10)
            subprocess.run([PY, os.path.join(ROOT, "bin", "s3-local"), "stop", "--dir", s3dir], check=False)
    results["seconds"] = time.perf_counter() - t0
    print("\nratios (s5loader / other, higher is better: time of the other divided by s5loader's)")
    for size in sizes:
        for label in ("direct", "proxy"):
            rows = results["runs"][str(size)][label]
            base, mapped = rows["s5loader"], rows.get("s5loader-mmap", {})
            for other in ("boto3", "s3torchconnector"):
                if rows.get(other, {}).get("status") == "ok":
                    extra = (
                        f"   load with mmap=True {rows[other]['load_s'] / mapped['load_s']:.2f}x"
                        if mapped.get("status") == "ok"
                        else ""
                    )
                    print(
                        f"  {size / MiB:5.0f} MiB {label:7s} vs {other:17s} "
                        f"save {rows[other]['save_s'] / base['save_s']:.2f}x   "
                        f"load {rows[other]['load_s'] / base['load_s']:.2f}x{extra}"
                    )
    print(f"the whole run: {results['seconds']:.0f} s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
