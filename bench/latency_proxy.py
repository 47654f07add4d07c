#!/usr/bin/env python3
"""A latency-injecting TCP proxy for loopback, so that the effect of cloud round trips can be
measured on one machine.

Each chunk a client sends is held for ``--delay-ms`` (20 ms by default) before it is forwarded
to the server, in order per connection; what the server sends back is forwarded at once. A
request/response exchange therefore takes at least one extra delay, as a round trip to a
distant store would, while bandwidth is not limited. Accepting a connection is not delayed.

    python bench/latency_proxy.py --upstream 127.0.0.1:8333 [--listen 127.0.0.1:0] [--delay-ms 20]

prints ``listening on http://HOST:PORT`` (and writes the port to ``--port-file`` if given),
then serves until SIGINT/SIGTERM. :class:`LatencyProxy` runs it in a thread of another program.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
import time

CHUNK = 256 * 1024


async def _delayed_pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Forward reader -> writer, each chunk ``delay`` seconds after it arrived, in order."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def receive() -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await reader.read(CHUNK)
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


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError, RuntimeError):
        pass


class LatencyProxy:
    """The proxy: ``await serve()`` in a loop, or :meth:`start_thread` / :meth:`stop`."""

    def __init__(self, upstream_host: str, upstream_port: int, delay_s: float = 0.020,
                 listen_host: str = "127.0.0.1", listen_port: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.delay = delay_s
        self.listen = (listen_host, listen_port)
        self.port = 0
        self.connections = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.listen[0]}:{self.port}"

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        if me is not None:  # asyncio holds tasks weakly: an idle connection's could be collected
            self._tasks.add(me)
            me.add_done_callback(self._tasks.discard)
        self.connections += 1
        try:
            s_reader, s_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            c_writer.close()
            return
        up = asyncio.ensure_future(_delayed_pipe(c_reader, s_writer, self.delay))
        down = asyncio.ensure_future(_pipe(s_reader, c_writer))
        try:
            # The server closing ends the connection; the client closing its side still
            # waits for the server's answer (a half-close).
            await down
        except (ConnectionError, OSError):
            pass
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


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="latency_proxy.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", type=_hostport, required=True, help="HOST:PORT of the server (or an http:// URL)")
    p.add_argument("--listen", type=_hostport, default=("127.0.0.1", 0), help="HOST:PORT to listen on (port 0: any)")
    p.add_argument("--delay-ms", type=float, default=20.0, help="hold each client-to-server chunk this long (default 20)")
    p.add_argument("--port-file", help="write the port listened on to this file once listening")
    args = p.parse_args(argv)
    if args.delay_ms < 0:
        p.error(f"--delay-ms must be 0 or more, got {args.delay_ms}")
    proxy = LatencyProxy(*args.upstream, delay_s=args.delay_ms / 1000, listen_host=args.listen[0],
                         listen_port=args.listen[1])

    async def run() -> None:
        await proxy.start()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(f"listening on {proxy.endpoint} -> {args.upstream[0]}:{args.upstream[1]}, "
              f"{args.delay_ms:g} ms per client chunk", flush=True)
        if args.port_file:
            with open(args.port_file + ".tmp", "w") as f:
                f.write(str(proxy.port))
            os.replace(args.port_file + ".tmp", args.port_file)
        await stop.wait()
        assert proxy._server is not None
        proxy._server.close()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    t0 = time.monotonic()
    asyncio.run(run())
    print(f"proxy stopped after {time.monotonic() - t0:.0f}s, {proxy.connections} connections", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
