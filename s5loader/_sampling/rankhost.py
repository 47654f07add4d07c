"""The staging of one rank of an :class:`~s5loader.S5IterableDataset`, in the process that hosts
it (the DataLoader's first worker, or the process itself without workers): one
:class:`~s5loader._sampling.run.StagingRun` over the rank's order, within the whole budget, whose
staged indices :mod:`.feed` hands to the workers that read them."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import json
import logging
import multiprocessing.util
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from .._engine.counters import Metrics
from .._staging.epochcache import EpochCache
from ..config import StagingOptions
from ..dataset import S5Dataset
from ..exceptions import StateError
from .cacheplan import node_ranks
from .feed import INDEX, SKIP, FeedHost, Hello
from .iterparts import Drawn, _Pass, owner, predraw, rank_order, remaining
from .mixing import few_shards
from .order import Order
from .staging import Staging

log = logging.getLogger("s5loader.iterable")
# How often a host writes its figures for the dataset's own process (S5IterableDataset.metrics).
PUBLISH_S = 0.5
# How long a host whose own worker ended waits for the rank's other workers to read their last
# samples before it removes the staged files.
READERS_S = 600.0


class RankHost:
    """A rank's staging run and the feed of its current pass.

    Args:
        dataset: the data set.
        options: the staging options (the rank's whole budget).
        root: the folder this host stages below (inside the iterable dataset's directory).
        order: the rank's order.
        cache: the epoch cache's folder (owned by the iterable dataset), with ``epoch_cache``.
    """

    def __init__(
        self,
        dataset: S5Dataset,
        options: StagingOptions,
        root: str,
        order: Order,
        cache: EpochCache | None = None,
    ) -> None:
        self.dataset = dataset
        self.cache = cache
        # the window, the cost of a shard order, the call size: the staging's (see Staging)
        self.staging = Staging.within(dataset, options, order, root)
        self.run = self.staging.run
        self.feed: FeedHost | None = None
        self._drawn = Drawn()

    def rank_order(self, order: Order, epoch: int, shuffle_buffer: int) -> tuple[list[int], list[int] | None]:
        """``order``'s rank's whole order of ``epoch`` (see :func:`.iterparts.rank_order`), drawn
        once (a pass and the epoch cache's plan ask for the same ones)."""
        run, st = self.run, self.staging
        args = (run.units, order, epoch, shuffle_buffer, run.blocks, st.window, st.cost)
        return self._drawn.get(args[1:4], functools.partial(rank_order, *args))

    def pass_order(self, p: _Pass, order: Order) -> tuple[list[int], list[int] | None]:
        """The whole order of ``order``'s rank in pass ``p``'s epoch: the rank's order, or (an
        epoch resumed on another layout) its part of what the epoch had left, without windows."""
        if p.rest is None:
            return self.rank_order(order, p.epoch, p.shuffle_buffer)
        rest = p.rest
        return (
            rest.part(
                len(self.dataset),
                lambda first: self.rank_order(first, rest.epoch, rest.shuffle_buffer)[0],
                order.num_replicas,
                order.rank,
                order.drop_last,
            ),
            None,
        )

    def open(self, name: str, p: _Pass, key: str = "") -> FeedHost:
        """Begin a pass for ``p`` (this process's own worker) and its sibling workers, which
        connect to ``name``; the pass before it, if any, stops. The rank's first pass says when
        its budget holds few shards (see :func:`.mixing.few_shards`)."""
        self.close_pass()
        self._warn_few_shards(p)
        hello = Hello(p.worker, p.num_workers, p.epoch, p.yielded, p.plan, key)
        nw, chunk = p.num_workers, p.chunk
        self.feed = FeedHost(
            name, hello, lambda hellos: self._serve(p, hellos), lambda q: owner(q, nw, chunk)
        ).start()
        predraw(self, p)
        return self.feed

    def _serve(self, p: _Pass, hellos: dict[int, Hello]) -> Iterator[tuple[int, tuple[str, Any]]]:
        """The pass: stage what the workers still need of the rank's order, in order, and say
        what became of each position."""
        for h in hellos.values():
            if (h.num_workers, h.epoch, h.plan) != (p.num_workers, p.epoch, p.plan):
                raise StateError(
                    f"DataLoader worker {h.worker} begins epoch {h.epoch} with {h.plan} while worker "
                    f"{p.worker} begins epoch {p.epoch} with {p.plan}: resume every worker from states "
                    "of one StatefulDataLoader"
                )
        order, windows = self.pass_order(p, p.order)
        rest = remaining(len(order), [hellos[w].start for w in range(p.num_workers)], p.chunk)
        if self.cache is not None and self.run.cache is None:
            self.staging.use_cache(self.cache.sharer(), self.cache_orders(p))
        wins = _windows_of(windows, rest)
        staged = [order[q] for q in rest]
        log.debug("rank %d epoch %d: staging %d of %d positions", p.rank, p.epoch, len(rest), len(order))
        stream = self.staging.stage_order(staged, wins, lambda: p.epoch, True, p.order.shuffle)
        board = metrics_board(self.run.area.root, p.rank)
        published = 0.0
        try:
            # the stream first: it yields one item per position, and is run to its end
            for s, q in zip(stream, rest, strict=True):
                yield q, ((INDEX, s) if s is not None else (SKIP, None))
                if time.monotonic() - published > PUBLISH_S:
                    published = time.monotonic()
                    self._publish(board, p.epoch, len(order))
        finally:
            stream.close()
            self._publish(board, p.epoch, len(order))

    def _warn_few_shards(self, p: _Pass) -> None:
        """Warn once per data set and rank, whichever worker process hosts the rank (a mark among
        the data set's control files says it was said)."""
        few = few_shards(
            self.dataset, self.run.options.budget, self.staging.cost, p.order.shuffle, "S5IterableDataset"
        )
        if not few:
            return
        mark = os.path.join(self.run.area.root, ".calls", f"mixing-r{p.rank}")
        try:
            os.close(os.open(mark, os.O_CREAT | os.O_EXCL))
        except OSError:
            return  # said already (or the dataset's directory is gone)
        warnings.warn(few, UserWarning, stacklevel=4)

    def _publish(self, board: str, epoch: int, samples: int) -> None:
        """Write the pass's figures where the process that made the dataset reads them."""
        figures = self.metrics(epoch, samples).as_dict()
        tmp = f"{board}.{os.getpid()}.tmp"
        with contextlib.suppress(OSError):  # the dataset's directory is gone: nobody reads them
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(figures, f)
            os.replace(tmp, board)

    def cache_orders(self, p: _Pass) -> Callable[[int], list[list[int]]]:
        """The orders of the node's local ranks that the epoch cache they share plans on."""
        ranks = node_ranks(p.rank, p.num_replicas)

        def orders(epoch: int) -> list[list[int]]:
            if epoch == p.epoch:  # this pass's epoch: maybe a rest resumed on another layout
                return [self.pass_order(p, dataclasses.replace(p.order, rank=r))[0] for r in ranks]
            return [
                self.rank_order(dataclasses.replace(p.order, rank=r), epoch, p.shuffle_buffer)[0]
                for r in ranks
            ]

        return orders

    def metrics(self, epoch: int, samples: int) -> Metrics:
        return self.run.metrics(epoch, samples)

    def close_pass(self) -> None:
        """Stop the current pass (its feed and its engine). Safe to call twice."""
        feed, self.feed = self.feed, None
        if feed is not None:
            feed.stop.set()
            self.run.passes.close_active()
            feed.close()

    def close(self) -> None:
        """Stop staging, kill s5cmd, remove this host's folder once the other workers read what
        was sent to them (a DataLoader ends the host's worker as soon as its own share is done,
        while the others may still be reading). Safe to call twice."""
        feed = self.feed
        if feed is not None and not feed.wait_readers(READERS_S):
            log.warning("DataLoader workers still reading after %.0f s; removing the staged files", READERS_S)
        self.close_pass()
        self.run.close()


def metrics_board(area: str, rank: int) -> str:
    """Where the host of ``rank`` writes its figures: among the control files of the dataset's
    directory ``area`` (see :attr:`StagingArea.control_dir
    <s5loader._staging.area.StagingArea.control_dir>`)."""
    return os.path.join(area, ".calls", f"metrics-r{rank}.json")


def read_board(area: str, rank: int) -> Metrics | None:
    """The figures the host of ``rank`` last wrote, or None before any."""
    try:
        with open(metrics_board(area, rank), encoding="utf-8") as f:
            figures = json.load(f)
    except (OSError, ValueError):
        return None
    names = {f.name for f in dataclasses.fields(Metrics)}
    return Metrics(**{k: v for k, v in figures.items() if k in names})


class Hosting:
    """Where an iterable dataset's rank is hosted: the :class:`RankHost` of this process (made
    on first use, kept across epochs by persistent workers), never carried to another process.

    Args:
        dataset, options, cache: as for :class:`RankHost`; ``options.staging_dir`` is the
            iterable dataset's own directory, which the host stages below.
        shuffle: the data set's ``shuffle``, which lays out the host's staging (a pass resumed
            from a state of another ``shuffle`` is staged with the state's).
    """

    def __init__(
        self, dataset: S5Dataset, options: StagingOptions, shuffle: bool | str, cache: EpochCache | None
    ) -> None:
        self.dataset = dataset
        self.options = options
        self.shuffle = shuffle
        self.cache = cache
        self.owner = os.getpid()  # the process that made the dataset (and removes its directory)
        self._host: RankHost | None = None
        self._key: tuple[int, ...] | None = None

    def host(self, p: _Pass) -> RankHost:
        """This process's host for rank ``p.rank``."""
        key = (os.getpid(), p.rank, p.num_replicas)
        if self._host is not None and self._key == key:
            return self._host
        self.close()
        assert self.options.staging_dir is not None
        order = dataclasses.replace(p.order, shuffle=self.shuffle)
        host = RankHost(self.dataset, self.options, self.options.staging_dir, order, self.cache)
        self._host, self._key = host, key
        if key[0] != self.owner:
            # A DataLoader worker runs no atexit handlers; multiprocessing's finalizers do run.
            multiprocessing.util.Finalize(None, host.close, exitpriority=10)
        return host

    def metrics(self, epoch: int, samples: int) -> Metrics | None:
        host = self._host
        if host is None or self._key is None or self._key[0] != os.getpid():
            return None
        return host.metrics(epoch, samples)

    def close(self) -> None:
        """Stop this process's host, if it runs one. Safe to call twice."""
        host, self._host = self._host, None
        if host is not None and self._key is not None and self._key[0] == os.getpid():
            host.close()

    def __getstate__(self) -> dict[str, Any]:
        # threads and s5cmd children never cross a process boundary
        return {**self.__dict__, "_host": None, "_key": None}


def _windows_of(windows: list[int] | None, rest: list[int]) -> list[int] | None:
    """Where the windows of a block order begin among the positions ``rest`` still staged."""
    if windows is None or not rest:
        return None
    if len(rest) == rest[-1] + 1:  # nothing read yet: the positions are the order's own
        return windows
    out = sorted({bisect.bisect_left(rest, w) for w in windows} - {len(rest)})
    return out if out and out[0] == 0 else [0, *out]
