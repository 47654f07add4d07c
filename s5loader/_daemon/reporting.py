"""The daemon's progress: a bar on a terminal, JSON lines for machines."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any

from .._util.uri import format_size
from ..progress import Progress


class ProgressReporter:
    """A progress bar on a terminal and/or JSON lines for machines."""

    def __init__(self, budget: int, total: int, bar: bool, json_out: IO[str] | None) -> None:
        self.budget = budget
        self.total = total
        self.bar = bar
        self.json_out = json_out
        self._last = 0.0
        self._line = Progress("prefetch", total, tty=True)
        self.bar_filter: logging.Filter | None = None

    def event(self, name: str, **fields: Any) -> None:
        if self.json_out is not None:
            rec = {"event": name, "time": round(time.time(), 3), **fields}
            self.json_out.write(json.dumps(rec) + "\n")
            self.json_out.flush()

    def tick(self, snap: dict[str, Any], force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < (0.25 if self.bar else 1.0):
            return
        self._last = now
        if self.bar:
            self._draw(snap)
        self.event("progress", **snap)

    def _draw(self, s: dict[str, Any]) -> None:
        width = 20
        filled = min(width, int(width * s["cache_bytes"] / self.budget)) if self.budget else 0
        line = (
            f"staged {s['delivered']}/{self.total}  consumed {s['consumed']}  "
            f"cache [{'#' * filled}{'.' * (width - filled)}] {format_size(s['cache_bytes'])}"
            f"/{format_size(self.budget)}  {s['mb_s']:.1f} MB/s"
        )
        self._line.show(line)

    def clear_line(self) -> None:
        """Wipe the bar so a log line starts on a clean line; the next tick redraws it."""
        self._line.clear()

    def close(self) -> None:
        """End the bar's line and take its filter off the log handlers. Safe to call twice."""
        self._line.close()
        bar_filter, self.bar_filter = self.bar_filter, None
        if bar_filter is not None:
            for handler in logging.getLogger().handlers:
                handler.removeFilter(bar_filter)


class _ClearBar(logging.Filter):
    """Put on the CLI's log handlers: clears the progress bar before each log line."""

    def __init__(self, reporter: ProgressReporter) -> None:
        super().__init__()
        self.reporter = reporter

    def filter(self, record: logging.LogRecord) -> bool:
        self.reporter.clear_line()
        return True


def open_reporter(
    budget: int, total: int, json_log: str | None, progress: bool | None
) -> tuple[ProgressReporter, IO[str] | None]:
    """A reporter for ``--json-log`` and ``--progress``; and the file it writes to, if one
    was opened (the caller closes it). The bar clears itself before each log line."""
    json_out: IO[str] | None = None
    opened: IO[str] | None = None
    if json_log == "-":
        json_out = sys.stdout
    elif json_log:
        json_out = opened = open(json_log, "a", encoding="utf-8")  # noqa: SIM115
    bar = sys.stderr.isatty() if progress is None else progress
    reporter = ProgressReporter(budget, total, bar, json_out)
    if bar:
        reporter.bar_filter = _ClearBar(reporter)
        for handler in logging.getLogger().handlers:
            handler.addFilter(reporter.bar_filter)
    return reporter, opened
