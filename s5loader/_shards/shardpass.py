"""One sampler pass over tar shards: which shards to stage in which order, and opening each
staged shard for the readers.

The sampler's order is of samples; the engine stages shards. A *visit* is one staging of a
shard: the samples of the shard at the positions that follow its first, until a sample of it
comes a second time (padding can repeat samples), which starts the shard's next visit. The
engine stages the visits in the order of their first position, one ``cp`` per shard, and
frees a shard when the readers dropped the claims of every sample of its visit.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from .._staging.holes import give_back_unneeded
from .._staging.layout import StagingLayout
from .._util.uri import format_size
from ..config import StagingOptions
from ..dataset import S5Dataset
from ..exceptions import BudgetError, S5LoaderError
from . import tar as _tar
from .holding import Holding
from .streamed import ShardStream

if TYPE_CHECKING:
    from .._engine import Stager

log = logging.getLogger(__name__)


class Hits(Protocol):
    """An epoch cache's hits for a pass (see :class:`~s5loader._sampling.cacherun.Hits`): ``x in
    hits`` takes unit ``x`` out of the cache into the pass folder; :meth:`has` only asks;
    :meth:`keeps` says whether unit ``x`` goes back to the cache after the pass (then it is not
    punched as it is read)."""

    def __contains__(self, unit: object) -> bool: ...

    def has(self, unit: int) -> bool: ...

    def keeps(self, unit: int) -> bool: ...


class _Kept:
    """The engine's ``kept`` units of a shard pass: ``streamed``, and the cache's hits among the
    shards visited ``once``."""

    def __init__(self, streamed: int, hits: Hits | None, once: set[int]) -> None:
        self.streamed, self.hits, self.once = streamed, hits, once

    def __contains__(self, shard: object) -> bool:
        if shard == self.streamed:
            return True
        return self.hits is not None and shard in self.once and shard in self.hits


_UNOPENED, _OPEN, _SKIPPED = 0, 1, 2


class ShardPass:
    """The visits of one pass, and the sampler's side of them (wait, check, claim)."""

    def __init__(
        self,
        dataset: S5Dataset,
        order: Sequence[int],
        folder: str,
        keep: bool,
        on_error: str,
        frees: bool = False,
        hits: Hits | None = None,
    ) -> None:
        assert dataset.shards is not None, "a shard pass needs a dataset of shards"
        self.dataset = dataset
        self.shards = dataset.shards
        self.frees = frees  # the order counts what samples free as they are read (see peak_bytes)
        self.layout = StagingLayout(folder)
        self.keep = keep
        self.on_error = on_error
        self._visit(order)
        self.state = bytearray(len(self.shard_of_visit))
        self.order = order
        # The epoch cache's hits: a shard in the cache is moved into the pass folder instead of
        # fetched; one the pass visits twice (padding repeats samples) is fetched each time.
        visits = Counter(self.shard_of_visit)
        self.hits = hits
        self.once = {s for s, k in visits.items() if k == 1}
        self.stream: ShardStream | None = None
        self.yielded: set[int] = set()  # samples of the streamed shard handed to the readers
        self.streamed = 0 if self._can_stream_first() else None

    def _visit(self, order: Sequence[int]) -> None:
        """Cut ``order`` into shard visits: a visit is a run of positions in one shard that
        needs none of its samples twice (padding repeats samples: a shard is then visited again)."""
        self.visit_of: list[int] = []
        self.sample_of: list[int] = []  # per position, the sample's number in its shard
        self.shard_of_visit: list[int] = []
        self.needed: list[list[int]] = []
        self.last: list[int] = []
        current: dict[int, int] = {}
        seen: list[set[int]] = []
        for pos, idx in enumerate(order):
            s, j = self.shards.locate(idx)
            v = current.get(s, -1)
            if v < 0 or j in seen[v]:
                v = len(self.shard_of_visit)
                current[s] = v
                self.shard_of_visit.append(s)
                self.needed.append([])
                self.last.append(pos)
                seen.append(set())
            self.needed[v].append(j)
            seen[v].add(j)
            self.last[v] = pos
            self.visit_of.append(v)
            self.sample_of.append(j)

    def _can_stream_first(self) -> bool:
        """Whether the first shard of the pass is read while it downloads (see
        _shards/stream.py): a plain tar that the pass visits once and does not keep.

        An order that counts what its samples give back counts the samples a visit does not
        need as given back when the shard opens, which a shard read while it downloads does
        not do: such a pass streams its first shard only when it needs every sample of it."""
        first = self.shard_of_visit[0] if self.shard_of_visit else -1
        return (
            first in self.once
            and not self.keep
            and not _tar.is_gzip(self.shards[first].uri)
            and not (self.hits is not None and self.hits.has(first))
            and not (self.frees and len(self.needed[0]) < self.shards[first].nsamples)
        )

    # -- the pass's units, as the engine asks them (see s5loader._sampling.units) -------------
    FIRST_SAMPLES = 16  # the first call stages the shards the pass's first samples lie in
    first_workers = None  # shards land one after another, at the capped workers (SHARD_WORKERS)

    @property
    def first_call(self) -> int:
        """Units of the engine's first call (then twice, four times as many...): the shard
        visits of the pass's first :data:`FIRST_SAMPLES` samples, so that a shuffled order's
        first batches, drawn from several shards, wait for one call of them downloading side
        by side instead of for a chain of calls. The shard read while it downloads counts
        among them (the engine skips it, in the call's span) and the visits are numbered in
        order of first use, so the call stages the others."""
        return max(1, len(set(self.visit_of[: self.FIRST_SAMPLES])))

    @property
    def streams_first(self) -> bool:
        """The pass's first shard is read while it downloads (see :meth:`start`)."""
        return self.streamed is not None

    def engine_options(self, options: StagingOptions) -> StagingOptions:
        """``samples_per_call`` counted in shards (see :meth:`calls`)."""
        return replace(options, samples_per_call=self.calls(options.samples_per_call))

    def engine_kept(self, hits: Hits | None) -> _Kept:
        """The shards the engine must not stage: the one read while it downloads, and the
        epoch cache's hits (moved into the pass folder when the engine reaches them)."""
        return _Kept(self.shard_of_visit[0] if self.streamed is not None else -1, hits, self.once)

    def unit_of(self, index: int) -> int:
        return self.shards.locate(index)[0]

    def engine_windows(self, windows: list[int] | None) -> None:
        return None  # the engine stages shard visits, cut anywhere

    def start(self, stager: Stager, options: StagingOptions) -> None:
        """Start reading the first shard while it downloads (if it is), its bytes held in the
        budget of ``stager`` from now until the pass releases it."""
        if self.streamed is None:
            return
        s = self.shard_of_visit[self.streamed]
        stager.hold(s, self.shards[s].disk)
        path = self.layout.path(s, self.dataset.samples[s], 0)
        self.stream = ShardStream(
            self.layout,
            self.shards,
            s,
            path,
            self.needed[self.streamed],
            self.dataset.access,
            verify=options.verify,
            retries=options.retries,
            stall_timeout=options.stall_timeout,
            count=stager.stats.count_requests,
        ).start()

    def finish(self, stager: Stager) -> None:
        """The pass read its last sample: an error the streamed shard found at its end (after
        its samples) is raised now, or under ``on_error="skip"`` logged and counted."""
        stream = self.stream
        if stream is None:
            return
        stream.join()
        if stream.error is not None:
            self._stream_failed(stream, stream.error, stager)
        else:
            with stager.ready.cond:  # staged like any other shard, by another way
                stager.stats.staged_units += 1
                stager.stats.staged_bytes += stream.shard.size

    def close(self) -> None:
        """Stop a download still running and join it. Safe to call twice."""
        if self.stream is not None:
            self.stream.close()

    def stop(self) -> None:
        """Tell a download still running to stop, without waiting (a signal handler's)."""
        if self.stream is not None:
            self.stream.stop.set()

    def _stream_failed(self, stream: ShardStream, exc: S5LoaderError, stager: Stager) -> None:
        if self.on_error != "skip":
            self.layout.drop_shard(stream.index)
            raise exc
        if stream.shard.uri not in stager.stats.skip_errors:
            log.warning("skipping the samples of %s not yet read: %s", stream.shard.uri, exc)
            stager.stats.skipped.append(stream.shard.uri)
            stager.stats.skip_errors[stream.shard.uri] = exc
            # the samples already yielded are read as usual: drop only the other claims, so
            # the last reader deletes the shard (or this does, when no sample was yielded)
            for j in set(self.needed[self.streamed or 0]) - self.yielded:
                self.layout.release_shard_sample(stream.index, j)

    @property
    def engine_order(self) -> list[int]:
        """The shards to stage, one entry per visit."""
        return self.shard_of_visit

    def peak_bytes(self) -> tuple[int, int]:
        """The most bytes of shards that must be staged at once, and the position where that
        peak is reached. A shard stays from its visit's first sample to its last; with
        ``frees``, less what its samples give back as they are read, and from its opening what
        the samples the visit does not need give back (see :mod:`.holding`)."""
        held: Holding | None = Holding(self.shards) if self.frees else None
        whole = 0
        peak = at = 0.0
        opened = bytearray(len(self.shard_of_visit))
        for pos, v in enumerate(self.visit_of):
            s = self.shard_of_visit[v]
            if not opened[v]:
                opened[v] = 1
                if held is not None:
                    held.open(v, s, None if v == self.streamed else self.needed[v])
                else:
                    whole += self.shards[s].disk
                now = held.held if held is not None else whole
                if now > peak:
                    peak, at = now, pos
            if held is not None:
                held.done(v, self.sample_of[pos])
            if self.last[v] == pos:
                if held is not None:
                    held.close(v)
                else:
                    whole -= self.shards[s].disk
        return math.ceil(peak), int(at)

    def check_budget(self, budget: int, shuffle: bool | str) -> None:
        """Raise :class:`BudgetError` when the shards one stretch of the order needs at once
        cannot fit the budget (the pass could never go on)."""
        peak, _ = self.peak_bytes()
        if peak <= budget:
            return
        how = (
            "lower samples_per_call (the window samples are shuffled in, which sets how many "
            "shards are open at once) or raise the budget"
            if shuffle == "block"
            else "the order keeps as many shards open as the budget held when it was made (a resumed "
            "state keeps its own): raise the budget"
        )
        raise BudgetError(
            f"the shards of {self.dataset.source} that this order needs staged at once take "
            f"{format_size(peak)}, more than the budget of {format_size(budget)}: {how}"
        )

    def calls(self, samples_per_call: int) -> int:
        """The shards a full call stages: about ``samples_per_call`` samples' worth, at least
        one. The engine's first call is smaller (:attr:`first_call`), the next ones twice as
        many each, so the first batch does not wait for a call of shards sharing the link."""
        per_shard = max(1.0, len(self.visit_of) / max(1, len(self.shard_of_visit)))
        return max(1, round(samples_per_call / per_shard))

    def take(self, pos: int, stager: Stager) -> bool:
        """Whether the sample at ``pos`` can be yielded: waits for its shard to be staged and
        opens it on first use. False for a sample of a shard that was skipped."""
        v = self.visit_of[pos]
        if v == self.streamed and self.stream is not None:
            if self.state[v] == _UNOPENED:
                self.state[v] = _OPEN
            if self.state[v] == _OPEN:
                j = self.shards.locate(self.order[pos])[1]
                try:
                    self.stream.wait(j)
                    self.yielded.add(j)
                except S5LoaderError as exc:
                    self.state[v] = _SKIPPED
                    self._stream_failed(self.stream, exc, stager)
            return self.state[v] == _OPEN
        if self.state[v] == _UNOPENED:
            ok = stager.wait(v)
            if ok:
                s = self.shard_of_visit[v]
                if not self.keep:
                    stager.yielded(s)
                ok = self._open(v, s, stager)
            self.state[v] = _OPEN if ok else _SKIPPED
        return self.state[v] == _OPEN

    def _open(self, v: int, s: int, stager: Stager) -> bool:
        layout = self.layout
        if self.keep:
            try:
                with open(layout.shard_table(s), "rb"):
                    return True  # checked in an earlier epoch
            except FileNotFoundError:
                pass
        uri = self.shards[s].uri
        try:
            path = layout.path(s, self.dataset.samples[s], 0)
            if _tar.is_gzip(uri):
                _tar.gunzip_file(path, uri)  # read by offset: the tar replaces it, within its DISK
            kept = (
                _kept_table(layout, s, self.shards[s].nsamples)
                if self.hits is not None and self.hits.has(s)
                else None
            )
            members: _tar.Table | list[_tar.TarSample]
            if kept is None:
                scanned = _tar.scan_file(path, uri)
                self.shards.check_members(s, scanned)
                layout.open_shard(s, _tar.dumps(scanned), [] if self.keep else self.needed[v])
                members = scanned
            else:  # an epoch cache's hit: its member table came with it
                layout.claim_shard(s, [] if self.keep else self.needed[v])
                members = kept
            if self.frees and not self.keep and len(self.needed[v]) < len(members):
                # what this visit does not need (read earlier in the epoch, another rank's) goes now,
                # or, for a shard the epoch cache keeps whole, counts against the cache from now on
                whole = self.hits is not None and self.hits.keeps(s)
                freed = give_back_unneeded(
                    path,
                    self.shards.spans(s, members, os.path.getsize(path)),
                    set(self.needed[v]),
                    punch=not whole,
                )
                if freed:
                    layout.notify(s, freed)
        except S5LoaderError as exc:
            if self.on_error != "skip":
                layout.drop_shard(s)
                raise
            log.warning("skipping the %d sample(s) of %s: %s", len(self.needed[v]), uri, exc)
            stager.stats.skipped.append(uri)
            stager.stats.skip_errors[uri] = exc
            layout.drop_shard(s)
            return False
        return True


def _kept_table(layout: StagingLayout, s: int, count: int) -> _tar.Table | None:
    """The member table of ``count`` samples an epoch cache's hit ``s`` kept from the pass that
    scanned it (the entry is checked against its listing when it is taken), or None: scan it."""
    try:
        with open(layout.shard_table(s), "rb") as fh:
            table = _tar.loads(fh.read())
    except (OSError, ValueError):
        return None
    return table if len(table) == count else None
