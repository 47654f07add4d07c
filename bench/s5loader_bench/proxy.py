#!/usr/bin/env python3
"""A latency-injecting TCP proxy for loopback that also counts the S3 requests it forwards, so
that the effect of cloud round trips, and the requests each loading method makes, can be
measured on one machine.

Each chunk a client sends is held for ``--delay-ms`` (0 by default: forward at once) before it
is forwarded to the server, in order per connection; what the server sends back is forwarded at
once. A request/response exchange therefore takes at least one extra delay, as a round trip to
a distant store would, while bandwidth is not limited. Accepting a connection is not delayed.

Requests are counted by reading the HTTP/1.1 request line and headers of every request on the
client-to-server path (bodies are skipped by ``Content-Length`` or chunked framing, so several
requests on one kept-alive connection are each counted): ``GET`` of an object, ``HEAD``,
``LIST`` (a ``GET`` of a bucket, e.g. ``?list-type=2``), and ``other`` (PUT, POST, DELETE, a
``GET`` of another bucket sub-resource). TLS would hide all of this: the upstream must be a
plain ``http://`` endpoint.

    python proxy.py --upstream 127.0.0.1:8333 [--listen 127.0.0.1:0] [--delay-ms 20] [--control]

prints ``listening on http://HOST:PORT`` (and writes the port to ``--port-file`` if given), then
serves until SIGINT/SIGTERM or, with ``--control``, until stdin closes; with ``--control``
every line ``counts`` read on stdin is answered with one JSON line of the counts so far on
stdout, and every line ``stats`` with one JSON line of the counts, the connections accepted so
far and the most open at once since the last ``stats`` (see :meth:`LatencyProxy.take_stats`).
:class:`LatencyProxy` runs it in a thread of another program; :class:`ProxyProcess` runs it as
a child process (``s5loader bench --count-requests`` / ``--delay-ms``), so that its CPU is not
the measured program's. This file uses the standard library only and runs as a script.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any
from urllib.parse import parse_qsl, urlsplit

CHUNK = 256 * 1024
KINDS = ("GET", "HEAD", "LIST", "other")
_MAX_HEAD = 64 * 1024  # request line + headers; beyond it the stream is not HTTP/1.1 we can read
# sub-resources whose GET on a bucket lists something (ListObjects v1/v2, versions, uploads)
_LIST_QUERIES = {
    "list-type",
    "prefix",
    "delimiter",
    "marker",
    "continuation-token",
    "start-after",
    "max-keys",
    "versions",
    "uploads",
    "encoding-type",
    "fetch-owner",
}
_OBJECT_QUERIES = {"x-id", "partNumber", "versionId", "response-content-type", "response-content-disposition"}


def classify(method: str, target: str) -> str:
    """The kind of one S3 request (``GET``, ``HEAD``, ``LIST`` or ``other``) from its request
    line: a ``GET`` with listing parameters (``list-type``, ``prefix``, ``delimiter``, ...) or
    of the root is a ``LIST``, a ``GET`` of another sub-resource (``?location``, ``?acl``) is
    ``other``, any other ``GET`` reads an object."""
    method = method.upper()
    if method == "HEAD":
        return "HEAD"
    if method != "GET":
        return "other"
    parts = urlsplit(target)
    query = {k for k, _ in parse_qsl(parts.query, keep_blank_values=True)}
    if query & _LIST_QUERIES:
        return "LIST"
    if query - _OBJECT_QUERIES:
        return "other"
    return "LIST" if not parts.path.strip("/") else "GET"


class RequestParser:
    """Follows one connection's client-to-server byte stream and counts each request's kind
    into ``counts``. A stream it cannot follow (no request line within 64 KiB) is counted once
    in ``counts["unreadable"]`` and ignored from there on."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts
        self._head = bytearray()
        self._body_left = 0
        self._chunked = False
        self._chunk_state = "size"  # size | data | crlf | trailer
        self._line = bytearray()
        self._broken = False

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view and not self._broken:
            if self._body_left:
                n = min(self._body_left, len(view))
                self._body_left -= n
                view = view[n:]
                if not self._body_left and self._chunked and self._chunk_state == "data":
                    self._chunk_state = "crlf"
                continue
            if self._chunked:
                view = self._feed_chunked(view)
                continue
            self._head += view
            view = memoryview(b"")
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > _MAX_HEAD:
                    self._give_up()
                return
            head, rest = bytes(self._head[:end]), bytes(self._head[end + 4 :])
            self._head.clear()
            self._request(head)
            view = memoryview(rest)

    def _feed_chunked(self, view: memoryview) -> memoryview:
        while view:
            if self._chunk_state == "data":
                if self._body_left:
                    return view  # skipped by feed()
                self._chunk_state = "crlf"
                continue
            i = bytes(view).find(b"\n")
            if i < 0:
                self._line += view
                if len(self._line) > _MAX_HEAD:
                    self._give_up()
                return memoryview(b"")
            line = (bytes(self._line) + bytes(view[:i])).rstrip(b"\r")
            self._line.clear()
            view = view[i + 1 :]
            if self._chunk_state == "crlf":
                self._chunk_state = "size"
            elif self._chunk_state == "size":
                try:
                    size = int(line.split(b";", 1)[0].strip() or b"x", 16)
                except ValueError:
                    self._give_up()
                    return memoryview(b"")
                if size == 0:
                    self._chunk_state = "trailer"
                else:
                    self._body_left, self._chunk_state = size, "data"
                    return view
            elif self._chunk_state == "trailer" and not line:
                self._chunked, self._chunk_state = False, "size"
                return view
        return view

    def _request(self, head: bytes) -> None:
        lines = head.lstrip(b"\r\n").decode("latin-1").split("\r\n")
        words = lines[0].split(" ")
        if len(words) != 3 or not words[2].startswith("HTTP/"):
            self._give_up()
            return
        kind = classify(words[0], words[1])
        self.counts[kind] = self.counts.get(kind, 0) + 1
        length, chunked = 0, False
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length" and value.strip().isdigit():
                length = int(value.strip())
            elif name == "transfer-encoding" and "chunked" in value.lower():
                chunked = True
        if chunked:
            self._chunked, self._chunk_state = True, "size"
        else:
            self._body_left = length

    def _give_up(self) -> None:
        self._broken = True
        self.counts["unreadable"] = self.counts.get("unreadable", 0) + 1


async def _delayed_pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, parser: RequestParser
) -> None:
    """Forward reader -> writer, each chunk ``delay`` seconds after it arrived, in order."""
    if delay <= 0:
        await _pipe(reader, writer, parser)
        return
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def receive() -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await reader.read(CHUNK)
                parser.feed(data)
                await queue.put((loop.time() + delay, data))
                if not data:
                    return
        except (ConnectionError, OSError):
            await queue.put((0.0, b""))

    async def send() -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                    if writer.can_write_eof():
                        writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    tasks = [asyncio.ensure_future(receive()), asyncio.ensure_future(send())]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, parser: RequestParser | None = None
) -> None:
    try:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            if parser is not None:
                parser.feed(data)
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError, RuntimeError):
        pass


class LatencyProxy:
    """The proxy: ``await serve()`` in a loop, or :meth:`start_thread` / :meth:`stop`.
    :attr:`counts` holds the requests forwarded so far by kind (see :func:`classify`)."""

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        delay_s: float = 0.020,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.delay = delay_s
        self.listen = (listen_host, listen_port)
        self.port = 0
        self.connections = 0  # accepted so far
        self.open = 0  # open now
        self.peak_open = 0  # the most open at once since the last take_stats()
        self.counts: dict[str, int] = dict.fromkeys(KINDS, 0)
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.listen[0]}:{self.port}"

    def take_stats(self) -> dict[str, object]:
        """The requests by kind so far, the connections accepted so far, and the most that were
        open at once since the last call (which starts the next such period at the connections
        open now)."""
        peak, self.peak_open = self.peak_open, self.open
        return {"requests": dict(self.counts), "connections": self.connections, "peak_open": peak}

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        if me is not None:  # asyncio holds tasks weakly: an idle connection's could be collected
            self._tasks.add(me)
            me.add_done_callback(self._tasks.discard)
        self.connections += 1
        self.open += 1
        self.peak_open = max(self.peak_open, self.open)
        try:
            await self._forward(c_reader, c_writer)
        finally:
            self.open -= 1

    async def _forward(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            c_writer.close()
            return
        up = asyncio.ensure_future(_delayed_pipe(c_reader, s_writer, self.delay, RequestParser(self.counts)))
        down = asyncio.ensure_future(_pipe(s_reader, c_writer))
        try:
            # The server closing ends the connection; the client closing its side still
            # waits for the server's answer (a half-close).
            await down
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass  # cancelled: the proxy stops (asyncio would log a cancelled handler as an error)
        finally:
            up.cancel()
            down.cancel()
            for w in (s_writer, c_writer):
                with contextlib.suppress(Exception):
                    w.close()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, *self.listen, limit=CHUNK)
        self.port = self._server.sockets[0].getsockname()[1]

    async def serve(self) -> None:
        await self.start()
        assert self._server is not None
        async with self._server:
            await self._server.serve_forever()

    def start_thread(self) -> LatencyProxy:
        """Serve from a daemon thread with a loop of its own; returns once listening."""
        ready = threading.Event()

        def main() -> None:
            loop = self._loop = asyncio.new_event_loop()
            loop.run_until_complete(self.start())
            ready.set()
            loop.run_forever()
            # stopped: close the server and end every connection before closing the loop
            if self._server is not None:
                self._server.close()
            tasks = asyncio.all_tasks(loop)
            for t in tasks:
                t.cancel()
            if tasks:  # gather() of nothing would look for a loop this thread does not have
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=main, name="latency-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the latency proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)


class ProxyProcess:
    """This file run as a child process with ``--control``: :attr:`endpoint` to point clients
    at, :meth:`counts` for the requests forwarded so far, :attr:`pid` to leave it out of CPU
    figures, :meth:`close` (idempotent) to stop it. A context manager."""

    def __init__(self, upstream: str, delay_ms: float = 0.0, python: str = sys.executable) -> None:
        self.upstream, self.delay_ms = upstream, delay_ms
        argv = [
            python,
            os.path.abspath(__file__),
            "--upstream",
            upstream,
            "--delay-ms",
            str(delay_ms),
            "--control",
        ]
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        assert self._proc.stdout is not None
        first = self._proc.stdout.readline()
        if not first.startswith("listening on "):
            self.close()
            raise RuntimeError(
                f"the request-counting proxy for {upstream} did not start (exit code {self._proc.returncode})"
            )
        self.endpoint = first.split()[2]
        self.pid = self._proc.pid
        self._lock = threading.Lock()

    def counts(self) -> dict[str, int]:
        """The requests forwarded so far, by kind."""
        return {k: int(v) for k, v in self._ask("counts").items()}

    def stats(self) -> dict[str, Any]:
        """:meth:`LatencyProxy.take_stats` of the proxy: requests by kind, connections accepted
        so far, and the most open at once since the last call."""
        return self._ask("stats")

    def _ask(self, what: str) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        with self._lock:
            self._proc.stdin.write(what + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the request-counting proxy exited with code {self._proc.poll()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                if self._proc.stdin is not None:
                    self._proc.stdin.close()  # --control: stdin closing stops it
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for f in (self._proc.stdin, self._proc.stdout):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()

    def __enter__(self) -> ProxyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def _parser() -> argparse.ArgumentParser:
    """The arguments of ``proxy.py``."""
    p = argparse.ArgumentParser(prog="proxy.py", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--upstream", type=_hostport, required=True, help="HOST:PORT of the server (or an http:// URL)"
    )
    p.add_argument(
        "--listen", type=_hostport, default=("127.0.0.1", 0), help="HOST:PORT to listen on (port 0: any)"
    )
    p.add_argument(
        "--delay-ms", type=float, default=0.0, help="hold each client-to-server chunk this long (default 0)"
    )
    p.add_argument("--port-file", help="write the port listened on to this file once listening")
    p.add_argument(
        "--control",
        action="store_true",
        help=(
            "answer each 'counts' line on stdin with the request counts as a JSON line; stop when stdin "
            "closes"
        ),
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.delay_ms < 0:
        p.error(f"--delay-ms must be 0 or more, got {args.delay_ms}")
    up_host, up_port = args.upstream
    proxy = LatencyProxy(
        up_host, up_port, delay_s=args.delay_ms / 1000, listen_host=args.listen[0], listen_port=args.listen[1]
    )

    async def run() -> None:
        await proxy.start()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(
            f"listening on {proxy.endpoint} -> {args.upstream[0]}:{args.upstream[1]}, "
            f"{args.delay_ms:g} ms per client chunk",
            flush=True,
        )
        if args.port_file:
            with open(args.port_file + ".tmp", "w") as f:
                f.write(str(proxy.port))
            os.replace(args.port_file + ".tmp", args.port_file)
        if args.control:

            def control() -> None:  # a thread: answers from the counts the loop keeps
                for line in sys.stdin:
                    if line.strip() == "counts":
                        print(json.dumps(dict(proxy.counts)), flush=True)
                    elif line.strip() == "stats":
                        print(json.dumps(proxy.take_stats()), flush=True)
                loop.call_soon_threadsafe(stop.set)

            threading.Thread(target=control, name="proxy-control", daemon=True).start()
        await stop.wait()
        assert proxy._server is not None
        proxy._server.close()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    t0 = time.monotonic()
    asyncio.run(run())
    print(
        f"proxy stopped after {time.monotonic() - t0:.0f}s, {proxy.connections} connections, "
        f"requests {json.dumps(proxy.counts)}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
