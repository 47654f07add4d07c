"""S5Sampler: orders the samples, stages them ahead with s5cmd, and yields their indices."""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from torch.utils.data import Sampler

from ._blocks import plan_blocks
from ._dist import rank_info
from ._order import WINDOW_CAP, ShuffleQuality, block_window, shuffle_quality  # noqa: F401 (WINDOW_CAP)
from ._order import Order as _Order
from ._platform import require_linux
from ._resume import STATE_VERSION, check_state
from ._s5cmd import S5cmd, write_command_file
from ._uri import format_size, parse_size
from .config import StagingOptions
from .dataset import S5Dataset, StagedIndex
from .engine import Stager, Stats, plan_call
from .engine.budget import check_sample_fits
from .engine.metrics import Metrics
from .exceptions import BudgetError, ConfigError, StateError
from .staging.area import PassArea, StagingArea, choose_root, disk_footprint, register_cleanup

log = logging.getLogger(__name__)

# "data starvation" is a WARNING only when waiting takes this share of an epoch, in a run
# (all passes of the sampler so far) at least this long; a short run is not worth tuning.
_STARVED_SHARE = 0.2
_STARVED_MIN_RUN_S = 60.0


class S5Sampler(Sampler[int]):
    """A drop-in Sampler (and ``DistributedSampler``) that stages samples with s5cmd.

    Each epoch it orders the indices (a permutation per ``seed + epoch`` when ``shuffle``),
    takes this rank's part, and stages it into a directory of its own with background
    ``s5cmd run`` calls of ``samples_per_call`` samples, ``calls_in_flight`` of them at once, never
    holding more than ``budget`` bytes staged and not yet read. It yields an index only when
    that sample's files are staged, in order. The :class:`S5Dataset` reads and deletes them.

    Args:
        dataset: the :class:`S5Dataset` to stage for.
        shuffle: ``True``: a new permutation of all samples each epoch (call
            :meth:`set_epoch`); ``"block"``: permute blocks of up to ``block_size`` samples
            that share a key prefix, gather them into windows of whole blocks, and shuffle the
            samples within each window; a window holds as many samples as ``calls_in_flight + 1``
            windows fit in ``budget`` (at most 8192), so a batch draws from many blocks, and
            s5cmd fetches each block with one wildcard request (about 2.5x less s5cmd CPU
            than one request per object); ``False``: key order.
        seed: the permutation's seed; the same seed and epoch give the same order everywhere.
        samples_per_call: samples per s5cmd command file (with ``shuffle="block"``, at least
            one window, so that a call holds its windows' blocks whole).
        block_size: most samples in a block (see ``shuffle``). A call that holds a whole
            block fetches it with one wildcard line, whatever the shuffle.
        calls_in_flight: s5cmd calls running at once (2: double buffering).
        staging_dir: the staging root; ``None`` picks ``/dev/shm`` when it has room for the
            budget, else the system temp directory. Each sampler stages into a directory of
            its own below it, removed by :meth:`close`, garbage collection, exit or SIGTERM.
        budget: most bytes staged and not yet read at any instant (``"2GiB"``, ``"500MB"``
            or an int); it must hold at least a batch and the DataLoader's prefetch.
        keep_staged: keep staged files across epochs (needs a budget that holds this rank's
            whole part of the data set); later epochs then fetch nothing.
        shrink_budget: shrink a budget larger than the free space instead of failing.
        stall_timeout: seconds without progress after which an s5cmd call is killed and its
            unfinished part retried.
        retries: how often a sample that failed for a transient reason is retried.
        on_error: ``"raise"`` (default) or ``"skip"`` a sample that cannot be fetched (a 404,
            a 403, or transient errors beyond ``retries``); skips are logged and counted in
            :attr:`stats`.
        verify: check each staged file's size and, for single-part uploads, MD5 ETag.
        num_replicas, rank: the distributed split; defaults from torch.distributed, else
            ``WORLD_SIZE`` / ``RANK``, else one process.
        drop_last: drop the tail so ranks get equal parts, instead of padding by repetition.
        s5cmd_workers: s5cmd's ``--numworkers`` (parallel requests per call).
        batch_size: the DataLoader's ``batch_size``, if you pass it here too (a sampler does not
            see its DataLoader): a budget that cannot hold one batch of the largest samples is
            then a :class:`BudgetError` at once instead of after ``stall_timeout``.
        buffers, numworkers: the former names of ``calls_in_flight`` and ``s5cmd_workers``;
            still accepted for one release, with a ``DeprecationWarning``.

    The staging options are checked by :class:`~s5loader.StagingOptions`, the object the
    prefetch daemon builds too; the store is reached as the dataset's ``access`` says.

    Raises:
        ConfigError: an invalid option.
        BudgetError: a sample larger than the budget, a budget larger than the free space, or
            (with ``batch_size``) a budget smaller than a batch.
        PlatformError: not Linux.
    """

    def __init__(
        self,
        dataset: S5Dataset,
        *,
        shuffle: bool | str = True,
        seed: int = 0,
        samples_per_call: int = 1000,
        block_size: int = 64,
        calls_in_flight: int = 2,
        staging_dir: str | None = None,
        budget: int | str = "2GiB",
        keep_staged: bool = False,
        shrink_budget: bool = False,
        stall_timeout: float = 60.0,
        retries: int = 3,
        on_error: str = "raise",
        verify: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        s5cmd_workers: int = 256,
        batch_size: int | None = None,
        buffers: int | None = None,
        numworkers: int | None = None,
    ) -> None:
        require_linux("S5Sampler")
        if not isinstance(dataset, S5Dataset):
            raise ConfigError(f"S5Sampler needs an S5Dataset, got {type(dataset).__name__}")
        if shuffle not in (True, False, "block"):
            raise ConfigError(f"shuffle must be True, False or 'block', got {shuffle!r}")
        if not isinstance(seed, int):
            raise ConfigError(f"seed must be an int, got {seed!r}")
        calls_in_flight = _renamed("buffers", buffers, "calls_in_flight", calls_in_flight, 2)
        s5cmd_workers = _renamed("numworkers", numworkers, "s5cmd_workers", s5cmd_workers, 256)
        if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
            raise ConfigError(f"batch_size must be a positive int or None, got {batch_size!r}")
        r, world = rank_info(num_replicas, rank)
        self.dataset = dataset
        self._order = _Order(shuffle if shuffle == "block" else bool(shuffle), seed, world, r, bool(drop_last))
        budget_bytes = parse_size(budget, "budget")
        # From the options, not the space found: every rank must cut the same windows.
        self._window = block_window(budget_bytes, dataset.total_bytes / max(1, len(dataset)), calls_in_flight)
        if shuffle == "block" and isinstance(samples_per_call, int) and not isinstance(samples_per_call, bool) \
                and samples_per_call > 0:  # an invalid value still fails in StagingOptions
            samples_per_call = max(samples_per_call, self._window)
        self._options = StagingOptions(
            budget=budget_bytes,
            samples_per_call=samples_per_call,
            calls_in_flight=calls_in_flight,
            s5cmd_workers=s5cmd_workers,
            block_size=block_size,
            stall_timeout=stall_timeout,
            retries=retries,
            on_error=on_error,
            verify=verify,
            keep_staged=bool(keep_staged),
            shrink_budget=bool(shrink_budget),
            staging_dir=staging_dir,
        )
        budget_bytes = self._options.budget
        largest = dataset.samples[dataset.samples.largest()]
        sharded = dataset.shards is not None
        if sharded:
            _check_shards(dataset, shuffle, budget_bytes)
        check_sample_fits(largest, budget_bytes)
        total = dataset.total_bytes
        if keep_staged and total > budget_bytes:
            raise BudgetError(
                f"keep_staged=True needs a budget that holds the whole data set "
                f"({format_size(total)}); the budget is {format_size(budget_bytes)}"
            )
        footprint = disk_footprint(dataset.samples.size)
        root, room = choose_root(staging_dir, min(budget_bytes, total), shrink_budget, footprint)
        if room < min(budget_bytes, total):
            if keep_staged or largest.size > room:
                raise BudgetError(
                    f"only {format_size(room)} fit in {root}, too little for "
                    + ("the whole data set with keep_staged" if keep_staged else f"sample {largest.key!r}")
                )
            self._options = replace(self._options, budget=room)
        if batch_size is not None and not sharded:
            _check_batch_fits(dataset, batch_size, self._options.budget)
        # over shards a block is a shard, fetched with one cp --raw line: no wildcard lines
        self._layout = plan_blocks(dataset.samples, 1 if sharded else block_size, dataset._listing)
        self._s5cmd = S5cmd(access=dataset.access, numworkers=s5cmd_workers)
        self._area = StagingArea(root)
        self.keep_staged = bool(keep_staged)
        self.epoch = 0
        self._epoch_set = False  # set_epoch was called (a loaded end-of-epoch state defers to it)
        self._start = 0  # global position the next pass starts at (resume)
        self._yielded = 0  # indices yielded in the current pass
        self._pass_len: int | None = None  # indices in the current pass, once it began
        self._epoch_done = False  # the last pass ran to the end of self.epoch
        self._passes = 0  # staging passes made; each stages into a folder of its own
        self._replaced: list[StagingArea] = []  # folders of earlier passes, removed by the next
        self._kept: set[int] = set()
        self._active: Stager | None = None
        self._last_stats: Stats | None = None
        self._last_metrics: Metrics | None = None
        self._run_s = 0.0  # seconds of all passes so far, for the starvation report
        self._finalizer = weakref.finalize(self, StagingArea.remove, self._area)

    # -- the Sampler protocol -----------------------------------------------------------
    @property
    def staging_dir(self) -> str:
        """This sampler's own staging directory (created on first iteration)."""
        return self._area.path

    @property
    def budget(self) -> int:
        return self._options.budget

    @property
    def num_replicas(self) -> int:
        return self._order.num_replicas

    @property
    def rank(self) -> int:
        return self._order.rank

    def __len__(self) -> int:
        n, w = len(self.dataset), self._order.num_replicas
        if self._order.drop_last:
            return n // w
        return math.ceil(n / w)

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` for the next pass (as ``DistributedSampler``).

        It may come before or after :meth:`load_state_dict` (``StatefulDataLoader`` applies a
        loaded state lazily, at the next ``iter(loader)``): a state saved mid-epoch continues
        its own epoch; a state saved after an epoch's last sample leaves the next pass to the
        epoch set here.
        """
        if epoch != self.epoch:
            self._start = 0
            self._yielded = 0
            self._pass_len = None
            self._epoch_done = False
        self.epoch = int(epoch)
        self._epoch_set = True

    def __iter__(self) -> Iterator[int]:
        return self._iterate()

    def _iterate(self) -> Iterator[int]:
        self._close_active()
        if self._epoch_done:
            self._start, self._epoch_done = 0, False  # the same epoch again, from its start
        order, windows = self._epoch_plan(self.epoch, self._start)
        self._area.create()
        register_cleanup(self)
        # The earlier passes' folders go now, not when they were abandoned: DataLoader workers
        # read their queued samples (persistent workers do so in iter(loader), before this
        # pass begins), and those reads must find their files.
        self._remove_replaced()
        where = self._new_pass()
        keep = self.keep_staged
        shards = None
        if self.dataset.shards is not None:
            from ._shardpass import ShardPass

            shards = ShardPass(self.dataset, order, where.path, keep, self._options.on_error)  # type: ignore[arg-type]
            shards.check_budget(self._options.budget, self._order.shuffle)
        stager = Stager(
            self.dataset.samples,
            order if shards is None else shards.engine_order,
            where,
            self._s5cmd,
            self._options,
            kept=self._kept if self.keep_staged else None,
            endpoint_url=self.dataset.access,
            layout=self._layout,
            windows=windows if shards is None else None,  # over shards the engine stages shard visits
        ).start()
        self._active = stager
        self._yielded = 0
        self._pass_len = len(order)
        t0 = time.monotonic()
        finished = False
        try:
            for pos, idx in enumerate(order):
                if shards is not None:
                    if shards.take(pos, stager):
                        self._yielded += 1
                        yield StagedIndex(idx, where.path, keep)
                    else:
                        self._yielded += 1
                elif stager.wait(pos):
                    if not keep:
                        stager.yielded(idx)
                    self._yielded += 1
                    yield StagedIndex(idx, where.path, keep)
                else:
                    self._yielded += 1  # a skipped sample still counts as consumed
            finished = True
        finally:
            superseded = self._active is not stager  # a newer pass owns the sampler now
            stager.close()
            if not superseded:
                self._active = None
            self._last_stats = stager.stats
            self._last_metrics = stager.metrics(epoch=self.epoch, position=self._yielded)
            if keep:
                self._kept.update(stager.ready_indices())
            elif not superseded:
                # Finished or abandoned (break, exception): the next pass, close() or exit
                # removes this pass's folder once no worker can still be reading from it.
                self._replaced.append(where)
            if finished and not superseded:
                self._epoch_done = True
            self._report(stager.stats, time.monotonic() - t0, finished)

    def _new_pass(self) -> PassArea:
        if self.keep_staged:
            where = PassArea(self._area, "kept")  # one folder: its files outlive the pass
        else:
            self._passes += 1
            where = PassArea(self._area, f"p{self._passes}")
        where.create()
        return where

    def _remove_replaced(self) -> None:
        replaced, self._replaced = self._replaced, []
        for where in replaced:
            where.remove()

    def _epoch_order(self, epoch: int, start: int = 0) -> list[int]:
        return self._epoch_plan(epoch, start)[0]

    def _epoch_plan(self, epoch: int, start: int = 0) -> tuple[list[int], list[int] | None]:
        """This rank's order from ``start`` on, and (``shuffle="block"``) where its windows begin."""
        if self._order.shuffle == "block":
            return self._order.block_order(len(self.dataset), epoch, start, self._units(), self._window)
        return self._order.indices(len(self.dataset), epoch, start), None

    def _units(self) -> list[list[int]]:
        """The blocks a ``shuffle="block"`` order permutes: tar shards, else key-prefix blocks."""
        shard_units = getattr(self.dataset, "shard_units", None)
        return shard_units if shard_units is not None else self._layout.units

    @property
    def window(self) -> int:
        """The most samples of a ``shuffle="block"`` window (see ``shuffle``)."""
        return self._window

    def shuffle_quality(self, epoch: int | None = None, span: int = 256) -> ShuffleQuality:
        """How well this rank's order of ``epoch`` (default: the current one) mixes blocks.

        Args:
            epoch: the epoch whose order is measured.
            span: the run length measured, e.g. the batch size.

        Returns:
            the mean number of distinct blocks among ``span`` consecutive samples (a sample
            outside any block counts as a block of its own) and the mean distance a sample
            moves from its key order, as a share of the data set (about 1/3 for a full
            shuffle, 0 for none). A full shuffle draws about ``span`` blocks per run when
            blocks are many; key order about ``span`` / the block size.
        """
        order = self._epoch_order(self.epoch if epoch is None else epoch)
        unit_of = [0] * len(self.dataset)
        for u, members in enumerate(self._units()):
            for i in members:
                unit_of[i] = u
        return shuffle_quality(order, unit_of, span)

    def _report(self, stats: Stats, elapsed: float, finished: bool) -> None:
        starved = stats.wait_s - stats.first_wait_s
        msg = (
            "epoch %d%s: %d samples, %s staged in %d calls (%d retried, %d skipped) in %.1fs; "
            "waited %.2fs for staging (%.2fs before the first sample)"
        )
        args = (
            self.epoch, "" if finished else " (stopped early)", stats.staged_samples,
            format_size(stats.staged_bytes), stats.calls, stats.retries, len(stats.skipped),
            elapsed, stats.wait_s, stats.first_wait_s,
        )
        if stats.skipped:
            log.warning(
                "epoch %d: skipped %d sample(s) that could not be fetched (on_error='skip'): %s%s",
                self.epoch, len(stats.skipped), ", ".join(stats.skipped[:10]),
                " ..." if len(stats.skipped) > 10 else "",
            )
        self._run_s += elapsed
        if self._run_s >= _STARVED_MIN_RUN_S and elapsed > 0 and starved >= _STARVED_SHARE * elapsed:
            o = self._options
            log.warning(
                "data starvation: " + msg + "; the loader waited %.0f%% of the epoch after its first "
                "sample. To stage faster: a larger calls_in_flight (now %d), a larger "
                "samples_per_call (now %d), shuffle='block' (one request per block of samples), or a "
                "larger budget (now %s)",
                *args, 100 * starved / elapsed, o.calls_in_flight, o.samples_per_call, format_size(o.budget),
            )
        else:
            log.info(msg, *args)

    @property
    def stats(self) -> Stats | None:
        """What the last finished (or current) pass did: samples, bytes, calls, retries,
        skipped URIs and the time the loader waited for staging."""
        return self._active.stats if self._active is not None else self._last_stats

    def metrics(self) -> Metrics:
        """Live figures of the current pass, cheap enough to call every training step (no
        lock, no system call but a clock read; safe from any thread).

        Between passes: the last pass's figures as it ended; before the first: zeros and the
        budget. The fields are described in :class:`~s5loader.engine.metrics.Metrics`:
        bytes staged and the budget, samples ready ahead of the loader, calls and objects in
        flight, MB/s and samples/s over the last few seconds, the time the loader waited for
        staging, retries, skips, the epoch and the position in it.
        """
        stager = self._active
        if stager is not None:
            return stager.metrics(epoch=self.epoch, position=self._yielded)
        if self._last_metrics is not None:
            return self._last_metrics
        return Metrics(epoch=self.epoch, samples=len(self), budget=self.budget)

    def write_command_files(self, directory: str, epoch: int | None = None) -> list[str]:
        """Write the s5cmd command files this rank would run for an epoch, without running them.

        The files stage into ``directory`` as the sampler stages into its own directory (the
        same wildcard lines for whole blocks and multi-object samples, ``cp --raw`` lines for
        the rest, ``samples_per_call`` samples per file, cut at window starts with
        ``shuffle="block"``, without the small first calls), so
        ``s5cmd run FILE`` reproduces the sampler's fetching with no Python involved; files
        fetched by wildcard lines stay in their ``.cN/`` scratch folders.

        Returns:
            the paths of the command files, in order.
        """
        order, windows = self._epoch_plan(self.epoch if epoch is None else epoch)
        spc = self._options.samples_per_call
        os.makedirs(directory, exist_ok=True)
        stage = os.path.abspath(directory)
        if self.dataset.shards is not None:  # over shards: one line per staging of a shard
            from ._shardpass import ShardPass

            order = ShardPass(self.dataset, order, stage, False, "raise").engine_order  # type: ignore[arg-type]
            windows = None
        paths = []
        cuts = [0]
        while cuts[-1] < len(order):
            end = min(cuts[-1] + spc, len(order))
            # whole windows per file, as the engine's calls
            inside = [w for w in windows or () if cuts[-1] < w <= end]
            cuts.append(inside[-1] if inside and end < len(order) else end)
        for n, (first, last) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
            plan = plan_call(
                self.dataset.samples, order, range(first, last),
                lambda i: f"{stage}/{i}", self._layout, f"{stage}/.c{n}",
            )
            path = os.path.join(stage, f"call-{n:05d}.txt")
            write_command_file(path, plan.lines)
            paths.append(path)
        return paths

    # -- resume (torchdata's Stateful protocol) --------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the epoch, the samples consumed in it, and whether it is complete.

        A state taken after the epoch's last sample was handed out (``"complete": True``)
        means "epoch ``epoch`` is done": loading it makes the next pass a whole epoch, the one
        :meth:`set_epoch` names.
        """
        o = self._order
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": o.seed,
            "shuffle": o.shuffle,
            "drop_last": o.drop_last,
            "num_replicas": o.num_replicas,
            "dataset_len": len(self.dataset),
            "start": self._start,
            "yielded": self._yielded,
            "complete": self._epoch_done or (self._pass_len is not None and self._yielded >= self._pass_len),
            "window": self._window,  # shuffle="block": the order depends on it
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`, staging only what is left.

        A state saved mid-epoch continues that epoch where it stopped, whatever
        :meth:`set_epoch` said. A state saved after an epoch's last sample makes the next
        pass a whole epoch: the one given to :meth:`set_epoch` (before or after this call),
        else the epoch after the saved one. So resuming a loop that saves
        ``loader.state_dict()`` after each epoch and calls ``set_epoch(epoch + 1)`` yields
        exactly the epoch an uninterrupted run yields. A state from a different number of
        ranks continues the same global order at the position all ranks had reached together.

        Raises:
            StateError: the state does not fit (another data set size, negative counts, an
                unknown version, a missing key).
        """
        saved = check_state(state, len(self.dataset))
        window = state.get("window", self._window)
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise StateError(f"state['window'] must be a positive int, got {window!r}")
        block, w, drop_last = saved.shuffle == "block", saved.num_replicas, saved.drop_last
        consumed, complete, n = saved.consumed, saved.complete, len(self.dataset)
        if block and w != self._order.num_replicas and not complete:
            raise StateError(
                f"a shuffle='block' epoch resumes only with the same number of ranks: the state "
                f"has {w}, this job {self._order.num_replicas}"
            )
        if w != self._order.num_replicas and not complete:
            log.warning(
                "resuming with %d rank(s) from a state saved with %d: continuing the global "
                "order at position %d of %d",
                self._order.num_replicas, w, min(consumed, n), n,
            )
        self._order = _Order(saved.shuffle, saved.seed, self._order.num_replicas, self._order.rank, drop_last)
        if block and window != self._window:
            # the saved order's windows, whatever this job's budget gives
            log.info("shuffle='block': resuming with the saved window of %d samples (this budget gives %d)",
                     window, self._window)
            self._window = window
            if self._options.samples_per_call < window:
                self._options = replace(self._options, samples_per_call=window)
        self._yielded = 0
        self._pass_len = None
        self._epoch_done = False
        if complete:
            if not self._epoch_set:
                self.epoch = saved.epoch + 1
            self._start = 0
        else:
            self.epoch = saved.epoch
            self._start = min(consumed, n)

    # -- lifetime -----------------------------------------------------------------------
    def _close_active(self) -> None:
        stager, self._active = self._active, None
        if stager is not None:
            stager.close()
            if not self.keep_staged:
                self._replaced.append(stager.area)

    def close(self) -> None:
        """Stop staging, kill s5cmd, remove the staging directory. Safe to call twice."""
        self._close_active()
        self._kept.clear()
        self._replaced.clear()
        self._area.remove()

    def _abort(self) -> None:
        """On SIGTERM: kill s5cmd and remove the staging directory, taking no lock."""
        stager = self._active
        if stager is not None:
            stager.abort()
        self._area.remove()

    def __enter__(self) -> S5Sampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_active"] = None
        state["_finalizer"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        o = self._order
        return (
            f"S5Sampler({self.dataset!r}, shuffle={o.shuffle}, seed={o.seed}, rank={o.rank}/"
            f"{o.num_replicas}, budget={format_size(self.budget)}, staging_dir={self.staging_dir!r})"
        )


def _check_shards(dataset: S5Dataset, shuffle: bool | str, budget: int) -> None:
    """Over tar shards the budget counts whole shards: one larger than the budget can never be
    staged, and shuffle=True keeps every shard staged for the whole epoch."""
    samples = dataset.samples
    big = samples[samples.largest()]
    if big.size > budget:
        raise BudgetError(
            f"the shard {big.fields[0].uri} is {format_size(big.size)}, larger than the budget of "
            f"{format_size(budget)}; a shard is staged whole: raise the budget or write smaller shards"
        )
    if shuffle is True and dataset.total_bytes > budget:
        raise ConfigError(
            f"shuffle=True over tar shards draws every sample from any shard, so all shards of "
            f"{dataset.source} ({format_size(dataset.total_bytes)}) would have to be staged at once, "
            f"more than the budget of {format_size(budget)}; use shuffle='block' (the shards in a "
            "random order, samples shuffled within windows of whole shards)"
        )


def _renamed(old: str, old_value: int | None, new: str, new_value: int, default: int) -> int:
    """The value of a renamed keyword: the old name still works for one release, with a
    DeprecationWarning; both at once is a ConfigError."""
    if old_value is None:
        return new_value
    if new_value != default:
        raise ConfigError(f"{old}= is the former name of {new}=; give only {new}={new_value!r}")
    warnings.warn(f"S5Sampler({old}=...) is deprecated; use {new}=", DeprecationWarning, stacklevel=3)
    return old_value


def _check_batch_fits(dataset: S5Dataset, batch_size: int, budget: int) -> None:
    """A DataLoader waits for a whole batch of indices before any sample of it is read, so a
    budget that cannot hold ``batch_size`` samples can stall; fail now with the numbers."""
    n = min(batch_size, len(dataset))
    biggest = sorted((s.size for s in dataset.samples), reverse=True)[:n]
    need = sum(biggest)
    if need > budget:
        raise BudgetError(
            f"the budget of {format_size(budget)} does not hold one batch: batch_size={batch_size} of "
            f"the largest samples of {dataset.source or 'the data set'} take {format_size(need)} "
            f"(the largest is {format_size(biggest[0])}); the budget must hold at least one batch: "
            f"raise it to at least {format_size(need)} or lower batch_size"
        )
