"""A rank's staging shared by its DataLoader workers: one process stages, every worker reads.

An :class:`~s5loader.S5IterableDataset` stages once per rank. The rank's first DataLoader
worker (or the process itself, without workers) *hosts*: it runs the rank's staging run and
sends each staged index to the worker that reads it. The other workers connect to the host
over a Unix socket in Linux's abstract namespace (no file, no path length limit), named after
the data set and the loader's iteration, and say where they are (:class:`Hello`: the epoch and
how far their share got). The host waits for every worker, then stages the positions still to
come, in order, and sends each worker its own: a staged index, a skipped position, the end, or
the error that stopped the pass (to every worker). A worker whose host is gone (the socket
closed without an end) raises :class:`~s5loader.exceptions.StallError`.

Sending never blocks the host: each connection has a writer thread of its own, so a worker that
stopped reading (its DataLoader holds enough of its batches) never holds up the others.

Only the loader's own processes take part, and what crosses is data, never code: an abstract
socket carries no permission, so each side checks the other's credentials as the kernel gives
them (``SO_PEERCRED``): the same user, and a sibling in the loader (a process whose parent is
this process's parent: DataLoader workers are the children of one process), else the
connection is closed unread (the host) or the pass fails with a
:class:`~s5loader.exceptions.StallError` that says who answered (a worker). Frames are JSON of
ints, strings and bools, at most :data:`MAX_FRAME` bytes: a staged index is its int, its folder
(which must lie in the rank's staging area) and its flags; an error is its type's name and
message, raised again as the same s5loader or built-in type.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import get_worker_info

from ..exceptions import S5LoaderError, StallError
from .wire import (
    END,
    ERROR,
    INDEX,
    SKIP,
    FrameError,
    Hello,
    decode_frame,
    dumps,
    encode,
    frames_of,
    hello_bytes,
    hello_of,
    peer_problem,
    read,
)

# How long a worker keeps trying to reach its host before it gives up: the host is the loader's
# first worker, which starts with the others.
CONNECT_S = 120.0

__all__ = [
    "CONNECT_S",
    "END",
    "ERROR",
    "INDEX",
    "SKIP",
    "FeedHost",
    "FrameError",
    "Hello",
    "connect",
    "local",
]

log = logging.getLogger(__name__)


class _Writer:
    """One worker's connection: messages queued by the host, written by a thread of its own.
    After the last message (the end, or an error) it waits for the worker to close its side,
    which it does once it has read its last sample (or when its process ends)."""

    def __init__(self, conn: socket.socket, worker: int) -> None:
        self.conn = conn
        self.q: queue.SimpleQueue[tuple[bytes, bool] | None] = queue.SimpleQueue()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"s5loader-feed-{worker}", daemon=True)
        self.thread.start()

    def put(self, msg: tuple[str, Any]) -> None:
        self.q.put((dumps(encode(msg)), msg[0] in (END, ERROR)))

    def _run(self) -> None:
        try:
            closed = False
            while not closed:
                item = self.q.get()
                if item is None:
                    break
                # what the host queued meanwhile goes in the same write and the same frames (a
                # shard that lands readies many samples at once): one system call, and one frame
                # to read and parse, for many samples
                data, last = [item[0]], item[1]
                while not last:
                    try:
                        item = self.q.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:  # closed: what came before it is still written
                        closed = True
                        break
                    data.append(item[0])
                    last = item[1]
                self.conn.sendall(frames_of(data))
                if last:
                    while self.conn.recv(4096):  # the worker sends nothing more: wait for its close
                        pass
                    break
        except OSError:
            pass  # the worker is gone; its DataLoader reports it
        finally:
            self.done.set()
            with contextlib.suppress(OSError):
                self.conn.close()

    def close(self) -> None:
        self.q.put(None)


class FeedHost:
    """The host side: waits for the hellos of ``num_workers`` workers (the host's own worker is
    ``local``), then sends what ``serve`` yields: ``(position, message)`` pairs, each to worker
    ``owner(position)``.

    Args:
        name: the socket's name in the abstract namespace (unique per data set and iteration).
        local: the host's own worker's hello; its messages go to :meth:`receive`.
        serve: given every worker's hello (by worker number), yields ``(position, (kind,
            payload))`` in order; an exception it raises goes to every worker.
        owner: the worker that reads a position.
    """

    def __init__(
        self,
        name: str,
        local: Hello,
        serve: Callable[[dict[int, Hello]], Iterator[tuple[int, tuple[str, Any]]]],
        owner: Callable[[int], int],
    ) -> None:
        self.name = name
        self.local = local
        self.serve = serve
        self.owner = owner
        self.inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.stop = threading.Event()
        self._writers: dict[int, _Writer] = {}
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> FeedHost:
        if self.local.num_workers > 1:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind("\0" + self.name)
            except OSError as exc:
                sock.close()
                raise StallError(
                    f"the staging host of this DataLoader cannot take its socket @{self.name}: "
                    f"{exc.strerror} (another process took the name first?); iterate the loader again"
                ) from exc
            sock.listen(self.local.num_workers)
            sock.settimeout(0.2)
            self._sock = sock
        self._thread = threading.Thread(target=self._run, name="s5loader-feed", daemon=True)
        self._thread.start()
        return self

    def _send(self, worker: int, msg: tuple[str, Any]) -> None:
        if worker == self.local.worker:
            self.inbox.put(msg)
        else:
            w = self._writers.get(worker)
            if w is not None:
                w.put(msg)

    def _broadcast(self, msg: tuple[str, Any]) -> None:
        for worker in range(self.local.num_workers):
            self._send(worker, msg)

    def _hellos(self) -> dict[int, Hello] | None:
        hellos = {self.local.worker: self.local}
        while len(hellos) < self.local.num_workers:
            if self.stop.is_set():
                return None
            assert self._sock is not None
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            stranger = peer_problem(conn)
            if stranger is not None:
                log.warning("the staging feed %s refused a connection from %s", self.name, stranger)
                conn.close()
                continue
            conn.settimeout(10.0)  # a worker says hello at once
            try:
                hello = hello_of(read(conn.makefile("rb")))
            except (EOFError, OSError, FrameError) as exc:
                log.warning("the staging feed %s closed a connection that sent no hello: %s", self.name, exc)
                conn.close()
                continue
            conn.settimeout(None)
            if not hmac.compare_digest(hello.key.encode(), self.local.key.encode()):
                log.warning("the staging feed %s refused a hello without the loader's key", self.name)
                conn.close()
                continue
            if not 0 <= hello.worker < self.local.num_workers or hello.worker in hellos:
                log.warning("the staging feed %s refused a hello from worker %d", self.name, hello.worker)
                conn.close()
                continue
            hellos[hello.worker] = hello
            self._writers[hello.worker] = _Writer(conn, hello.worker)
        return hellos

    def _run(self) -> None:
        try:
            hellos = self._hellos()
            if hellos is None:
                return
            for pos, msg in self.serve(hellos):
                if self.stop.is_set():
                    return
                self._send(self.owner(pos), msg)
            self._broadcast((END, None))
        except BaseException as exc:  # noqa: BLE001 - every worker raises it
            if not isinstance(exc, S5LoaderError):
                log.exception("staging for the DataLoader workers failed")
            self._broadcast((ERROR, exc))
        finally:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.close()

    def wait_readers(self, timeout: float) -> bool:
        """Wait until every other worker has read its last message and closed its connection
        (or its process ended): the staged files must stay until then. False on ``timeout``."""
        deadline = time.monotonic() + timeout
        for w in list(self._writers.values()):
            if not w.done.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def close(self) -> None:
        """Stop serving (the thread ends at its next message) and close the connections. Safe to
        call twice."""
        self.stop.set()
        self.inbox.put(
            (ERROR, StallError("this staging pass was stopped: a newer iteration or close() replaced it"))
        )
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)
        for w in self._writers.values():
            w.close()
        self._writers.clear()


def rendezvous_name(uid: str, rank: int, iterations: int) -> str:
    """The rendezvous of a rank's workers with their host for one iteration: the same in every
    worker of one ``iter(loader)`` (the loader's base seed, and the data set copy's count of
    ``iterations``, which persistent workers keep in step), unique to the data set (``uid``)."""
    info = get_worker_info()
    base = info.seed - info.id if info is not None else os.getpid()
    return f"s5loader-{uid}-r{rank}-{base}-{iterations}"


def connect(
    name: str, hello: Hello, timeout: float = CONNECT_S, root: str | None = None
) -> Iterator[tuple[str, Any]]:
    """A worker's side: connect to the host ``name``, say ``hello``, and yield its messages
    (each staged index's folder checked to lie in ``root``, the rank's staging area).

    Raises:
        StallError: the host cannot be reached within ``timeout`` seconds, it went away before
            the end of the pass, it is no process of this loader, or it sent what is no message
            of the feed.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            sock.connect("\0" + name)
            break
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            if time.monotonic() > deadline:
                sock.close()
                raise StallError(
                    f"DataLoader worker {hello.worker} found no staging host (worker 0 of its loader) "
                    f"within {timeout:.0f} s"
                ) from exc
            time.sleep(delay)
            delay = min(2 * delay, 0.1)
    try:
        stranger = peer_problem(sock)
        if stranger is not None:
            raise StallError(
                f"DataLoader worker {hello.worker} found another process at its staging host's socket "
                f"@{name}: {stranger}; it sent that process nothing"
            )
        sock.sendall(hello_bytes(hello))
        f = sock.makefile("rb", buffering=1 << 16)
        while True:
            try:
                msgs = decode_frame(read(f), root)
            except (EOFError, OSError) as exc:
                raise StallError(
                    f"the staging host of DataLoader worker {hello.worker} (worker 0 of its loader) went "
                    "away before the end of the pass"
                ) from exc
            except FrameError as exc:
                raise StallError(
                    f"the staging host of DataLoader worker {hello.worker} sent what is no message of the "
                    f"feed ({exc}): the pass stops"
                ) from None
            for msg in msgs:
                yield msg
                if msg[0] in (END, ERROR):
                    return
    finally:
        sock.close()


def local(host: FeedHost) -> Iterator[tuple[str, Any]]:
    """The host's own worker's side: the messages :class:`FeedHost` put in its inbox."""
    while True:
        msg = host.inbox.get()
        yield msg
        if msg[0] in (END, ERROR):
            return
