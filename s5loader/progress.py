"""Progress of long operations (listing a large prefix, ``fetch``, ``bench --generate``, the
daemon): a bar redrawn in place when the stream is a terminal, a plain line every few seconds
when it is not (a job log). One helper for all of them; no dependency."""

from __future__ import annotations

import logging
import sys
import time
from typing import IO

from ._util.uri import format_size

__all__ = ["Progress"]

_WIDTH = 30


class Progress:
    """Progress of one operation on ``stream`` (stderr by default).

    On a terminal: ``LABEL [#####.....]  45.0% 1.2 MiB / 2.7 MiB  12.0 MB/s`` redrawn in
    place (at most 10 times a second), or ``LABEL 12345 objects  3000/s`` when the total is
    unknown. Elsewhere: the same text as a line every ``interval`` seconds, to ``logger``
    (at INFO) when one is given, else to the stream; and a last line from :meth:`close`.

    Args:
        label: what is going on (``"listing s3://b/train/"``).
        total: the amount to reach, or None when unknown.
        unit: ``"bytes"`` (sizes and MB/s) or a word for counted things (``"objects"``).
        stream: where to write; its ``isatty()`` picks the mode.
        tty: force the mode (None: ask the stream).
        interval: seconds between lines when not on a terminal.
        delay: seconds before anything is shown: operations quicker than this stay silent
            (except the last line of the line mode, when ``final_line``).
        logger: take the lines of the line mode (library code logs; commands own the terminal).
        final_line: in line mode, write a last line on :meth:`close`.
    """

    def __init__(
        self,
        label: str,
        total: int | None = None,
        *,
        unit: str = "objects",
        stream: IO[str] | None = None,
        tty: bool | None = None,
        interval: float = 5.0,
        delay: float = 0.0,
        logger: logging.Logger | None = None,
        final_line: bool = True,
    ) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.interval, self.delay, self.logger, self.final_line = interval, delay, logger, final_line
        self.done = 0
        self.t0 = time.monotonic()
        self._last = self.t0
        self._drawn = False
        self._shown = False  # a caller drew its own text with show()
        self._closed = False

    # -- feeding ------------------------------------------------------------------------------
    def update(self, n: int = 1) -> None:
        """Count ``n`` more done."""
        self.set(self.done + n)

    def set(self, done: int, total: int | None = None) -> None:
        """``done`` so far (and the total, if it changed)."""
        self.done = done
        if total is not None:
            self.total = total
        now = time.monotonic()
        if now - self.t0 < self.delay:
            return
        if self.tty:
            if now - self._last >= 0.1 or not self._drawn:
                self._last = now
                self._draw(self.text(now))
        elif now - self._last >= self.interval:
            self._last = now
            self._line(self.text(now))

    def __call__(self, done: int, total: int) -> None:
        """As a ``progress(done, total)`` callback (``s5loader.fetch.fetch``)."""
        self.set(done, total)

    # -- drawing ------------------------------------------------------------------------------
    def text(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        rate = self.done / max(now - self.t0, 1e-9)
        nbytes = self.unit == "bytes"
        amount = format_size(self.done) if nbytes else f"{self.done} {self.unit}"
        speed = f"{rate / 1e6:.1f} MB/s" if nbytes else f"{rate:.0f}/s"
        if self.total is None:
            return f"{self.label}  {amount}  {speed}"
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        of = format_size(self.total) if nbytes else str(self.total)
        bar = f" [{'#' * int(_WIDTH * frac)}{'.' * (_WIDTH - int(_WIDTH * frac))}]" if self.tty else ":"
        return f"{self.label}{bar} {100 * frac:5.1f}%  {amount} of {of}  {speed}"

    def show(self, text: str) -> None:
        """Draw ``text`` over the current line (terminal mode; the daemon draws its own text)."""
        self._shown = True
        self._draw(text)

    def _draw(self, text: str) -> None:
        self.stream.write("\r\x1b[K" + text)
        self.stream.flush()
        self._drawn = True

    def clear(self) -> None:
        """Wipe the bar so a log line starts on a clean line; the next update redraws it."""
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def _line(self, text: str) -> None:
        if self.logger is not None:
            self.logger.info("%s", text)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        """End the bar's line (terminal), or write the last line (line mode). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.tty:
            if self._drawn:
                if not self._shown:
                    self._draw(self.text())
                self.stream.write("\n")
                self.stream.flush()
                self._drawn = False
        elif self.final_line:
            self._line(f"{self.text()} in {time.monotonic() - self.t0:.1f}s")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
