"""The loading methods ``s5loader bench`` measures, and how it measures them.

Every method reads the same samples (the index :meth:`S5Dataset.from_prefix` lists) and is
timed from the moment its loop starts (listing and other setup are timed apart, as
``setup_s``). CPU is counted over the whole process tree (DataLoader workers and s5cmd
included) and split by kind of process by :class:`~.monitor.TreeMonitor`; S3 requests are
counted at the request-counting proxy when the run goes through one. Only the public API of
s5loader is used.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import DataLoader, Dataset

from s5loader import Access, S5Dataset, S5IterableDataset, S5Sampler, ShardIndexError, StagingOptions

from .monitor import TreeMonitor

METHODS = (
    "s5loader",
    "s5loader-block",
    "s5loader-sorted",
    "boto3",
    "s5cmd-run",
    "s5cmd-bulk",
    "s3torchconnector",
    "webdataset",
    "s5loader-shards",
    "s5loader-iterable",
)
PEERS = ("s3torchconnector", "webdataset")  # optional packages: skipped with a note when absent
INSTALL_HINT = "pip install 's5loader[bench]'"

#: Dollars per 1,000 requests of each kind: AWS S3 Standard list prices (GET and HEAD $0.0004,
#: LIST, PUT and the rest $0.005), the default of ``--prices``.
S3_PRICES: dict[str, float] = {"GET": 0.0004, "HEAD": 0.0004, "LIST": 0.005, "other": 0.005}


# --shard-shuffle: (webdataset's shardshuffle and shuffle buffer, s5loader's shuffle) over the shards
SHARD_SHUFFLES: dict[str, tuple[bool, int, bool | str]] = {
    "none": (False, 0, False),
    "block": (False, 0, "block"),
    "full": (True, 1000, True),
}


class SkipMethod(Exception):
    """A method that cannot run here (a peer not installed, or not working against this
    endpoint). Its message is the note reported instead of figures."""


@dataclass
class Settings:
    """What every method is run with."""

    source: str
    endpoint_url: str | None = None
    batch_size: int = 4
    num_workers: int = 4
    steps: int | None = None
    seconds: float | None = None
    samples_per_call: int = 1000
    calls_in_flight: int = StagingOptions.calls_in_flight
    budget: str = "2GiB"
    staging_dir: str | None = None
    shards_prefix: str | None = None
    shard_shuffle: str = "block"  # the shard methods': none, block or full (see SHARD_SHUFFLES)
    compute_ms: float = 0.0
    seed: int = 0
    region: str = "us-east-1"
    count_requests: bool = False  # every method through the request-counting proxy
    delay_ms: float = 0.0  # the latency the proxy adds per client-to-server chunk
    access: Access | None = None  # --no-sign-request, --profile, ... (the endpoint is endpoint_url)
    prices: dict[str, float] = field(default_factory=lambda: dict(S3_PRICES))  # $ per 1,000 requests by kind
    first_batch: bool = False  # each method runs to its first batch only (its calls sized as for a pass)
    s5cmd_workers: int = StagingOptions.s5cmd_workers  # s5loader's methods' (s5cmd's --numworkers)

    def store(self, endpoint: str | None) -> Access:
        """The access settings with ``endpoint`` (the request-counting proxy's, when there is one)."""
        a = self.access or Access()
        return dataclasses.replace(a, endpoint_url=endpoint, region=a.region or self.region)

    @property
    def plain_access(self) -> bool:
        """Whether the access settings are only an endpoint and a region, which every peer takes."""
        a = self.access or Access()
        return not (
            a.anonymous
            or a.profile
            or a.credentials_file
            or a.requester_pays
            or not a.verify_ssl
            or a.list_objects_v1
            or a.addressing_style != "auto"
        )


@dataclass
class Figures:
    """One method's figures (``None``: does not apply, e.g. no Python loop for s5cmd)."""

    method: str
    status: str = "ok"  # ok | skipped | failed
    note: str = ""
    num_workers: int | None = None  # DataLoader workers the method ran with (None: no DataLoader)
    samples: int = 0
    bytes: int = 0
    steps: int = 0
    seconds: float = 0.0
    setup_s: float = 0.0
    # from iter(loader) to the first batch of the first epoch (methods without a DataLoader:
    # from the start of the loop to the first step)
    first_batch_s: float | None = None
    samples_per_s: float | None = None
    mb_per_s: float | None = None
    step100_mean_s: float | None = None
    step100_var_s2: float | None = None
    step100_s: list[float] | None = None  # the time of each full window of 100 steps, in order
    wait_fraction: float | None = None
    cpu_s: float | None = None
    cpu_util: float | None = None
    cpu_s_per_1k_samples: float | None = None
    # CPU seconds per kind of process: s5cmd, main (the training process), workers (DataLoader
    # workers and anything else started below the training process), unattributed
    cpu_split_s: dict[str, float] | None = None
    cpu_split_s_per_1k_samples: dict[str, float] | None = None
    objects: int = 0  # objects (fields) in the samples delivered
    requests: dict[str, int] | None = None  # S3 requests by kind (GET, HEAD, LIST, other), at the proxy
    requests_per_sample: float | None = None
    requests_per_object: float | None = None
    requests_per_sample_by_kind: dict[str, float] | None = None
    # what the requests cost at the settings' prices, in dollars per million samples
    dollars_per_million_samples: float | None = None
    # TCP connections the proxy accepted during the run, per request, and the most open at once
    new_connections: int | None = None
    connections_per_request: float | None = None
    peak_open_connections: int | None = None
    peak_mem_mb: float | None = None
    ratio_to_s5loader: float | None = None
    cpu_per_sample_ratio_to_s5loader: float | None = None
    repeats_samples_per_s: list[float] | None = None  # every repeat's samples/s (--repeat)
    # the order's mixing (S5Sampler.shuffle_quality): distinct blocks among 256 consecutive
    # samples, and the mean move from key order as a share of the data set (1/3: full shuffle)
    blocks_per_256: float | None = None
    displacement: float | None = None


# -- timing ----------------------------------------------------------------------------------
class Recorder:
    """Step completion times (seconds after the loop started), samples, bytes and waits."""

    def __init__(self, batch_size: int, max_steps: float, seconds: float | None) -> None:
        self.batch_size = batch_size
        self.max_steps = max_steps
        self.max_samples = max_steps * batch_size
        self.seconds = seconds
        self.t0 = time.perf_counter()
        self.step_at: list[float] = []
        self.samples = 0
        self.objects = 0
        self.bytes = 0
        self.wait_s: float | None = None
        self.quality: tuple[float, float] | None = None  # (blocks per 256 samples, displacement)
        self.num_workers: int | None = None  # the DataLoader's workers (set by drive)
        self.first_batch_s: float | None = None  # iter(loader) to the first batch (set by drive)
        self.note = ""  # what the method ran with that differs from the settings

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def done(self) -> bool:
        if len(self.step_at) >= self.max_steps or self.samples >= self.max_samples:
            return True
        return self.seconds is not None and self.elapsed() >= self.seconds

    def step(self, samples: int, nbytes: int, waited: float | None, objects: int = 0) -> None:
        """A step ended now; ``waited``: how long the loop waited for it (``None``: no loop)."""
        self.step_at.append(self.elapsed())
        self.samples += samples
        self.objects += objects
        self.bytes += nbytes
        if waited is not None:
            self.wait_s = (self.wait_s or 0.0) + waited

    def fill(self, fig: Figures) -> None:
        """Write the timing figures into ``fig``."""
        fig.samples, fig.bytes, fig.steps = self.samples, self.bytes, len(self.step_at)
        fig.objects = self.objects
        fig.num_workers = self.num_workers
        if self.note:
            fig.note = self.note
        if not self.step_at:
            raise RuntimeError("no step completed")
        end = self.step_at[-1]
        fig.seconds = end
        fig.first_batch_s = self.first_batch_s if self.first_batch_s is not None else self.step_at[0]
        fig.samples_per_s = self.samples / end if end > 0 else None
        fig.mb_per_s = self.bytes / 1e6 / end if end > 0 else None
        windows = [
            self.step_at[k + 99] - (self.step_at[k - 1] if k else 0.0)
            for k in range(0, len(self.step_at) - 99, 100)
        ]
        if windows:
            fig.step100_s = [round(w, 4) for w in windows]
            mean = sum(windows) / len(windows)
            fig.step100_mean_s = mean
            fig.step100_var_s2 = (
                sum((w - mean) ** 2 for w in windows) / (len(windows) - 1) if len(windows) > 1 else None
            )
        fig.wait_fraction = self.wait_s / end if self.wait_s is not None and end > 0 else None
        if self.quality is not None:
            fig.blocks_per_256, fig.displacement = self.quality


def _sample_bytes(sample: Any) -> int:
    if isinstance(sample, dict):
        return sum(len(v) for v in sample.values() if isinstance(v, (bytes, bytearray, memoryview)))
    return len(sample) if isinstance(sample, (bytes, bytearray)) else 0


def _sample_objects(sample: Any) -> int:
    """The objects a sample was made of: its fields, less the ``__key__``-like metadata."""
    if isinstance(sample, dict):
        return sum(1 for k in sample if not str(k).startswith("__"))
    return 1


def collate_list(batch: list[Any]) -> list[Any]:
    """The DataLoader collate of every method: the batch as it came (no tensor work)."""
    return batch


def drive(make_loader: Callable[[int], Iterable[list[Any]]], rec: Recorder, compute_ms: float) -> None:
    """Run the (empty, or ``compute_ms``-long) training loop over epochs until ``rec`` is done."""
    epoch = 0
    while not rec.done():
        t = time.perf_counter()
        loader = make_loader(epoch)
        if isinstance(loader, DataLoader):
            rec.num_workers = loader.num_workers
        started = time.perf_counter()
        it: Iterator[list[Any]] | None = iter(loader)  # starts the workers: counted as waiting
        got = 0
        while True:
            try:
                batch = next(it)  # type: ignore[arg-type]
            except StopIteration:
                break
            if rec.first_batch_s is None:
                rec.first_batch_s = time.perf_counter() - started
            rec.step(
                len(batch),
                sum(_sample_bytes(s) for s in batch),
                time.perf_counter() - t,
                sum(_sample_objects(s) for s in batch),
            )
            got += 1
            if rec.done():
                break
            if compute_ms:
                time.sleep(compute_ms / 1000)
            t = time.perf_counter()
        it = None  # shuts the workers down
        if not got:
            raise RuntimeError(f"the loader yielded nothing in epoch {epoch}")
        epoch += 1


# -- the methods --------------------------------------------------------------------------
@dataclass
class Context:
    """What the methods share: settings, the listed index and the s5cmd binary."""

    settings: Settings
    dataset: S5Dataset
    s5cmd: str
    endpoint: str | None  # what the methods talk to: the proxy's endpoint when there is one
    tmp_root: str
    # the proxy's figures so far: requests by kind, connections accepted, the most open at once
    # since the last call (ProxyProcess.stats)
    proxy_stats: Callable[[], dict[str, Any]] | None = None
    exclude_pids: tuple[int, ...] = ()  # processes left out of the CPU figures (the proxy)
    max_steps: float = field(init=False)
    samples_per_call: int = field(init=False)

    def __post_init__(self) -> None:
        s = self.settings
        if s.first_batch:
            self.max_steps = 1
        elif s.steps is not None:
            self.max_steps = s.steps
        elif s.seconds is not None:
            self.max_steps = math.inf
        else:  # one pass over the data set
            self.max_steps = math.ceil(len(self.dataset) / s.batch_size)
        # --steps N: no call larger than the samples the N steps need
        self.samples_per_call = s.samples_per_call
        if s.steps is not None:
            self.samples_per_call = max(1, min(s.samples_per_call, s.steps * s.batch_size))

    @property
    def access(self) -> Access:
        """How the methods reach the store (through the proxy when there is one)."""
        return self.settings.store(self.endpoint)

    @property
    def samples_needed(self) -> float:
        """Samples the run delivers at most (``inf`` for ``--seconds``)."""
        return self.max_steps * self.settings.batch_size

    def recorder(self) -> Recorder:
        return Recorder(self.settings.batch_size, self.max_steps, self.settings.seconds)

    def loader(self, dataset: Any, num_workers: int | None = None, **kw: Any) -> DataLoader[Any]:
        """A DataLoader of the settings' batch size and workers (``num_workers``: instead of
        the settings' workers)."""
        s = self.settings
        return DataLoader(
            dataset,
            batch_size=s.batch_size,
            num_workers=s.num_workers if num_workers is None else num_workers,
            collate_fn=collate_list,
            **kw,
        )


def run_s5loader(ctx: Context, shuffle: bool | str = True, dataset: S5Dataset | None = None) -> Recorder:
    """S5Sampler + S5Dataset through a DataLoader (``s5loader-block``: ``shuffle="block"``;
    ``s5loader-sorted``: ``shuffle=False``; ``s5loader-shards``: over the tar shards)."""
    s = ctx.settings
    ds = dataset if dataset is not None else S5Dataset.from_prefix(s.source, access=ctx.access)
    sampler = S5Sampler(
        ds,
        shuffle=shuffle,
        seed=s.seed,
        samples_per_call=ctx.samples_per_call,
        calls_in_flight=s.calls_in_flight,
        budget=s.budget,
        staging_dir=s.staging_dir,
        s5cmd_workers=s.s5cmd_workers,
    )
    try:
        loader = ctx.loader(ds, sampler=sampler)
        rec = ctx.recorder()

        def epoch_loader(epoch: int) -> DataLoader[Any]:
            sampler.set_epoch(epoch)
            return loader

        drive(epoch_loader, rec, s.compute_ms)
        if dataset is None:  # blocks of raw objects: how well the order mixes them
            q = sampler.shuffle_quality(epoch=0)
            rec.quality = (round(q.units_per_span, 2), round(q.displacement, 4))
    finally:
        sampler.close()
    return rec


class Boto3Dataset(Dataset[dict[str, Any]]):
    """The common baseline: a map-style Dataset with one GetObject per file."""

    def __init__(self, samples: list[tuple[str, list[tuple[str, str, str]]]], access: Access) -> None:
        self.samples = samples  # (key, [(field, bucket, object key)])
        self.access = access
        self._client: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self._client is None or self._pid != os.getpid():
            # the same client settings s5loader's own boto3 clients get
            self._client = self.access.boto3_client()
            self._pid = os.getpid()
        key, fields = self.samples[i]
        out: dict[str, Any] = {"__key__": key}
        for name, bucket, obj in fields:
            out[name] = self._client.get_object(Bucket=bucket, Key=obj)["Body"].read()
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None, "_pid": -1}


def _split_uri(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://") :].partition("/")
    return bucket, key


def run_boto3(ctx: Context) -> Recorder:
    s = ctx.settings
    samples = [(x.key, [(f.name, *_split_uri(f.uri)) for f in x.fields]) for x in ctx.dataset.samples]
    ds = Boto3Dataset(samples, ctx.access)
    rec = ctx.recorder()

    def epoch_loader(epoch: int) -> DataLoader[Any]:
        import torch

        return ctx.loader(ds, shuffle=True, generator=torch.Generator().manual_seed(s.seed + epoch))

    drive(epoch_loader, rec, s.compute_ms)
    return rec


def _s5cmd_argv(ctx: Context, *args: str, json_lines: bool = True) -> list[str]:
    argv = [ctx.s5cmd] + (["--json"] if json_lines else []) + ["--retry-count", "3"]
    return argv + ctx.access.s5cmd_flags() + list(args)


def _s5cmd_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("AWS_REGION", env.get("AWS_DEFAULT_REGION") or "us-east-1")
    return env


class _Completions:
    """Turns s5cmd's per-object success lines into per-step times (a step: ``batch_size``
    samples whose every object has arrived)."""

    def __init__(self, ctx: Context, rec: Recorder) -> None:
        self.rec = rec
        self.fields: dict[str, tuple[int, int]] = {}  # uri -> (sample index, number of fields)
        self.sizes: dict[int, int] = {}
        for i, x in enumerate(ctx.dataset.samples):
            self.sizes[i] = x.size
            for f in x.fields:
                self.fields[f.uri] = (i, len(x.fields))
        self.lock = threading.Lock()
        self.pending: dict[tuple[int, int], int] = {}
        self.in_step = [0, 0, 0]  # samples, bytes, objects of the step being filled
        self.unmatched: list[str] = []  # the first sources of copies that are no object of the index
        self.unmatched_count = 0

    def line(self, epoch: int, rec_line: dict[str, Any]) -> None:
        source = str(rec_line.get("source", ""))
        hit = self.fields.get(source)
        if hit is None:
            with self.lock:
                self.unmatched_count += 1
                if len(self.unmatched) < 2:
                    self.unmatched.append(source)
            return
        idx, nfields = hit
        with self.lock:
            k = (epoch, idx)
            got = self.pending.get(k, 0) + 1
            if got < nfields:
                self.pending[k] = got
                return
            self.pending.pop(k, None)
            self.in_step[0] += 1
            self.in_step[1] += self.sizes[idx]
            self.in_step[2] += nfields
            if self.in_step[0] == self.rec.batch_size:
                self.rec.step(self.in_step[0], self.in_step[1], None, self.in_step[2])
                self.in_step = [0, 0, 0]

    def flush(self) -> None:
        with self.lock:
            if self.in_step[0]:
                self.rec.step(self.in_step[0], self.in_step[1], None, self.in_step[2])
                self.in_step = [0, 0, 0]


def _run_s5cmd(
    argv: list[str], on_line: Callable[[dict[str, Any]], None], stop: threading.Event, rec: Recorder
) -> list[str]:
    """Run one s5cmd, feed its JSON lines to ``on_line``; kill it once ``rec`` is done or
    ``stop`` is set. Returns the destinations it wrote. Raises on a failure it was not told
    to cause."""
    dests: list[str] = []
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=_s5cmd_env()
        )
        killed = False
        assert proc.stdout is not None
        try:
            for raw in proc.stdout:
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(line, dict) and line.get("success"):
                    if line.get("destination"):
                        dests.append(str(line["destination"]))
                    on_line(line)
                if (stop.is_set() or rec.done()) and not killed:
                    killed = True
                    stop.set()
                    proc.kill()
        finally:
            if proc.poll() is None and (stop.is_set() or rec.done()):
                killed = True
                proc.kill()
            rc = proc.wait()
            proc.stdout.close()
        if rc != 0 and not killed:
            err.seek(0)
            tail = err.read()[-2000:].decode("utf-8", "replace").strip()
            raise RuntimeError(f"{shlex.join(argv)} exited with code {rc}: {tail}")
    return dests


def _remove(paths: list[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        try:
            os.rmdir(os.path.dirname(p))
        except OSError:
            pass


def run_s5cmd_run(ctx: Context) -> Recorder:
    """The command files s5loader writes, run by s5cmd (``calls_in_flight`` at once, of
    ``s5cmd_workers`` each, as the sampler does) into tmpfs with no Python reading the files;
    each call's files are deleted after it."""
    s = ctx.settings
    spc = ctx.samples_per_call
    sampler = S5Sampler(
        ctx.dataset,
        shuffle=True,
        seed=s.seed,
        samples_per_call=spc,
        calls_in_flight=s.calls_in_flight,
        budget=s.budget,
        staging_dir=s.staging_dir,
    )
    root = tempfile.mkdtemp(prefix="s5cmd-run-", dir=ctx.tmp_root)
    try:
        plan: list[tuple[int, str]] = []
        per_epoch = math.ceil(len(ctx.dataset) / spc)
        calls_needed = None
        if math.isfinite(ctx.max_steps):  # whole epochs of calls, then the calls the rest needs
            full, rest = divmod(int(ctx.samples_needed), len(ctx.dataset))
            calls_needed = full * per_epoch + math.ceil(rest / spc)
        epoch = 0
        while calls_needed is None or len(plan) < calls_needed:
            files = sampler.write_command_files(os.path.join(root, f"e{epoch}"), epoch=epoch)
            plan += [(epoch, f) for f in files]
            epoch += 1
            if calls_needed is None and len(plan) >= per_epoch * 50:
                break  # --seconds: more than any run will get through; killed at the deadline
        if calls_needed is not None:
            plan = plan[:calls_needed]
        rec = ctx.recorder()
        done = _Completions(ctx, rec)
        stop = threading.Event()

        with ThreadPoolExecutor(max_workers=1) as cleaner:

            def call(item: tuple[int, str]) -> None:
                ep, path = item
                if stop.is_set() or rec.done():
                    return
                argv = _s5cmd_argv(ctx, "--numworkers", str(s.s5cmd_workers), "run", path)
                # deleted by another thread, so that the next call starts at once
                cleaner.submit(_remove, _run_s5cmd(argv, lambda line: done.line(ep, line), stop, rec))

            with ThreadPoolExecutor(max_workers=s.calls_in_flight) as pool:
                for fut in [pool.submit(call, item) for item in plan]:
                    fut.result()
            done.flush()
    finally:
        sampler.close()
        shutil.rmtree(root, ignore_errors=True)
    return rec


_GLOB = frozenset("*?[]{}\\")


def wildcard_cover(keys: list[str], needed: set[str], base: str) -> tuple[list[str], list[str]]:
    """The fewest key prefixes whose wildcards (``prefix*``) match exactly the ``needed`` keys
    among ``keys`` (all of which start with ``base``), and the needed keys no clean wildcard can
    name (a prefix with a glob character in it), to be copied one by one.

    Returns:
        (prefixes, single keys).
    """
    ordered = sorted(keys)
    prefixes: list[str] = []
    singles: list[str] = []

    def walk(prefix: str, group: list[str]) -> None:
        prefix = max(prefix, os.path.commonprefix(group), key=len)  # skip to the next branching
        want = [k for k in group if k in needed]
        if not want:
            return
        if len(want) == len(group) and not (_GLOB & set(prefix)):
            prefixes.append(prefix)
            return
        if prefix in needed and prefix in group:  # a key that is also a prefix of others
            singles.append(prefix)
        by_next: dict[str, list[str]] = {}
        for k in group:
            if len(k) > len(prefix):
                by_next.setdefault(k[len(prefix)], []).append(k)
        for ch in sorted(by_next):
            walk(prefix + ch, by_next[ch])

    walk(base, [k for k in ordered if k.startswith(base)])
    return prefixes, singles


def bulk_lines(ctx: Context, count: int, dest: str) -> list[str]:
    """``s5cmd run`` lines that copy the objects of the first ``count`` samples (in index
    order) and as few others as wildcards allow: one ``cp 'PREFIX*'`` per prefix of
    :func:`wildcard_cover`, each into a folder of its own, and ``cp --raw`` for the rest."""
    bucket, base = _split_uri(ctx.settings.source)
    keys = [_split_uri(f.uri)[1] for x in ctx.dataset.samples for f in x.fields]
    needed = {_split_uri(f.uri)[1] for x in ctx.dataset.samples[:count] for f in x.fields}
    prefixes, singles = wildcard_cover(keys, needed, base)
    lines = [
        f"cp {shlex.quote(f's3://{bucket}/{p}*')} {shlex.quote(os.path.join(dest, str(n)) + '/')}"
        for n, p in enumerate(prefixes)
    ]
    lines += [
        f"cp --raw {shlex.quote(f's3://{bucket}/{k}')} {shlex.quote(os.path.join(dest, 'raw', str(n)) + '/')}"
        for n, k in enumerate(singles)
    ]
    return lines


def run_s5cmd_bulk(ctx: Context) -> Recorder:
    """One ``s5cmd cp 's3://prefix/*' DIR/`` per pass into tmpfs, no Python reading; deleted
    after. With ``--steps`` the last pass copies only the samples the steps still need (by
    :func:`bulk_lines`, with ``s5cmd run``)."""
    root = tempfile.mkdtemp(prefix="s5cmd-bulk-", dir=ctx.tmp_root)
    try:
        rec = ctx.recorder()
        done = _Completions(ctx, rec)
        stop = threading.Event()
        epoch = 0
        n = len(ctx.dataset)
        while not rec.done() and not stop.is_set():
            dest = os.path.join(root, f"e{epoch}") + "/"
            before = rec.samples
            left = ctx.samples_needed - rec.samples - done.in_step[0]
            if left >= n:
                argv = _s5cmd_argv(ctx, "--numworkers", "256", "cp", ctx.settings.source + "*", dest)
            else:
                cmd_file = os.path.join(root, f"e{epoch}.txt")
                with open(cmd_file, "w") as fh:
                    fh.write("\n".join(bulk_lines(ctx, int(left), dest)) + "\n")
                argv = _s5cmd_argv(ctx, "--numworkers", "256", "run", cmd_file)
            copies = _run_s5cmd(argv, functools.partial(done.line, epoch), stop, rec)
            shutil.rmtree(dest, ignore_errors=True)
            if rec.samples == before and not done.in_step[0]:
                if rec.done():
                    break  # the run's time ran out before this pass's first object arrived
                raise RuntimeError(_copied_none(argv, copies, done, root))
            epoch += 1
        done.flush()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rec


def _copied_none(argv: list[str], copies: list[str], done: _Completions, root: str) -> str:
    """What a pass of ``s5cmd-bulk`` that exited with code 0 and completed no sample did: the
    copies s5cmd reported, whether their sources are objects of the index, and the room left
    where it copied to."""
    room = shutil.disk_usage(root).free
    first = next(iter(done.fields), "none")
    if not copies:
        what = (
            "it reported no copy at all (its wildcard matched nothing: was the prefix emptied or relisted?)"
        )
    elif done.unmatched_count:
        what = (
            f"it reported {len(copies)} copies, {done.unmatched_count} of them of objects that are not in "
            f"the index (such as {', '.join(done.unmatched)}; the index has {len(done.fields)} objects, "
            f"such as {first}): was the prefix changed since it was listed?"
        )
    else:
        what = f"it reported {len(copies)} copies, none of which completed a sample"
    return (
        f"{shlex.join(argv)} exited with code 0 but copied none of the indexed objects: {what}; "
        f"{room / 1e6:.1f} MB free in {root}"
    )


def import_peer(name: str) -> Any:
    """Import an optional peer package, or raise :class:`SkipMethod` saying it is absent."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise SkipMethod(f"{name} is not installed ({exc}); {INSTALL_HINT}") from exc


def _reader_key_bytes(reader: Any) -> tuple[str, bytes]:
    return reader.key, reader.read()


class ConnectorSamples(Dataset[dict[str, Any]]):
    """s3torchconnector's S3MapDataset (one object per item) regrouped into our samples."""

    def __init__(self, inner: Any, groups: list[tuple[str, list[tuple[str, int, str]]]]) -> None:
        self.inner, self.groups = inner, groups  # (sample key, [(field, item number, object key)])

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, i: int) -> dict[str, Any]:
        key, fields = self.groups[i]
        out: dict[str, Any] = {"__key__": key}
        for name, j, obj in fields:
            got_key, data = self.inner[j]
            if got_key != obj:
                raise RuntimeError(f"S3MapDataset item {j} is {got_key!r}, expected {obj!r}")
            out[name] = data
        return out


def run_s3torchconnector(ctx: Context) -> Recorder:
    """AWS's connector: ``S3MapDataset.from_prefix`` through a DataLoader."""
    s = ctx.settings
    stc = import_peer("s3torchconnector")
    if not s.plain_access:
        raise SkipMethod(
            "s3torchconnector is not given the access options (--no-sign-request, --profile, ...); "
            "run it without them to compare"
        )
    config = stc.S3ClientConfig(force_path_style=True) if ctx.endpoint else None
    try:
        inner = stc.S3MapDataset.from_prefix(
            s.source,
            region=s.region,
            endpoint=ctx.endpoint,
            transform=_reader_key_bytes,
            s3client_config=config,
        )
        n = len(inner)  # lists the prefix
    except Exception as exc:  # noqa: BLE001 - any failure means: does not work against this endpoint
        raise SkipMethod(
            f"s3torchconnector cannot list {s.source} at {ctx.endpoint or 'AWS'}: {exc}"
        ) from exc
    all_keys = sorted(_split_uri(f.uri)[1] for x in ctx.dataset.samples for f in x.fields)
    if n != len(all_keys):
        raise RuntimeError(f"S3MapDataset lists {n} objects under {s.source}; the index has {len(all_keys)}")
    pos = {k: j for j, k in enumerate(all_keys)}  # S3 lists in key order
    groups = [
        (x.key, [(f.name, pos[_split_uri(f.uri)[1]], _split_uri(f.uri)[1]) for f in x.fields])
        for x in ctx.dataset.samples
    ]
    ds = ConnectorSamples(inner, groups)
    try:
        ds[0]
    except Exception as exc:  # noqa: BLE001
        raise SkipMethod(f"s3torchconnector cannot read from {ctx.endpoint or 'AWS'}: {exc}") from exc
    rec = ctx.recorder()

    def epoch_loader(epoch: int) -> DataLoader[Any]:
        import torch

        return ctx.loader(ds, shuffle=True, generator=torch.Generator().manual_seed(s.seed + epoch))

    drive(epoch_loader, rec, s.compute_ms)
    return rec


def shards_prefix(source: str) -> str:
    """Where ``--generate`` writes the tar shards by default: ``s3://b/train/`` ->
    ``s3://b/train-shards/`` (a sibling, so listing the source does not include them)."""
    return source.rstrip("/") + "-shards/"


def no_shards_note(prefix: str, source: str) -> str:
    """The skip note of the shard methods when ``prefix`` holds no tar shards: first how to point
    them at existing shards, then how to write a synthetic data set with shards instead."""
    default = " (the default: SOURCE's sibling '<name>-shards/')" if prefix == shards_prefix(source) else ""
    return (
        f"no tar shards under {prefix}{default}; point --shards-prefix at the s3:// prefix of your tar "
        "shards of these samples, or write a synthetic data set with shards by "
        "s5loader bench --generate N SOURCE (it writes N made-up samples under SOURCE and their "
        "shards under --shards-prefix)"
    )


def list_uris(ctx: Context, prefix: str) -> list[str]:
    """The object URIs under ``prefix``, listed with ``s5cmd ls`` (empty if there are none)."""
    argv = _s5cmd_argv(ctx, "ls", prefix + "*")
    proc = subprocess.run(argv, capture_output=True, env=_s5cmd_env(), check=False)
    uris = []
    for raw in proc.stdout.splitlines():
        line = json.loads(raw)
        if line.get("type") == "file":
            uris.append(str(line["key"]))
    if proc.returncode != 0 and not uris:
        tail = proc.stderr.decode("utf-8", "replace").strip()[-1000:]
        if "no object found" in tail.lower():
            return []
        raise RuntimeError(f"{shlex.join(argv)} exited with code {proc.returncode}: {tail}")
    return sorted(uris)


def run_webdataset(ctx: Context) -> Recorder:
    """webdataset over tar shards of the same samples, each fetched with ``pipe:s5cmd cat``."""
    s = ctx.settings
    wds = import_peer("webdataset")
    prefix = s.shards_prefix or shards_prefix(s.source)
    shards = [u for u in list_uris(ctx, prefix) if u.endswith(".tar")]
    if not shards:
        raise SkipMethod(no_shards_note(prefix, s.source))
    # webdataset splits the shards among the workers: one without a shard would deliver nothing,
    # so no more workers than shards
    workers = min(s.num_workers, len(shards))
    head = shlex.join(_s5cmd_argv(ctx, "cat", json_lines=False))
    urls = [f"pipe:{head} {shlex.quote(u)}" for u in shards]
    os.environ.setdefault("AWS_REGION", "us-east-1")  # the pipe's s5cmd inherits it
    rec = ctx.recorder()
    if workers < s.num_workers:
        rec.note = (
            f"{len(shards)} shard{'s' if len(shards) != 1 else ''}, ran with {workers} "
            f"worker{'s' if workers != 1 else ''} instead of {s.num_workers}"
        )

    shardshuffle, buffer, _ = SHARD_SHUFFLES[s.shard_shuffle]

    def epoch_loader(epoch: int) -> DataLoader[Any]:
        if not shardshuffle:
            return ctx.loader(
                wds.WebDataset(urls, shardshuffle=False, empty_check=False), num_workers=workers
            )
        ds = wds.WebDataset(urls, shardshuffle=len(urls), seed=s.seed + epoch, empty_check=False)
        return ctx.loader(ds.shuffle(buffer), num_workers=workers)

    drive(epoch_loader, rec, s.compute_ms)
    return rec


def shard_dataset(ctx: Context) -> S5Dataset:
    """``S5Dataset.from_shards`` over the tar shards webdataset reads; a missing shard index is
    built first with ``s5loader index-shards`` (in the run's setup, so its time and CPU count)."""
    prefix = ctx.settings.shards_prefix or shards_prefix(ctx.settings.source)
    if not any(u.endswith(".tar") for u in list_uris(ctx, prefix)):
        raise SkipMethod(no_shards_note(prefix, ctx.settings.source))
    try:
        return S5Dataset.from_shards(prefix, access=ctx.access)
    except ShardIndexError:
        argv = [sys.executable, "-m", "s5loader", "index-shards", prefix, *ctx.access.to_args()]
        proc = subprocess.run(argv, capture_output=True, check=False)
        if proc.returncode != 0:
            tail = proc.stderr.decode("utf-8", "replace").strip()[-1000:]
            raise RuntimeError(f"{shlex.join(argv)} exited with code {proc.returncode}: {tail}") from None
        return S5Dataset.from_shards(prefix, access=ctx.access)


def run_s5loader_shards(ctx: Context) -> Recorder:
    """S5Dataset.from_shards + S5Sampler over the tar shards webdataset reads (``shuffle="block"``;
    ``--shard-shuffle``: False or True)."""
    return run_s5loader(
        ctx, shuffle=SHARD_SHUFFLES[ctx.settings.shard_shuffle][2], dataset=shard_dataset(ctx)
    )


def run_s5loader_iterable(ctx: Context) -> Recorder:
    """S5IterableDataset over the same tar shards (``--shard-shuffle``): no sampler; the rank stages
    its order once, within the whole budget, and the DataLoader's workers take turns along it a
    batch at a time."""
    s = ctx.settings
    it = S5IterableDataset(
        shard_dataset(ctx),
        shuffle=SHARD_SHUFFLES[s.shard_shuffle][2],
        seed=s.seed,
        budget=s.budget,
        staging_dir=s.staging_dir,
        calls_in_flight=s.calls_in_flight,
        batch_size=s.batch_size,
    )
    try:
        loader = ctx.loader(it)
        rec = ctx.recorder()

        def epoch_loader(epoch: int) -> DataLoader[Any]:
            it.set_epoch(epoch)
            return loader

        drive(epoch_loader, rec, s.compute_ms)
    finally:
        it.close()
    return rec


RUNNERS: dict[str, Callable[[Context], Recorder]] = {
    "s5loader": run_s5loader,
    "s5loader-block": lambda ctx: run_s5loader(ctx, shuffle="block"),
    "s5loader-sorted": lambda ctx: run_s5loader(ctx, shuffle=False),
    "boto3": run_boto3,
    "s5cmd-run": run_s5cmd_run,
    "s5cmd-bulk": run_s5cmd_bulk,
    "s3torchconnector": run_s3torchconnector,
    "webdataset": run_webdataset,
    "s5loader-shards": run_s5loader_shards,
    "s5loader-iterable": run_s5loader_iterable,
}


def measure(method: str, ctx: Context) -> Figures:
    """Run one method under a :class:`TreeMonitor`, counting its requests at the proxy when
    there is one; never raises for the method's own failure."""
    fig = Figures(method)
    before = ctx.proxy_stats() if ctx.proxy_stats else None  # also starts the period of its peak
    monitor = TreeMonitor(exclude=ctx.exclude_pids).start()
    t0 = time.perf_counter()
    try:
        rec = RUNNERS[method](ctx)
    except SkipMethod as exc:
        monitor.stop()
        fig.status, fig.note = "skipped", str(exc)
        return fig
    except Exception as exc:  # noqa: BLE001 - reported in the table, the next method still runs
        monitor.stop()
        fig.status, fig.note = "failed", f"{type(exc).__name__}: {exc}"
        return fig
    total = time.perf_counter() - t0
    cpu, peak = monitor.stop()
    rec.fill(fig)
    fig.setup_s = max(0.0, (rec.t0 - t0))
    fig.cpu_s = cpu
    fig.cpu_util = cpu / total if total > 0 else None
    fig.cpu_s_per_1k_samples = cpu / fig.samples * 1000 if fig.samples else None
    fig.cpu_split_s = {k: round(v, 4) for k, v in monitor.cpu_split().items()}
    if fig.samples:
        fig.cpu_split_s_per_1k_samples = {k: v / fig.samples * 1000 for k, v in fig.cpu_split_s.items()}
    fig.peak_mem_mb = peak / 1e6
    if ctx.proxy_stats is not None and before is not None:
        after = ctx.proxy_stats()
        fig.requests = {k: v - before["requests"].get(k, 0) for k, v in after["requests"].items()}
        fig.new_connections = after["connections"] - before["connections"]
        fig.peak_open_connections = after["peak_open"]
        fill_request_rates(fig, ctx.settings.prices)
    return fig


def fill_request_rates(fig: Figures, prices: dict[str, float] = S3_PRICES) -> None:
    """Requests per sample and per object, in all and by kind, from ``fig.requests``; their
    price per million samples at ``prices`` (dollars per 1,000 requests of each kind); new
    connections per request (from ``fig.new_connections``)."""
    if fig.requests is None or not fig.samples:
        return
    total = sum(v for k, v in fig.requests.items() if k != "unreadable")
    fig.requests_per_sample = total / fig.samples
    fig.requests_per_object = total / fig.objects if fig.objects else None
    fig.requests_per_sample_by_kind = {k: v / fig.samples for k, v in fig.requests.items()}
    fig.dollars_per_million_samples = (
        sum(v * prices.get(k, prices.get("other", 0.0)) for k, v in fig.requests.items() if k != "unreadable")
        / 1000
        / fig.samples
        * 1e6
    )
    if fig.new_connections is not None and total:
        fig.connections_per_request = fig.new_connections / total
