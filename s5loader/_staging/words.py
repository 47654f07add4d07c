"""The sampler's word on a sample it handed to a DataLoader before the sample was staged (see
:mod:`s5loader._sampling.early`), in the loader's one channel (:mod:`s5loader._util.frames`).

The sampler's process serves a pass's words on a Unix socket in the pass folder
(``PASS/.w``, in the 0700 staging directory; :class:`WordServer`), to its own process and its
descendants only (the DataLoader's workers). A reader asks for sample ``i`` with ``[i]`` and
gets ``[kind, i, payload]`` once the sampler knows: staged (:data:`INDEX`), not staged
(:data:`END`: the pass stopped first), the engine's error (:data:`ERROR`, raised again as the
same type), or gone (:data:`SKIP`: someone removed the pass folder; the reader reads what is
there or fetches the sample directly). Each thread of a reader keeps one connection per pass
folder (so threads wait for their own samples); a wait broken off (an exception in the
reader) drops its connection, whose late answer could be taken for the next question's. The
server answers each word once, and drops it then.

A DataLoader worker reads a batch at a time (``S5Dataset.__getitems__``): it asks for the words
on all of the batch's early samples in one request (:func:`announce`, ``[i, j, ...]``), and the
server answers them in that order, each as soon as it knows it, the answers it knows together in
one write; the worker then reads each sample as its answer comes (:func:`ask`). A batch costs one
question, not one per sample, and a serving thread wakes only for the sample it waits for.

Liveness needs no guess from a parent's pid: a reader knows its server's process by the
credentials the kernel gives for the connection (pid and start time), and a reader whose
sampler's process ended (even while a child it forked holds the socket open) or whose pass
folder went stops waiting within :data:`_WATCH_S` and fetches the sample directly; a server
whose pass folder was removed (the next pass, ``close()``, the exit's cleanup, or someone else)
notices as soon, answers every wait with gone and ends.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from .._util.frames import (
    END,
    ERROR,
    INDEX,
    MAX_FRAME,
    NOTHING,
    SKIP,
    FrameError,
    Inbox,
    close_fd,
    error_data,
    error_of,
    frame,
    peer_of,
    peer_problem,
    read,
    unix_address,
)
from .._util.procs import ProcessId
from ..exceptions import S5LoaderError

#: The socket's name in a pass folder.
WORDS = ".w"

# How often the server looks whether its pass folder is still there.
_WATCH_S = 0.5

#: The most samples one request asks for (a larger batch is asked for in several).
MOST_ASKED = 1024
#: The most samples a batch asks for before reading an answer (the rest, one at a time), so that
#: its requests fit in a socket's buffer and neither side's write waits on the other's.
MOST_ANNOUNCED = 4 * MOST_ASKED

log = logging.getLogger(__name__)


class WordServer:
    """A pass's words, served to its readers (see the module docstring). :meth:`settle` gives
    sample ``index``'s word: ``True`` (staged), ``None`` (not staged) or an exception.

    Raises:
        OSError: no socket can be made in ``folder`` (the pass then hands out no sample early).
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.path = os.path.join(folder, WORDS)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address, fd = unix_address(folder, WORDS)
        try:
            self.sock.bind(address)
            self.sock.listen(64)
            self.inode = os.stat(self.path).st_ino
        except OSError:
            self.sock.close()
            raise
        finally:
            close_fd(fd)
        self.sock.settimeout(_WATCH_S)
        self.cond = threading.Condition()
        self.words: dict[int, Any] = {}
        self.awaited: set[int] = set()  # the samples a serving thread waits for
        self.gone = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, name="s5loader-words", daemon=True).start()

    def settle(self, index: int, word: Any) -> None:
        with self.cond:
            self.words[index] = word
            if index in self.awaited:
                self.cond.notify_all()

    def _there(self) -> bool:
        try:
            return os.stat(self.path).st_ino == self.inode
        except OSError:
            return False

    def _accept(self) -> None:
        try:
            while self._there():
                try:
                    conn, _ = self.sock.accept()
                except TimeoutError:
                    continue
                except OSError as exc:  # out of descriptors, say: the pass goes on, readers retry
                    if self.gone:
                        return
                    log.warning("the sampler's words in %s could not take a connection: %s", self.folder, exc)
                    time.sleep(_WATCH_S)
                    continue
                stranger = peer_problem(conn, "descendant")
                if stranger is not None:
                    log.warning(
                        "the sampler's words in %s refused a connection from %s", self.folder, stranger
                    )
                    conn.close()
                    continue
                conn.settimeout(None)
                with self.cond:
                    self._conns.append(conn)
                threading.Thread(target=self._serve, args=(conn,), name="s5loader-word", daemon=True).start()
        finally:
            self.close()

    def _serve(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        try:
            while True:
                raw = read(f)
                if not (
                    isinstance(raw, list) and 0 < len(raw) <= MOST_ASKED and all(type(i) is int for i in raw)
                ):
                    raise FrameError(f"not a request for words: {str(raw)[:80]!r}")
                while raw:
                    out = self._answers(raw)
                    try:
                        conn.sendall(b"".join(frame(_answer(i, w)) for i, w in out))
                    except OSError:
                        self._put_back(out)  # the reader went: the words stay for a later question
                        raise
                    raw = raw[len(out) :]
        except FrameError as exc:
            log.warning("the sampler's words in %s closed a connection that sent %s", self.folder, exc)
        except (EOFError, OSError):
            pass  # the reader's process ended, or the server closed
        finally:
            with self.cond, contextlib.suppress(ValueError):
                self._conns.remove(conn)  # (close() took the list already)
            f.close()
            with contextlib.suppress(OSError):
                conn.close()

    def _answers(self, asked: list[int]) -> list[tuple[int, Any]]:
        """The words on the first of ``asked`` (waiting for it) and on each next one known
        already, in order (:data:`_GONE` where the server is gone)."""
        out: list[tuple[int, Any]] = []
        with self.cond:
            first = asked[0]
            while first not in self.words and not self.gone:
                self.awaited.add(first)
                self.cond.wait()
            self.awaited.discard(first)
            for index in asked:
                if index in self.words:
                    out.append((index, self.words.pop(index)))
                elif self.gone:
                    out.append((index, _GONE))
                else:
                    break
        return out

    def _put_back(self, taken: list[tuple[int, Any]]) -> None:
        with self.cond:
            for index, word in taken:
                if word is not _GONE:
                    self.words[index] = word
            self.cond.notify_all()

    def close(self) -> None:
        """Answer every wait with gone and close; the socket file goes with the folder (or
        now, where it is still there). Safe to call twice."""
        with self.cond:
            if self.gone:
                return
            self.gone = True
            conns, self._conns = self._conns, []
            self.cond.notify_all()
        if self._there():
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            self.sock.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RD)  # a serving thread reading a request ends


_GONE = object()  # no word: the server is gone


def _answer(index: int, word: Any) -> list[Any]:
    if word is _GONE:
        return [SKIP, index, None]
    if word is True:
        return [INDEX, index, None]
    if word is None:
        return [END, index, None]
    return [ERROR, index, error_data(word)]


class _Reader(threading.local):
    """A reader thread's connections to the word servers of the passes it reads, one per pass
    folder, each with the process at its other end (a thread's own: several threads of one
    process wait for their own samples; a process forked from a reader makes its own)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.conns: dict[str, tuple[socket.socket, Inbox, ProcessId]] = {}
        # per connection, the samples asked for whose answers are still to be read, in order
        self.asked: dict[str, collections.deque[int]] = {}

    def conn(self, folder: str) -> tuple[socket.socket, Inbox, ProcessId] | None:
        if self.pid != os.getpid():  # forked: the parent's connections are the parent's
            self.pid, self.conns, self.asked = os.getpid(), {}, {}
        got = self.conns.get(folder)
        if got is not None:
            return got
        for old in [k for k in self.conns if not os.path.isdir(k)]:  # passes removed since
            self.drop(old)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fd = None
        try:
            address, fd = unix_address(folder, WORDS)
            sock.connect(address)
            server = ProcessId.of(peer_of(sock)[0])
        except OSError:
            sock.close()
            return None  # no server: the pass (or its process) is gone
        finally:
            close_fd(fd)
        if not server.alive():  # a socket left open in a child of a sampler that ended
            sock.close()
            return None
        stranger = peer_problem(sock, "ancestor")
        if stranger is not None:
            sock.close()
            raise S5LoaderError(
                f"the socket {os.path.join(folder, WORDS)} is not this DataLoader's sampler but "
                f"{stranger}; it was sent nothing"
            )
        got = self.conns[folder] = (sock, Inbox(), server)
        self.asked[folder] = collections.deque()
        return got

    def drop(self, folder: str) -> None:
        self.asked.pop(folder, None)
        got = self.conns.pop(folder, None)
        if got is not None:
            got[0].close()


_READER = _Reader()


def _reply(sock: socket.socket, inbox: Inbox, server: ProcessId, folder: str) -> Any:
    """The server's next frame; None when it is gone: its process ended (a child that it forked
    may still hold the socket open) or its folder was removed.

    Raises:
        EOFError: the server closed the connection; FrameError: not a frame of the channel.
    """
    while (value := inbox.take()) is NOTHING:
        if select.select([sock], [], [], _WATCH_S)[0]:
            got = sock.recv(MAX_FRAME)
            if not got:
                raise EOFError
            inbox.data += got
        elif not server.alive() or not os.path.exists(os.path.join(folder, WORDS)):
            return None
    return value


def announce(folder: str, indices: Sequence[int]) -> None:
    """Ask now for the words on ``indices`` of the pass in ``folder``, which this thread will
    read in this order: each :func:`ask` for one of them then reads the answer to this one
    request (the first :data:`MOST_ANNOUNCED` of them; each later one is asked for on its own).
    Answers left unread (a read broken off) drop the connection at the next question. Nothing is
    sent where no server answers (the samples are read as :func:`ask` says)."""
    if not indices:
        return
    got = _READER.conn(folder)
    if got is None:
        return
    if _READER.asked[folder]:  # answers of a batch broken off: theirs, not the next batch's
        _READER.drop(folder)
        got = _READER.conn(folder)
        if got is None:
            return
    asked = [int(i) for i in indices[:MOST_ANNOUNCED]]
    try:
        got[0].sendall(b"".join(frame(asked[k : k + MOST_ASKED]) for k in range(0, len(asked), MOST_ASKED)))
    except OSError:
        _READER.drop(folder)
        return
    _READER.asked[folder].extend(asked)


def ask(folder: str, index: int) -> bool:
    """Wait for the sampler's word on sample ``index`` of the pass in ``folder``: True once it
    is staged, False when the pass is gone (its folder, or the process that stages it): read
    it directly, as any sample not staged.

    Raises:
        the staging engine's error (FetchError, StallError, BudgetError, ...), as the sampler
        raises it; S5LoaderError: the pass stopped before the sample was staged (a newer
        iterator replaced it, or ``close()``), as the sampler's own wait says, or the socket is
        not the sampler's.
    """
    got = _READER.conn(folder)
    if got is not None and _READER.asked[folder] and _READER.asked[folder][0] != int(index):
        _READER.drop(folder)  # a read out of the announced order: the answers on the way are others'
        got = _READER.conn(folder)
    if got is None:
        return False
    sock, inbox, server = got
    asked = _READER.asked[folder]
    raw = error = None
    ok = False
    try:
        if asked:
            asked.popleft()  # announced: its answer comes with the batch's
        else:
            sock.sendall(frame([int(index)]))
        raw = _reply(sock, inbox, server, folder)
        ok = isinstance(raw, list) and len(raw) == 3 and raw[1] == int(index)
        if ok and raw[0] == ERROR:
            error = error_of(raw[2])
    except (EOFError, OSError, FrameError):
        ok = False
    finally:
        if raw is None or not ok:  # gone, or interrupted: the next reply would be this one's
            _READER.drop(folder)
    if not ok or raw is None:
        return False
    if raw[0] == INDEX:
        return True
    if raw[0] == END:
        raise S5LoaderError(
            f"sample {int(index)} of the staging pass {folder} was not staged: the pass was "
            "closed first (a newer iterator over the same S5Sampler replaced it, or close() was called)"
        )
    if error is not None:
        raise error
    return False  # gone: someone removed the pass folder
