"""A data set of tar shards as the staging run sees it: :class:`ShardUnits` (a shard staged whole,
its samples read by offset). See :mod:`.units`."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Sequence

from .._index.blocks import BlockPlan
from .._index.sample import Field, Sample
from .._shards.holding import Freeing, Holding, Shape
from .._shards.shardpass import Hits, ShardPass
from .._shards.tar import is_gzip
from .._staging.epochcache import index_fingerprint
from .._staging.layout import field_names
from .._util.uri import format_size
from ..config import StagingOptions
from ..dataset import StagedIndex
from ..exceptions import BudgetError
from .objunits import Lifted, ObjectUnits, PassUnits
from .order import Order, open_shards

SHARD_WORKERS = 4  # tar shards of a call downloading at once


class ShardUnits(ObjectUnits):
    """A data set of tar shards: a unit is a shard, staged whole by one ``cp --raw`` line and
    counted whole in the budget; a shard order keeps as many shards open as the budget holds,
    and an iterable's worker takes a contiguous run of shards, which it alone stages."""

    name = "tar shard"
    holds_batches = False  # the budget counts shards, never samples

    def check(self, options: StagingOptions) -> None:
        """Raise :class:`BudgetError` for a shard larger than the budget (it could never be
        staged)."""
        samples = self.dataset.samples
        big = samples[samples.largest()]
        if big.size > options.budget:
            raise BudgetError(
                f"the shard {big.fields[0].uri} is {format_size(big.size)}, larger than the budget of "
                f"{format_size(options.budget)}; a shard is staged whole: raise the budget or write "
                "smaller shards"
            )

    def window(self, budget: int, shuffle: bool | str) -> int:
        """``shuffle="block"``: as for objects; else the shards a shard order keeps open."""
        if shuffle == "block":
            return super().window(budget, shuffle)
        shards = self.dataset.samples
        return open_shards(budget, shards[shards.largest()].size, self.dataset.total_bytes, len(shards))

    def order_cost(self, budget: int | None = None) -> Freeing:
        """For a shard order whose samples give their bytes back as they are read (see
        :meth:`Order.shard_order <s5loader._sampling.order.Order.shard_order>`): the shards, and
        the bytes the order's open shards may hold, ``budget`` less a largest shard (set aside
        for the shard being staged while the others are read, and for a resumed pass, which
        stages a shard whole before it punches out what was read of it); ``None``: the
        order's window of largest shards."""
        shards = self.dataset.shards
        assert shards is not None
        cost = Freeing(shards)
        if budget is not None:
            cost.room = max(0, budget - cost.largest)
        return cost

    def frees_on_read(self, shuffle: bool | str, budget: int | None = None) -> bool:
        """A shard order (``shuffle=True``) counts what its samples give back as they are read,
        unless (given the ``budget``) the data set fits in it, which keeps every shard open
        anyway and spares the readers the punching. With an epoch cache, a shard kept for the
        next epoch is not punched: what its read samples would give back counts against the
        cache from its first sample on (see :meth:`CacheRun.reserve
        <s5loader._sampling.cacherun.CacheRun.reserve>`), so the order is the same."""
        fits = budget is not None and self.dataset.total_bytes <= budget
        return shuffle is True and not fits

    def block_size(self, options: StagingOptions) -> int:
        return 1  # a shard is fetched with one cp --raw line: no wildcard lines

    def order_units(self, blocks: BlockPlan) -> list[list[int]]:
        """What a ``shuffle="block"`` order permutes: the shards (each its samples)."""
        assert self.dataset.shards is not None
        return self.dataset.shards.shard_units

    def check_batch(self, order: Sequence[int], batch: int, budget: int, cost: Freeing | None = None) -> None:
        """Raise :class:`BudgetError` when the shards that one DataLoader batch of ``order``
        (``batch`` samples from its start on) lies in cannot be staged at once: a DataLoader reads
        a batch only once all of it is handed out, and a shard sample is handed out once its
        shard is staged. ``cost``: the order counts what its readers give back (see
        :mod:`s5loader._shards.holding`), so a shard the earlier batches read from holds that
        much less."""
        shards = self.dataset.shards
        assert shards is not None
        held = Holding(shards) if cost is not None else None
        if held is not None:
            needed: dict[int, set[int]] = {}
            for i in order:
                s, j = shards.locate(i)
                needed.setdefault(s, set()).add(j)
            for s, js in needed.items():
                held.open(s, s, js)
        done: set[tuple[int, int]] = set()
        most = at = 0
        for start in range(0, len(order), batch):
            where = [shards.locate(i) for i in order[start : start + batch]]
            units = {s for s, _ in where}
            need = sum(held.holds(s) if held is not None else shards[s].disk for s in units)
            if need > most:
                most, at = int(need), start
            if held is not None:
                for s, j in where:
                    if (s, j) not in done:
                        done.add((s, j))
                        held.done(s, j)
        if most > budget:
            raise BudgetError(
                f"a DataLoader batch of {batch} samples of {self.dataset.source or 'the data set'} draws "
                f"from tar shards that take {format_size(most)} staged at once (the batch from position "
                f"{at} on), more than the budget of {format_size(budget)}: a batch is read only once all "
                "of it is staged; raise the budget, lower batch_size, or use shuffle='block'"
            )

    def per_rank(self, shuffle: bool | str) -> bool:
        """Every order of shards counts positions in a rank's part: each rank reads runs of whole
        shards."""
        return True

    def cache_units(
        self,
    ) -> tuple[Callable[[Sequence[int]], list[int]] | None, Callable[[int], bool] | None]:
        """The epoch cache keeps whole shards; not gzip-compressed ones, which are staged
        decompressed in place and would no longer match their listing."""
        shards = self.dataset.shards
        assert shards is not None
        return shards.units_of, lambda s: not is_gzip(shards[s].uri)

    def unit_of(self, index: int) -> int:
        """The shard that holds sample ``index``."""
        assert self.dataset.shards is not None
        return self.dataset.shards.locate(index)[0]

    def peak_bytes(self, order: Sequence[int], frees: bool) -> int | None:
        """The most bytes of shards ``order`` needs staged at once (see
        :meth:`ShardPass.peak_bytes <s5loader._shards.shardpass.ShardPass.peak_bytes>`)."""
        return ShardPass(self.dataset, order, "", False, "raise", frees).peak_bytes()[0]

    def delivery_window(self, budget: int) -> int:
        """The bytes of samples written out of their shards (:meth:`lift`) that the daemon lets
        its consumer hold at once; the shards open take the rest of the budget. A written-out
        sample is a second copy of bytes its shard still holds (a shard gives back only the whole
        blocks of what was read, and nothing while an epoch cache keeps it), so the daemon hands
        a sample on only while what the consumer holds is within this window: a sixteenth of the
        budget, at least two of the largest shard's samples (on average).

        Raises:
            BudgetError: the budget cannot hold the largest shard beside the window.
        """
        shards = self.dataset.shards
        assert shards is not None
        largest = max(shards, key=lambda sh: sh.disk)
        window = max(budget // 16, 2 * self.sample_estimate())
        if largest.disk + window > budget:
            unpacked = f", {format_size(largest.tarsize)} decompressed beside it" if largest.tarsize else ""
            raise BudgetError(
                f"--budget {format_size(budget)} is too small for the shard {largest.uri} "
                f"({format_size(largest.size)}{unpacked}): the budget holds the shards open and the "
                f"samples written out of them that the consumer holds, so it must hold at least "
                f"{format_size(largest.disk + window)}; raise --budget"
            )
        return window

    def sample_estimate(self) -> int:
        """A shard's sample in bytes, on average, for the largest of them (the index counts
        samples per shard, not their sizes)."""
        shards = self.dataset.shards
        assert shards is not None
        return int(max(Shape.of(sh).per_sample for sh in shards)) + 1

    def fingerprint(self) -> str:
        """A digest of the shards and their sample counts."""
        shards = self.dataset.shards
        assert shards is not None
        counts = ",".join(str(s.nsamples) for s in shards)
        return hashlib.sha256(f"{index_fingerprint(self.dataset.samples)}\n{counts}".encode()).hexdigest()

    def lift(self, staged: StagedIndex, scratch: str) -> Lifted:
        """A tar shard's sample written out of its staged shard into the folder ``scratch``, its
        fields named by extension (read by offset: a member name never becomes a path unless it
        is a plain relative one, see :func:`~s5loader._staging.layout.field_names`); reading it
        drops its claim on the shard (and gives the shard's bytes of it back, where they are
        punched out)."""
        shards = self.dataset.shards
        assert shards is not None
        member, _ = shards.read(staged, self.dataset.samples, self.dataset.access)
        key = member.pop("__key__")
        names = field_names(Sample(key, tuple(Field(f, "", len(v), "") for f, v in member.items())))
        shutil.rmtree(scratch, ignore_errors=True)
        os.makedirs(scratch)
        for name, value in zip(names, member.values(), strict=True):
            path = os.path.join(scratch, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(value)
        return Lifted(scratch, key, sum(len(v) for v in member.values()), True)

    def plan(
        self,
        order: Order,
        epoch: int,
        start: int,
        blocks: BlockPlan,
        window: int,
        cost: Freeing | None = None,
    ) -> tuple[list[int], list[int] | None]:
        """This rank's order over the shards from ``start`` on: a block order whose first shard is
        read from its front (it streams), else a shard order that keeps ``window`` shards open
        (with ``cost``, as many as the bytes they hold allow, see :meth:`Order.shard_order`)."""
        n = len(self.dataset)
        if order.shuffle == "block":
            return order.block_order(n, epoch, start, self.order_units(blocks), window, front_first=True)
        return order.shard_order(n, epoch, start, self.order_units(blocks), window, cost=cost), None

    def s5cmd_workers(self, options: StagingOptions) -> int:
        """At most :data:`SHARD_WORKERS`, so that a call's shards land one after another (its
        first ones early, each fetched in parallel parts when large) rather than all together at
        its end: the first batch and a pass's first calls then wait for the shards they read,
        not for the whole call."""
        return min(options.s5cmd_workers, SHARD_WORKERS)

    def open_pass(
        self,
        order: Sequence[int],
        folder: str,
        keep: bool,
        options: StagingOptions,
        shuffle: bool | str | None,
        frees: bool = False,
        hits: Hits | None = None,
        early: bool = False,
    ) -> PassUnits:
        shards = ShardPass(self.dataset, order, folder, keep, options.on_error, frees, hits)
        if shuffle is not None:
            shards.check_budget(options.budget, shuffle)
        return shards
