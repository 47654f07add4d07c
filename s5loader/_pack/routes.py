"""How one call of :func:`s5loader.pack` goes once its options are checked: the run it
shares (where it packs, this process's part, its :class:`PackResult` so far), then one of two
routes, and last rank 0's index.

* Objects or a manifest (:func:`pack_objects`): the samples are listed and grouped as the
  loaders group them, planned whole (order, cut, budget), DEST is claimed with the plan, and
  each rank builds its shards that are not done (:mod:`._pack.pipeline`).
* An archive (:func:`pack_archive_source`): its volumes are listed (with their checkers), DEST
  is claimed, and one process streams the archive into shards (:mod:`._pack.archive`).

Either route returns :class:`Packed`, what :func:`write_index` needs: rank 0 waits for every
shard's marker, checks their counts against the plan and writes ``wids.json``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .._index.blocks import BlockPlan, plan_blocks
from .._s5cmd import S5cmd
from .._shards.index import DEFAULT_INDEX, PACK_RECORD
from .._util.dist import local_world_size
from .._util.uri import as_folder, format_size, parse_s3_uri
from ..config import Access
from ..dataset import S5Dataset
from ..exceptions import BudgetError, ConfigError, ShardIndexError
from . import plan as _plan
from .pipeline import Gate, Job, Packer, run_shards
from .plan import PackOptions
from .resumable import DestState
from .split_archive import fingerprint as archive_fingerprint
from .split_archive import pack_archive, volumes_of
from .transform import SampleTransform
from .workdir import open_work

log = logging.getLogger(__name__)

BLOCK_SIZE = 64  # most samples one wildcard line fetches, as the sampler's default


@dataclass
class PackResult:
    """What :func:`s5loader.pack` did.

    Attributes:
        shards: shards in the whole pack (every rank's).
        packed: shards this process wrote (the others were done before, or are other ranks').
        samples: samples in the index (rank 0), else in the shards this process wrote.
        bytes: bytes of the shards this process wrote.
        seconds: wall time.
        index: the ``wids.json`` URI (rank 0), else None.
        peak_staged: the most bytes of local disk reserved at once by the shards under way (a
            shard being built reserves its tar and its largest object, a shard waiting for its
            upload its tar; a shard waiting for its turn nothing): an upper bound of the disk
            used, never more than the budget; with a transform, of the samples as read (a
            transform that enlarges them writes tars larger than reserved).
        budget: the budget.
        skipped: sample keys left out (objects gone, with ``missing="skip"``): on rank 0 of
            the whole pack, else of the shards this process wrote.
    """

    shards: int = 0
    packed: int = 0
    samples: int = 0
    bytes: int = 0
    seconds: float = 0.0
    index: str | None = None
    peak_staged: int = 0
    budget: int = 0
    skipped: list[str] = field(default_factory=list)


@dataclass
class PackRun:
    """One call of :func:`s5loader.pack`: where it packs, this process's part of it, and its result so far."""

    source: str
    dest: str
    options: PackOptions
    store: Access
    rank: int
    world: int
    state: DestState
    s5: S5cmd
    parallel: int  # shards under way at once
    root: str  # where the local work folder goes
    result: PackResult
    progress: Callable[[int, int], None] | None
    total: int = 0  # samples this process packs; 0 for an archive, whose samples are not known ahead

    def shard_done(self, n: int, size: int) -> None:
        """Count a shard this process finished (``n`` samples, ``size`` bytes) and report progress."""
        self.result.packed += 1
        self.result.samples += n
        self.result.bytes += size
        if self.progress is not None:
            self.progress(self.result.samples, self.total or self.result.samples)

    def plan_doc(self, fingerprint: str, shards: int | None) -> dict[str, Any]:
        """The plan's record, which :meth:`DestState.claim` compares with DEST's and the index keeps."""
        return {
            "version": _plan.VERSION,
            "fingerprint": fingerprint,
            "source": self.source,
            "options": self.options.content(),
            "shards": shards,
        }


class Packed(NamedTuple):
    """What a route leaves for the index: the shards of the whole pack, the plan's record, the
    samples the plan has (None for an archive: they are known only once it is read), and the
    index where DEST holds this pack finished (then nothing was packed)."""

    shards: int
    doc: dict[str, Any]
    planned: int | None
    finished: dict[str, Any] | None = None
    classes: list[str] = []  # the class names of the int labels (label="folder"), for the index


def pack_objects(run: PackRun) -> Packed:
    """Pack objects or a manifest: plan every shard, claim DEST, then build this rank's shards
    that are not done, downloading and uploading under the budget's gate."""
    options, state = run.options, run.state
    planned, blocks, classes = _samples(run.source, run.dest, options, run.store)
    order = _plan.order(len(planned), options.shuffle, options.seed)
    cuts = _plan.cut([planned[i].tar_bytes for i in order], int(options.shard_size))
    _plan.check_budget(planned, order, cuts, int(options.budget), run.dest)
    doc = run.plan_doc(_plan.fingerprint([planned[i] for i in order], options), len(cuts))
    if (finished := state.claim(doc, run.rank, options.index_timeout)) is not None:
        return Packed(len(cuts), doc, len(planned), finished, classes)
    done = state.done()
    jobs: list[Job] = []
    for i in _plan.rank_shards(len(cuts), run.rank, run.world):
        if i not in done:
            numbers = [int(order[k]) for k in range(*cuts[i])]
            samples = [planned[n] for n in numbers]
            jobs.append((i, numbers, samples, _plan.disk_bytes(samples)))
    run.total = sum(len(s) for _, _, s, _ in jobs)
    log.info(
        "packing %s into %s: %d samples, %d shards (%d done before; this rank packs %d)",
        run.source,
        run.dest,
        len(planned),
        len(cuts),
        len(done),
        len(jobs),
    )
    gate = Gate(int(options.budget))
    transform = None
    if options.transform is not None and jobs:  # its workers forked before any transfer thread
        # by default the node's CPUs, shared by its ranks that pack
        default = max(1, (os.cpu_count() or 1) // local_world_size())
        transform = SampleTransform(options.transform, options.transform_workers or default)
    try:
        with open_work(run.root, min(int(options.budget), sum(j[3] for j in jobs))) as work:
            numworkers = max(4, options.workers // run.parallel)
            packer = Packer(
                run.s5, run.store, state, work, options.missing, numworkers, run.shard_done, blocks, transform
            )
            entries = run_shards(packer, jobs, gate, run.parallel)
    finally:
        if transform is not None:
            transform.close()
    run.result.peak_staged = gate.peak
    run.result.skipped = [k for e in entries for k in e.get("skipped", [])]
    run.result.shards = len(cuts)
    return Packed(len(cuts), doc, len(planned), classes=classes)


def pack_archive_source(run: PackRun, verify: bool) -> Packed:
    """Pack a (split) archive: its options checked, its volumes listed (with their checkers
    when ``verify``), DEST claimed, then the archive streamed into shards by this one process."""
    options = run.options
    _check_archive(run)
    volumes, checkers = volumes_of([run.source], run.s5, verify)
    doc = run.plan_doc(archive_fingerprint(volumes, checkers, options.content()), None)
    if (finished := run.state.claim(doc, run.rank, options.index_timeout)) is not None:
        return Packed(0, doc, None, finished)
    with open_work(run.root) as work:
        packer = Packer(run.s5, run.store, run.state, work, options.missing, options.workers, run.shard_done)
        nshards, run.result.peak_staged = pack_archive(
            volumes,
            checkers,
            packer,
            int(options.shard_size),
            int(options.budget),
            run.state.done(),
            min(16, options.workers),
        )
    run.result.shards = nshards
    return Packed(nshards, doc, None)


def _check_archive(run: PackRun) -> None:
    """Refuse what an archive cannot be packed with: options that reorder or regroup its members,
    other ranks, DEST inside SOURCE, or a shard that half the budget cannot hold."""
    source, options = run.source, run.options
    if options.shuffle or options.label or options.group_by != "stem" or run.world > 1:
        raise ConfigError(
            f"{source}: an archive is packed in its own order, by one process, grouped by stem "
            "(consecutive members sharing a key): drop shuffle, label, group_by and the other ranks"
        )
    _plan.check_places(source, run.dest)
    half = int(options.budget) - int(options.budget) // 2
    if int(options.shard_size) > half:
        raise BudgetError(
            f"{source}: packing an archive, half the budget ({format_size(half)}) holds the shards being "
            f"written and uploaded, less than one shard ({format_size(int(options.shard_size))}): "
            f"pass a budget of at least {format_size(2 * int(options.shard_size))} or a smaller shard size"
        )


def write_index(run: PackRun, packed: Packed) -> None:
    """Rank 0's last step: wait for every shard's marker, check the samples they count against
    the plan, write the index and remove the pack's state under DEST."""
    state, result = run.state, run.result
    state.wait_all(packed.shards, run.world, run.options.index_timeout, lambda: None)
    entries = state.entries(packed.shards)
    result.samples = sum(int(e["nsamples"]) for e in entries)
    result.skipped = [k for e in entries for k in e.get("skipped", [])]
    if packed.planned is not None and result.samples + len(result.skipped) != packed.planned:
        raise ShardIndexError(
            f"{run.dest}: the shards' markers count {result.samples} samples and {len(result.skipped)} "
            f"left out; the plan has {packed.planned}; no index written"
        )
    result.index = state.write_index(entries, run.source, packed.doc, packed.classes)
    state.finish()


def already_packed(result: PackResult, index: dict[str, Any], dest: str, rank: int, t0: float) -> PackResult:
    """What a pack over a DEST that holds it finished returns: nothing packed, the index's counts."""
    log.info("%s holds this pack, finished (%s%s): nothing to do", dest, dest, DEFAULT_INDEX)
    result.shards = len(index["shardlist"])
    result.samples = sum(int(e.get("nsamples", 0)) for e in index["shardlist"])
    result.skipped = list(index[PACK_RECORD].get("skipped", []))
    result.index = dest + DEFAULT_INDEX if rank == 0 else None
    result.seconds = time.monotonic() - t0
    return result


def _samples(
    source: str, dest: str, options: PackOptions, store: Access
) -> tuple[list[_plan.PlannedSample], BlockPlan, list[str]]:
    """The samples of a prefix (grouped as ``from_prefix`` groups them) or a manifest, planned,
    their blocks (runs that one wildcard line fetches; none for a manifest), and the class names
    of their labels (``label="folder"``; else none)."""
    if source.endswith((".jsonl", ".json")) or not source.startswith("s3://"):
        ds = S5Dataset.from_manifest(source, access=store, group_by=options.group_by, label=options.label)
        base = ""
    else:
        source = as_folder(source)
        _plan.check_places(source, dest)
        ds = S5Dataset.from_prefix(source, access=store, group_by=options.group_by, label=options.label)
        base = parse_s3_uri(source).key
    planned = _plan.plan_samples(ds.samples, base)
    # blocks of at most a quarter of a shard's samples, so that most lie whole in one shard
    per_shard = int(options.shard_size) * len(planned) // max(1, sum(p.tar_bytes for p in planned))
    blocks = plan_blocks(ds.samples, max(2, min(BLOCK_SIZE, per_shard // 4)), ds.samples.listing)
    return planned, blocks, ds.classes
