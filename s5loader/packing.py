"""``s5loader pack``: raw objects, a manifest, or a split archive into WebDataset tar shards
under an s3 prefix, with the ``wids.json`` index that :meth:`S5Dataset.from_shards
<s5loader.S5Dataset.from_shards>` reads, through a small local disk.

``pack("s3://b/raw/", "s3://b/shards/", shard_size="100MB", shuffle=True, seed=1)`` lists the
source and groups it into samples as :meth:`S5Dataset.from_prefix` does, orders them (key order
or a seeded permutation), cuts them into shards, and packs the shards: each shard's objects are
downloaded with parallel s5cmd GETs, written into ``shard-NNNNNN.tar`` (members ``KEY.FIELD``,
samples consecutive), uploaded under its final name when complete, and marked done. At most
``budget`` bytes of local disk are used at once: a shard under way holds its tar and its
largest object once more until its upload ends, and a sample or a shard that could not fit is
refused before anything is written. The index is written last, and the pack's state under
DEST is removed then. Killed at any point, the same call finishes the job without packing
finished shards again (see :mod:`s5loader._pack.resumable`). Under ``torchrun`` or SLURM
(``RANK``, ``WORLD_SIZE``) each rank packs every ``WORLD_SIZE``-th shard and rank 0 writes the
index once every shard is there.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ._pack.plan import PackOptions
from ._pack.resumable import DestState
from ._pack.routes import PackResult, PackRun, already_packed, pack_archive_source, pack_objects, write_index
from ._pack.transform import load_transform
from ._s5cmd import S5cmd
from ._util.args import ArgumentParser, positive_int, size_arg
from ._util.dist import rank_info
from ._util.uri import as_folder, format_size, parse_s3_uri
from .config import Access
from .exceptions import ConfigError
from .progress import Progress

log = logging.getLogger(__name__)

__all__ = ["pack", "PackResult"]

PARALLEL_SHARDS = 2  # shards under way at once (the budget may allow fewer): one downloads while one uploads


def pack(
    source: str,
    dest: str,
    *,
    shard_size: int | str = "100MB",
    group_by: str = "stem",
    label: str | None = None,
    shuffle: bool = False,
    seed: int = 0,
    budget: int | str = "1GiB",
    workers: int = 64,
    from_archive: bool = False,
    verify: bool = True,
    missing: str = "raise",
    staging_dir: str | None = None,
    index_timeout: float = 3600.0,
    access: Access | None = None,
    endpoint_url: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    transform_workers: int | None = None,
) -> PackResult:
    """Pack ``source`` into WebDataset tar shards under ``dest``, with a ``wids.json`` index.

    Args:
        source: ``s3://bucket/prefix/`` of raw objects, a manifest (``.jsonl``/``.json``, a
            path or s3 URI), or with ``from_archive`` the volumes of a split archive
            (``s3://b/data.tar.gz.`` for ``data.tar.gz.000``, ``.001``, ...) or one archive.
        dest: ``s3://bucket/prefix/``, empty or holding an unfinished run of this same pack.
        shard_size: where shards are cut (``"100MB"``); a sample is never split.
        group_by, label: how objects make samples, as :meth:`S5Dataset.from_prefix`; with
            ``label="folder"`` each sample gets a ``cls`` member (its class index).
        shuffle, seed: shuffle the samples across and within shards, seeded.
        budget: the most bytes of local disk at once, a limit: a shard under way holds its
            tar and its largest object once more (copied into the tar, then deleted) until it
            is uploaded; with ``from_archive`` half holds volumes, half shards.
        workers: parallel requests for downloads and uploads.
        from_archive: ``source`` is an archive (streamed member by member; key order only).
        verify: with ``from_archive``, check each volume against its ``.md5`` file or ETag.
        missing: an object gone between listing and download: ``"raise"`` or ``"skip"``.
        staging_dir: where the local files go (default: the temporary directory).
        index_timeout: seconds rank 0 waits for the other ranks' shards.
        access, endpoint_url: how to reach the store (:class:`~s5loader.Access`).
        progress: called with (samples packed, samples in all) as shards finish.
        rank, world_size: this process's part (default: torch.distributed, else ``RANK`` and
            ``WORLD_SIZE``, else one process).
        transform: a function run on each sample while it is packed, in ``transform_workers``
            processes (default: one per CPU, divided among the node's ranks): it takes the
            sample as a dict (``"__key__"`` and each field's bytes) and returns the fields to
            write (bytes, str, int or float). It must be a module-level function (worker
            processes import it by name); its name is part of the plan, so a rerun with it
            continues the pack and makes the same shards.
            The budget counts the samples as they are read, not as the transform makes them.
            Not with ``from_archive``.

    Returns:
        a :class:`PackResult`.

    Raises:
        ConfigError: bad options, DEST overlaps SOURCE, or DEST holds other shards.
        BudgetError: a sample or a shard takes more local disk than ``budget`` (names it, what
            it takes and the budget), before anything is written; with ``from_archive`` a
            shard size more than half the budget, or, when it is read, a sample larger than that.
        UnsafeArchiveError: a key no tar member name can carry (names the object).
        ObjectNotFoundError: an object gone since it was listed (``missing="raise"``).
        ChecksumError: an archive volume does not match its ``.md5`` file.
        ShardIndexError: rank 0 waited ``index_timeout`` for other ranks; names them.
        StagingSpaceError: the local disk filled up.
    """
    t0 = time.monotonic()
    options = PackOptions(
        shard_size,
        group_by,
        label,
        shuffle,
        seed,
        budget,
        workers,
        missing,
        index_timeout,
        transform,
        transform_workers,
    )
    if transform is not None and from_archive:
        raise ConfigError("transform= does not combine with from_archive=True: pack the archive, then repack")
    run = _start(
        source, dest, options, Access.coerce(access, endpoint_url), staging_dir, progress, rank, world_size
    )
    packed = pack_archive_source(run, verify) if from_archive else pack_objects(run)
    if packed.finished is not None:
        return already_packed(run.result, packed.finished, run.dest, run.rank, t0)
    if run.rank == 0:
        write_index(run, packed)
    run.result.seconds = time.monotonic() - t0
    return run.result


def _start(
    source: str,
    dest: str,
    options: PackOptions,
    store: Access,
    staging_dir: str | None,
    progress: Callable[[int, int], None] | None,
    rank: int | None,
    world_size: int | None,
) -> PackRun:
    """The run of one call: DEST checked, this process's rank, DEST's state and the s5cmd runner."""
    dest = as_folder(dest)
    parse_s3_uri(dest)
    r, world = rank_info(world_size, rank)
    parallel = max(1, min(PARALLEL_SHARDS, options.workers))
    return PackRun(
        source=source,
        dest=dest,
        options=options,
        store=store,
        rank=r,
        world=world,
        state=DestState(dest, store),
        s5=S5cmd(access=store, numworkers=max(4, options.workers // parallel)),  # per shard's run
        parallel=parallel,
        root=os.path.abspath(staging_dir) if staging_dir else tempfile.gettempdir(),
        result=PackResult(budget=int(options.budget)),
        progress=progress,
    )


def _parser() -> ArgumentParser:
    """The arguments of ``s5loader pack``."""
    p = ArgumentParser(
        prog="s5loader pack",
        description="Pack raw objects, a manifest or a split archive into WebDataset tar shards under an "
        "s3 prefix, with the wids.json index that S5Dataset.from_shards reads. Run it again with the same "
        "arguments to finish an interrupted pack.",
    )
    p.add_argument(
        "source", help="s3://bucket/prefix/, a manifest (.jsonl), or with --from-archive an archive's volumes"
    )
    p.add_argument(
        "dest", help="s3://bucket/prefix/ for the shards (empty, or an unfinished pack of the same source)"
    )
    p.add_argument(
        "--shard-size", type=size_arg, default="100MB", help="cut shards at this size (default 100MB)"
    )
    p.add_argument("--group-by", default="stem", choices=["stem", "folder", "object"])
    p.add_argument(
        "--label", choices=["folder"], help="folder: a 'cls' member with each sample's class index"
    )
    p.add_argument("--shuffle", action="store_true", help="shuffle samples across and within shards")
    p.add_argument("--seed", type=int, default=0, help="the shuffle's seed (default 0)")
    p.add_argument(
        "--budget",
        type=size_arg,
        default="1GiB",
        help="most local disk at once, a limit: the shards under way, each its tar and its largest "
        "object once more; a sample or shard that cannot fit is refused at the start (default 1GiB)",
    )
    p.add_argument("--workers", type=positive_int, default=64, help="parallel requests (default 64)")
    p.add_argument("--from-archive", action="store_true", help="SOURCE is a (split) tar archive, streamed")
    p.add_argument("--no-verify", action="store_true", help="with --from-archive: do not check volumes")
    p.add_argument("--skip-missing", action="store_true", help="leave out samples whose objects vanished")
    p.add_argument("--staging-dir", help="where local files go (default: the temporary directory)")
    p.add_argument("--index-timeout", type=float, default=3600.0, help="seconds rank 0 waits for other ranks")
    p.add_argument(
        "--transform",
        metavar="MODULE:FUNCTION",
        help="run this function on each sample while packing (a dict of the key and its fields' bytes in, "
        "the fields to write out); its module must be importable (PYTHONPATH)",
    )
    p.add_argument(
        "--transform-workers", type=positive_int, help="processes that run --transform (default: one per CPU)"
    )
    Access.add_arguments(p)
    return p


def main(argv: list[str]) -> int:
    """``s5loader pack SOURCE DEST [--shard-size SIZE] [--group-by ...] [--shuffle --seed N] ...``."""
    args = _parser().parse_args(argv)
    bar = Progress(f"packing into {args.dest}", unit="samples", final_line=False)
    try:
        result = pack(
            args.source,
            args.dest,
            shard_size=args.shard_size,
            group_by=args.group_by,
            label=args.label,
            shuffle=args.shuffle,
            seed=args.seed,
            budget=args.budget,
            workers=args.workers,
            from_archive=args.from_archive,
            verify=not args.no_verify,
            missing="skip" if args.skip_missing else "raise",
            staging_dir=args.staging_dir,
            index_timeout=args.index_timeout,
            access=Access.from_args(args),
            progress=bar,
            transform=load_transform(args.transform) if args.transform else None,
            transform_workers=args.transform_workers,
        )
    finally:
        bar.close()
    line = (
        f"packed {result.packed} of {result.shards} shards ({format_size(result.bytes)}) in "
        f"{result.seconds:.1f} s; at most {format_size(result.peak_staged)} of local disk reserved at "
        f"once (the shards under way: their objects and tar), of a {format_size(result.budget)} budget"
    )
    if result.index:
        line += f"; {result.samples} samples indexed in {result.index}"
    if result.skipped:
        line += f"; {len(result.skipped)} sample(s) left out (objects gone), such as {result.skipped[0]!r}"
    print(line)
    return 0
