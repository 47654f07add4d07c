"""What happens to a sample that failed: retried with backoff while its cause is transient,
then given up on under the error policy (``on_error``: raise, or skip and count it)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .._s5cmd import error_for
from ..config import StagingOptions
from ..exceptions import StagingSpaceError, StallError
from .stats import Stats

log = logging.getLogger(__name__)

# position -> (kind, message, URI): one failed sample, by the cause of its first failed object
Failures = dict[int, tuple[str, str, str]]

RETRIED_KINDS = ("transient", "stall", "endpoint")


class Retries:
    """The retry policy of one staging pass.

    Args:
        options: ``retries``, ``retry_backoff``, ``stall_timeout`` and ``on_error``.
        stats: counts retries, stalls and skipped samples.
        staging_path: named in a :class:`StagingSpaceError`.
        forget: called first for every failed position (its fields are no longer awaited).
        endpoint: the store's endpoint (``None``: AWS), named in errors about reaching it.
    """

    def __init__(
        self,
        options: StagingOptions,
        stats: Stats,
        staging_path: str,
        forget: Callable[[int], None],
        endpoint: str | None = None,
    ) -> None:
        self.opts = options
        self.endpoint = endpoint
        self.stats = stats
        self.staging_path = staging_path
        self.forget = forget
        self.attempts: dict[int, int] = {}  # position -> failed attempts so far
        self.stalled: set[int] = set()  # positions that failed by a stall at least once
        self.due: list[tuple[float, int]] = []  # (when, position) to stage again

    def take_due(self, now: float, most: int) -> list[int]:
        """Positions whose backoff is over (at most ``most``); they stay queued until
        :meth:`started`."""
        return sorted(p for t, p in self.due if t <= now)[:most]

    def started(self, positions: list[int]) -> None:
        done = set(positions)
        self.due = [(t, p) for t, p in self.due if p not in done]

    def failed(self, failures: Failures, give_up: Callable[[int, str, str, str], None]) -> None:
        """Retry or give up on each failed sample, in position order.

        Raises:
            StagingSpaceError: the staging file system is full (never retried).
            StallError: a sample stalled on its last attempt.
        """
        retry_again: list[int] = []
        for pos, (kind, msg, uri) in sorted(failures.items()):
            self.forget(pos)
            if kind == "no_space":
                raise StagingSpaceError(
                    f"the staging directory {self.staging_path} ran out of space while staging "
                    f"{uri}: {msg}; lower the budget or free space"
                )
            if kind in RETRIED_KINDS:
                n = self.attempts.get(pos, 0) + 1
                self.attempts[pos] = n
                if kind == "stall":
                    self.stalled.add(pos)
                if n <= self.opts.retries:
                    retry_again.append(pos)
                    continue
                if pos in self.stalled:
                    stalled = [u for p, (k, _, u) in failures.items() if k == "stall"] or [uri]
                    raise StallError(
                        f"staging from {self.endpoint or 'AWS S3'} made no progress for "
                        f"{self.opts.stall_timeout:g}s, {self.opts.retries} times; gave up on "
                        f"{len(stalled)} object(s): {', '.join(stalled[:5])}"
                        f"{' ...' if len(stalled) > 5 else ''}; "
                        "the store accepted the requests but sent no data: check its health and load, "
                        "or raise stall_timeout for a slow link"
                    )
                msg = f"failed after {self.opts.retries} retries: {msg}"
            give_up(pos, kind, msg, uri)
        if retry_again:
            self._schedule(retry_again, failures)

    def _schedule(self, retry_again: list[int], failures: Failures) -> None:
        self.stats.retries += len(retry_again)
        if any(failures[p][0] == "stall" for p in retry_again):
            self.stats.stalls += 1
        now = time.monotonic()
        for pos in retry_again:
            n = self.attempts[pos]
            delay = min(self.opts.retry_backoff * 2 ** (n - 1), 30.0)
            self.due.append((now + delay, pos))
        log.warning(
            "retrying %d sample(s) (attempt %d of %d): %s%s",
            len(retry_again),
            max(self.attempts[p] for p in retry_again),
            self.opts.retries,
            "; ".join(f"{failures[p][2]}: {failures[p][1]}" for p in retry_again[:3]),
            " ..." if len(retry_again) > 3 else "",
        )

    def give_up(self, key: str, kind: str, msg: str, uri: str) -> None:
        """Apply the error policy to a sample given up on: raise its error, or count it skipped."""
        error = error_for(kind, f"cannot stage {uri}: {msg}", self.endpoint)
        if self.opts.on_error == "raise":
            raise error
        log.warning("skipping sample %r: %s", key, error)
        self.stats.skipped.append(uri)
        self.stats.skip_errors[uri] = error
