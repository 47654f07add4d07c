"""The engine's end of a pass's release FIFO (:class:`ReleaseEvents`): the readers write the
index of each sample they release into it (see :meth:`StagingLayout.release
<s5loader._staging.layout.StagingLayout.release>`), and the engine's selector wakes on it."""

from __future__ import annotations

import errno
import os
import weakref

from .layout import StagingLayout


class ReleaseEvents:
    """The engine's end of a pass's release FIFO.

    :meth:`open` creates the FIFO and opens it for reading, and keeps a write end of its own
    so the read end never sees end-of-file between readers (and :meth:`wake` can interrupt a
    select). :meth:`fileno` goes into the engine's selector; :meth:`read` returns the indices
    released since the last call. The descriptors are closed in forked children (a DataLoader
    worker must not keep the pipe open after the engine closed it). ``close`` is idempotent.
    """

    def __init__(self, layout: StagingLayout) -> None:
        self.path = layout.releases
        self._rfd = -1
        self._wfd = -1
        self._buf = b""
        self.freed: dict[int, int] = {}  # bytes given back by samples read, per index (see read)

    def open(self) -> ReleaseEvents:
        try:
            os.mkfifo(self.path, 0o600)
        except FileExistsError:
            pass
        self._rfd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._wfd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        _OPEN.add(self)
        return self

    def fileno(self) -> int:
        return self._rfd

    def read(self) -> list[int]:
        """The indices released since the last call (never blocks); bytes that samples read
        gave back by then are added to :attr:`freed`."""
        chunks = [self._buf]
        while True:
            try:
                chunk = os.read(self._rfd, 1 << 16)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EBADF:
                    break
                raise
            if not chunk:
                break
            chunks.append(chunk)
        data = b"".join(chunks)
        *lines, self._buf = data.split(b"\n")
        out = []
        for line in lines:
            try:
                index, _, freed = line.partition(b" ")
                if freed:
                    self.freed[int(index)] = self.freed.get(int(index), 0) + int(freed)
                else:
                    out.append(int(index))
            except ValueError:
                continue  # an empty line is a wake-up
        return out

    def wake(self) -> None:
        """Make the read end readable, so a select on it returns."""
        if self._wfd >= 0:
            try:
                os.write(self._wfd, b"\n")
            except OSError:
                pass

    def close(self) -> None:
        _OPEN.discard(self)
        fds, (self._rfd, self._wfd) = (self._rfd, self._wfd), (-1, -1)
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass


_OPEN: weakref.WeakSet[ReleaseEvents] = weakref.WeakSet()


def _close_in_child() -> None:
    for events in list(_OPEN):
        events.close()


os.register_at_fork(after_in_child=_close_in_child)
