"""``s5loader bench``: measure loading methods on the same objects, one after another.

    s5loader bench SOURCE [--endpoint-url URL] [--methods M ...] [--batch-size 4]
                   [--num-workers N] [--steps N | --seconds S | --first-batch] [--samples-per-call N]
                   [--count-requests] [--delay-ms D] [--prices GET=0.0004,LIST=0.005,...]
                   [--json FILE] [--markdown FILE] [--plot FILE] [--wide]
    s5loader bench --generate N SOURCE [--sample-size 100KB] [--no-label] [--shard-samples 100]
                   [--shards-prefix URI]

Methods: ``s5loader`` (S5Sampler + S5Dataset; ``s5loader-block`` with ``shuffle="block"``,
``s5loader-sorted`` with ``shuffle=False``), ``boto3`` (one GetObject per file),
``s5cmd-run`` (the sampler's own command files run by s5cmd, no Python reading: the ceiling of
this design), ``s5cmd-bulk`` (one ``s5cmd cp 'prefix/*'``: the ceiling of the sidecar),
``s3torchconnector`` and ``webdataset`` (tar shards through ``pipe:s5cmd cat``) when installed,
``s5loader-shards`` (``S5Dataset.from_shards`` + ``S5Sampler(shuffle="block")`` over the same
shards; their index is built first when missing) and ``s5loader-iterable``
(``S5IterableDataset(shuffle="block")`` over them, no sampler);
a peer that is absent or cannot work against the endpoint is skipped with a note.

Per method: samples/s, the time to the first batch, CPU per 1,000 samples split into s5cmd, the
training process and the DataLoader workers, and (through the request-counting proxy,
``--count-requests`` or ``--delay-ms``) S3 requests per sample by kind, their price per million
samples (``--prices``), the TCP connections opened per request and the most open at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import io
import json
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
import warnings
from collections.abc import Callable
from typing import Any

import psutil

from s5loader import Access, ConfigError, Progress, S5Dataset, StagingOptions, find_s5cmd, parse_size

from .methods import INSTALL_HINT, METHODS, S3_PRICES, Context, Figures, Settings, measure, shards_prefix
from .proxy import ProxyProcess

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
_ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL")


# -- argparse types ----------------------------------------------------------------------------
def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {v}")
        return v

    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0 or not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return v


def prices_arg(text: str) -> dict[str, float]:
    """``GET=0.0004,LIST=0.005``: dollars per 1,000 requests of a kind (GET, HEAD, LIST, other)
    over the AWS S3 Standard list prices of :data:`S3_PRICES`."""
    prices = dict(S3_PRICES)
    for item in (p for p in text.split(",") if p.strip()):
        kind, sep, value = item.partition("=")
        kind = {k.lower(): k for k in S3_PRICES}.get(kind.strip().lower(), "")
        if not sep or not kind:
            raise argparse.ArgumentTypeError(
                f"expected KIND=DOLLARS with KIND one of {', '.join(S3_PRICES)}, got {item!r}"
            )
        try:
            prices[kind] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a number (in {item!r})") from None
        if prices[kind] < 0 or not math.isfinite(prices[kind]):
            raise argparse.ArgumentTypeError(f"a price must be 0 or more, got {item!r}")
    return prices


def size_arg(text: str) -> int:
    """A size such as ``2GiB``, ``500MB`` or a number of bytes."""
    try:
        return parse_size(text, "size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="s5loader bench",
        description="Measure loading methods on the same S3 objects, one after another, and print "
        "a table (samples/s, MB/s, time per 100 steps, waiting, CPU of the whole process tree, "
        "peak memory, ratio to s5loader).",
    )
    p.add_argument(
        "source",
        help="s3://bucket/prefix/ holding NNNNNN.image + NNNNNN.label pairs (or any objects grouped by stem)",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        metavar="M",
        help=f"methods to run, in order (space or comma separated; default all: {', '.join(METHODS)})",
    )
    p.add_argument("--batch-size", type=positive_int, default=4, help="samples per step (default 4)")
    p.add_argument(
        "--num-workers",
        type=non_negative_int,
        default=4,
        help="DataLoader workers of every DataLoader method (default 4)",
    )
    stop = p.add_mutually_exclusive_group()
    stop.add_argument(
        "--steps", type=positive_int, help="steps per method (default: one pass over the data set)"
    )
    stop.add_argument("--seconds", type=positive_float, help="seconds per method instead of a step count")
    stop.add_argument(
        "--first-batch",
        action="store_true",
        help="run each method only to its first batch: the time from iter(loader) to it (the "
        "sampler's calls sized as for a whole pass, unlike --steps 1)",
    )
    p.add_argument(
        "--samples-per-call",
        type=positive_int,
        default=1000,
        help="S5Sampler samples per s5cmd call, also for s5cmd-run (default 1000)",
    )
    p.add_argument(
        "--calls-in-flight",
        "--buffers",
        dest="calls_in_flight",
        type=positive_int,
        default=StagingOptions.calls_in_flight,
        help=(
            "S5Sampler calls_in_flight: s5cmd calls running at once "
            f"(default {StagingOptions.calls_in_flight}; --buffers is its former name)"
        ),
    )
    p.add_argument("--budget", default="2GiB", help="S5Sampler staging budget (default 2GiB)")
    p.add_argument(
        "--s5cmd-workers",
        type=positive_int,
        default=StagingOptions.s5cmd_workers,
        help=f"S5Sampler s5cmd_workers, s5cmd's --numworkers (default {StagingOptions.s5cmd_workers})",
    )
    p.add_argument("--staging-dir", help="S5Sampler staging root (default: /dev/shm when it has room)")
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="run the method list this many times, interleaved, and report per method the "
        "repeat with the median samples/s (default 1)",
    )
    p.add_argument(
        "--compute-ms",
        type=float,
        default=0.0,
        help="simulated training step in ms (default 0: an empty loop)",
    )
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (and --generate's random seed)")
    p.add_argument(
        "--count-requests",
        action="store_true",
        help="run every method through a request-counting proxy in front of the endpoint (a child "
        "process, not counted in the CPU figures) and report S3 requests per sample by kind; needs "
        "a plain http:// endpoint",
    )
    p.add_argument(
        "--delay-ms",
        type=float,
        default=None,
        help="hold every client-to-server chunk this many ms at that proxy, like a trip to a distant "
        "store (implies --count-requests; default 0)",
    )
    p.add_argument(
        "--prices",
        type=prices_arg,
        default=dict(S3_PRICES),
        metavar="KIND=DOLLARS,...",
        help="dollars per 1,000 requests of each kind (GET, HEAD, LIST, other) for the $/M samples "
        "column; default AWS S3 Standard list prices: GET=0.0004,HEAD=0.0004,LIST=0.005,other=0.005",
    )
    p.add_argument(
        "--shards-prefix", help="tar shards for webdataset (default: SOURCE's sibling '<name>-shards/')"
    )
    p.add_argument(
        "--shard-shuffle",
        choices=["none", "block", "full"],
        default="block",
        help="how the shard methods shuffle: none (webdataset in shard order; s5loader shuffle=False), "
        'block (default: webdataset in shard order; s5loader shuffle="block"), full (webdataset '
        "shardshuffle + shuffle(1000); s5loader shuffle=True)",
    )
    p.add_argument(
        "--json", dest="json_file", metavar="FILE", help="write every figure and the settings as JSON"
    )
    p.add_argument(
        "--plot", metavar="FILE", help="write a PNG bar chart of samples/s and CPU per method (matplotlib)"
    )
    p.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown (every column)")
    p.add_argument(
        "--wide",
        action="store_true",
        help="print every column (time per 100 steps, waiting, CPU split, requests by kind, peak "
        "memory, ...) instead of the compact table; --json and --markdown always have them all",
    )
    Access.add_arguments(p)  # --endpoint-url, --region, --no-sign-request, --profile, ...
    gen = p.add_argument_group("generating a toy data set")
    gen.add_argument(
        "--generate",
        type=positive_int,
        metavar="N",
        help="write N samples (NNNNNN.image + NNNNNN.label) under SOURCE and tar shards of "
        "them under --shards-prefix, then exit",
    )
    gen.add_argument(
        "--sample-size", type=size_arg, default=100_000, help="bytes of each .image (default 100KB)"
    )
    gen.add_argument(
        "--label-size",
        type=size_arg,
        default=None,
        help="bytes of each .label (default: the class number as text, a few bytes)",
    )
    gen.add_argument(
        "--no-label",
        action="store_true",
        help="one object per sample: write NNNNNN.image alone (and shards of it), no .label",
    )
    gen.add_argument(
        "--shard-samples", type=positive_int, default=100, help="samples per tar shard (default 100)"
    )
    return p


def _methods(parser: argparse.ArgumentParser, given: list[str] | None) -> list[str]:
    if not given:
        return list(METHODS)
    names = [m.strip() for g in given for m in g.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        parser.error(
            f"--methods: unknown method {', '.join(map(repr, unknown))} (choose from {', '.join(METHODS)})"
        )
    if not names:
        parser.error("--methods: no method given")
    return list(dict.fromkeys(names))


def _endpoint(given: str | None) -> str | None:
    if given:
        return given
    for var in _ENDPOINT_VARS:
        if os.environ.get(var):
            return os.environ[var]
    return None


# -- generating the toy data set ----------------------------------------------------------
def _s5cmd_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("AWS_REGION", env.get("AWS_DEFAULT_REGION") or "us-east-1")
    return env


def upload(local_glob: str, dest: str, endpoint: str | None, progress: Progress) -> None:
    """``s5cmd cp LOCAL_GLOB DEST`` (in parallel), counting its JSON lines into ``progress``."""
    argv = (
        [find_s5cmd(), "--json"]
        + (["--endpoint-url", endpoint] if endpoint else [])
        + ["--numworkers", "64", "cp", local_glob, dest]
    )
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=_s5cmd_env()
        )
        assert proc.stdout is not None
        for raw in proc.stdout:
            if b'"success":true' in raw.replace(b" ", b""):
                progress.update()
        rc = proc.wait()
        proc.stdout.close()
        if rc != 0:
            err.seek(0)
            tail = err.read()[-2000:].decode("utf-8", "replace").strip()
            raise RuntimeError(f"{shlex.join(argv)} exited with code {rc}: {tail}")


def generate(
    source: str,
    n: int,
    *,
    sample_size: int = 100_000,
    label_size: int | None = None,
    shard_samples: int = 100,
    shards: str | None = None,
    endpoint: str | None = None,
    seed: int = 0,
    labels: bool = True,
) -> tuple[int, int]:
    """Write ``n`` image + label pairs (``labels=False``: images alone) under ``source`` and tar
    shards of them under ``shards``, with the shards' wids index (``s5loader index-shards``).

    Returns (objects written, bytes written).
    """
    shards = shards or shards_prefix(source)
    width = max(6, len(str(n - 1)))
    rng = random.Random(seed)
    n_shards = math.ceil(n / shard_samples)
    total_bytes = 0
    with tempfile.TemporaryDirectory(prefix="s5loader-bench-gen-") as tmp:
        sdir, tdir = os.path.join(tmp, "samples"), os.path.join(tmp, "shards")
        os.makedirs(sdir)
        os.makedirs(tdir)
        tar: tarfile.TarFile | None = None
        for i in range(n):
            key = f"{i:0{width}d}"
            image = rng.randbytes(sample_size)
            label = f"{i % 1000}".encode().ljust(label_size, b" ") if label_size else f"{i % 1000}".encode()
            fields = (("image", image), ("label", label)) if labels else (("image", image),)
            for name, data in fields:
                with open(os.path.join(sdir, f"{key}.{name}"), "wb") as f:
                    f.write(data)
            if i % shard_samples == 0:
                if tar is not None:
                    tar.close()
                tar = tarfile.open(os.path.join(tdir, f"shard-{i // shard_samples:06d}.tar"), "w")
            assert tar is not None
            for name, data in fields:
                info = tarfile.TarInfo(f"{key}.{name}")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tar.addfile(info, io.BytesIO(data))
            total_bytes += sum(len(data) for _, data in fields)
        if tar is not None:
            tar.close()
        per_sample = 2 if labels else 1
        progress = Progress(f"uploading to {source}", per_sample * n + n_shards)
        dest = source if source.endswith("/") else source + "/"
        upload(os.path.join(sdir, "*"), dest, endpoint, progress)
        upload(os.path.join(tdir, "*"), shards, endpoint, progress)
        progress.close()
    # the shards' wids index, as a user would build it, so no measured run builds it (replacing
    # the index of shards generated there before)
    argv = [
        sys.executable,
        "-m",
        "s5loader",
        "index-shards",
        shards,
        "--force",
        *(["--endpoint-url", endpoint] if endpoint else []),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} exited with code {proc.returncode}: {proc.stderr[-2000:]}")
    return per_sample * n + n_shards + 1, total_bytes


# -- reporting -------------------------------------------------------------------------------
def _fmt(v: float | None, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


COLUMNS = (
    "method",
    "samples/s",
    "MB/s",
    "first batch s",
    "s/100 steps (mean)",
    "s/100 steps (var, s²)",
    "waited",
    "CPU (cores)",
    "CPU s/1k samples",
    "s5cmd",
    "main",
    "workers",
    "requests/sample",
    "GET/HEAD/LIST/other per sample",
    "$/M samples",
    "new conns/request",
    "most conns open",
    "blocks/256 samples",
    "peak mem MB",
    "vs s5loader",
    "note",
)
# the CPU split columns: CPU s per 1,000 samples of each kind of process (see monitor.CpuSplit)
SPLIT_COLUMNS = ("s5cmd", "main", "workers")
# the terminal's default table: what a user reads first (every column: --wide, --markdown, --json);
# $/M samples joins them when requests were counted
COMPACT_COLUMNS = ("method", "samples/s", "MB/s", "first batch s", "vs s5loader", "CPU s/1k samples")
COMPACT_WIDTH = 100  # the notes under the compact table are wrapped to this width


def _split(f: Figures, kind: str) -> str:
    return (
        _fmt((f.cpu_split_s_per_1k_samples or {}).get(kind), ".2f") if f.cpu_split_s_per_1k_samples else "-"
    )


def _by_kind(f: Figures) -> str:
    r = f.requests_per_sample_by_kind
    if not r:
        return "-"
    return "/".join(f"{r.get(k, 0.0):.2f}" for k in ("GET", "HEAD", "LIST", "other"))


def _ratio(f: Figures) -> str:
    return "-" if f.ratio_to_s5loader is None else f"{f.ratio_to_s5loader:.2f}x"


def _notes(f: Figures) -> list[str]:
    """What the figures of an ``ok`` run need said beside them: the method's note (e.g. fewer
    workers than asked), CPU not attributed to a process, the repeats behind a median."""
    unattributed = (f.cpu_split_s_per_1k_samples or {}).get("unattributed", 0.0)
    out = [f.note] if f.note else []
    if unattributed >= 0.005:
        out.append(f"{unattributed:.2f} CPU s/1k samples not attributed to a process")
    if f.repeats_samples_per_s and len(f.repeats_samples_per_s) > 1:
        out.append(
            f"median of {len(f.repeats_samples_per_s)} repeats: "
            + "/".join(f"{v:.0f}" for v in f.repeats_samples_per_s)
            + " samples/s"
        )
    return out


def table_rows(results: list[Figures]) -> list[list[str]]:
    """The rows of the full table (:data:`COLUMNS`)."""
    rows = []
    for f in results:
        if f.status != "ok":
            rows.append([f.method] + ["-"] * (len(COLUMNS) - 2) + [f"{f.status}: {f.note}"])
            continue
        rows.append(
            [
                f.method,
                _fmt(f.samples_per_s, ".1f"),
                _fmt(f.mb_per_s, ".1f"),
                _fmt(f.first_batch_s, ".2f"),
                _fmt(f.step100_mean_s, ".3f"),
                _fmt(f.step100_var_s2, ".2g"),
                "-" if f.wait_fraction is None else f"{f.wait_fraction:.0%}",
                _fmt(f.cpu_util, ".2f"),
                _fmt(f.cpu_s_per_1k_samples, ".2f"),
                *(_split(f, k) for k in SPLIT_COLUMNS),
                _fmt(f.requests_per_sample, ".2f"),
                _by_kind(f),
                _fmt(f.dollars_per_million_samples, ".2f"),
                _fmt(f.connections_per_request, ".3f"),
                _fmt(f.peak_open_connections, "d"),
                _fmt(f.blocks_per_256, ".1f"),
                _fmt(f.peak_mem_mb, ".0f"),
                _ratio(f),
                "; ".join([f"{f.samples} samples in {f.seconds:.1f}s", *_notes(f)]),
            ]
        )
    return rows


def compact_table(results: list[Figures]) -> str:
    """The terminal's default table (:data:`COMPACT_COLUMNS`, plus the price of the requests per
    million samples when requests were counted) and under it each method's own note (a skip, a
    failure, fewer workers than asked) and whether samples/s are medians of repeats, wrapped to
    :data:`COMPACT_WIDTH`. The CPU not attributed to a process and each repeat's samples/s are in
    the full table."""
    counted = any(f.requests_per_sample is not None for f in results)
    header = list(COMPACT_COLUMNS) + (["$/M samples"] if counted else [])
    rows, notes = [header], []
    for f in results:
        if f.status != "ok":
            rows.append([f.method, f.status] + ["-"] * (len(header) - 2))
            notes.append(f"{f.method}: {f.status}: {f.note}")
            continue
        rows.append(
            [
                f.method,
                _fmt(f.samples_per_s, ".1f"),
                _fmt(f.mb_per_s, ".1f"),
                _fmt(f.first_batch_s, ".2f"),
                _ratio(f),
                _fmt(f.cpu_s_per_1k_samples, ".2f"),
            ]
            + ([_fmt(f.dollars_per_million_samples, ".2f")] if counted else [])
        )
        notes += [f"{f.method}: {f.note}"] if f.note else []
    repeats = {len(f.repeats_samples_per_s) for f in results if f.repeats_samples_per_s}
    if max(repeats, default=1) > 1:
        notes.append(f"samples/s: the median of {max(repeats)} repeats (each repeat's: --wide or --json)")
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    out = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    if notes:
        out.append("notes:")
        for n in notes:
            out += textwrap.wrap(
                n,
                COMPACT_WIDTH,
                initial_indent="  ",
                subsequent_indent="    ",
                break_long_words=False,
                break_on_hyphens=False,
            )
    out.append(
        "(every column - time per 100 steps, waiting, CPU split, memory...: --wide, --markdown, --json)"
    )
    return "\n".join(out)


def format_table(results: list[Figures], markdown: bool = False, wide: bool = False) -> str:
    """The results as a table: the compact one for the terminal (:func:`compact_table`), or
    every column (``wide``, and always for ``markdown``)."""
    if not (markdown or wide):
        return compact_table(results)
    rows = [list(COLUMNS)] + table_rows(results)
    if markdown:

        def esc(c: str) -> str:
            return c.replace("|", "\\|")

        lines = [
            "| " + " | ".join(esc(c) for c in rows[0]) + " |",
            "|"
            + "|".join("---" if i in (0, len(COLUMNS) - 1) else "---:" for i in range(len(COLUMNS)))
            + "|",
        ]
        lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows[1:]]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS) - 1)]
    out = []
    for r in rows:
        cells = [
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r[:-1], widths, strict=True))
        ]
        out.append("  ".join(cells) + "  " + r[-1])
    return "\n".join(out)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """The machine and software the figures come from."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        s5 = subprocess.run(
            [find_s5cmd(), "version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
    except Exception:  # noqa: BLE001 - informational only
        s5 = None
    return {
        "cpu_model": model or platform.processor(),
        "logical_cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": {
            "s5loader": _version("s5loader"),
            "s5cmd": s5,
            "torch": _version("torch"),
            "boto3": _version("boto3"),
            "s3torchconnector": _version("s3torchconnector"),
            "webdataset": _version("webdataset"),
        },
    }


def write_plot(path: str, results: list[Figures], title: str = "") -> None:
    """A PNG with two bar charts: samples/s and CPU seconds per 1,000 samples per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [f for f in results if f.status == "ok"]
    names = [f.method for f in ok]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = ["#d62728" if n == "s5loader" else "#4c72b0" for n in names]
    a.bar(names, [f.samples_per_s or 0 for f in ok], color=colors)
    a.set_ylabel("samples/s (higher is better)")
    b.bar(names, [f.cpu_s_per_1k_samples or 0 for f in ok], color=colors)
    b.set_ylabel("CPU seconds per 1,000 samples (lower is better)")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30)
        ax.grid(axis="y", alpha=0.3)
    skipped = [f"{f.method} ({f.status})" for f in results if f.status != "ok"]
    fig.suptitle(title + (f"\nnot run: {', '.join(skipped)}" if skipped else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main --------------------------------------------------------------------------------------
def _tmp_root() -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


def _median_run(runs: list[Figures], first_batch: bool = False) -> Figures:
    """The repeat with the median samples/s (``first_batch``: the median time to the first
    batch; the lower one of an even count); a repeat that was skipped or failed is reported
    instead, since its figures would be missing."""
    bad = next((f for f in runs if f.status != "ok"), None)
    if bad is not None:
        if len(runs) > 1 and bad.status == "failed":
            bad.note = f"in repeat {runs.index(bad) + 1} of {len(runs)}: {bad.note}"
        return bad
    ranked = sorted(
        runs, key=(lambda f: -(f.first_batch_s or 0.0)) if first_batch else (lambda f: f.samples_per_s or 0.0)
    )
    chosen = ranked[(len(ranked) - 1) // 2]
    chosen.repeats_samples_per_s = [f.samples_per_s or 0.0 for f in runs]
    return chosen


def run(settings: Settings, methods: list[str], repeat: int = 1, echo: bool = True) -> list[Figures]:
    """Run ``methods`` one after another on ``settings.source`` (the whole list ``repeat``
    times, interleaved); per method the repeat with the median samples/s; ratios filled in."""
    dataset = S5Dataset.from_prefix(settings.source, access=settings.store(settings.endpoint_url))
    if settings.count_requests:
        if not settings.endpoint_url:
            raise ConfigError("counting requests needs an http:// endpoint (--endpoint-url)")
        with ProxyProcess(settings.endpoint_url, settings.delay_ms) as proxy:
            ctx = Context(
                settings,
                dataset,
                find_s5cmd(),
                proxy.endpoint,
                _tmp_root(),
                proxy_stats=proxy.stats,
                exclude_pids=(proxy.pid,),
            )
            return _run(ctx, methods, repeat, echo)
    return _run(
        Context(settings, dataset, find_s5cmd(), settings.endpoint_url, _tmp_root()), methods, repeat, echo
    )


def _run(ctx: Context, methods: list[str], repeat: int, echo: bool) -> list[Figures]:
    runs: dict[str, list[Figures]] = {m: [] for m in methods}
    for r in range(repeat):
        for m in methods:
            if r and runs[m][-1].status == "skipped":
                continue  # a missing peer stays missing
            tag = f"{m} (repeat {r + 1}/{repeat})" if repeat > 1 else m
            if echo:
                print(f"s5loader bench: {tag} ...", file=sys.stderr, flush=True)
            f = measure(m, ctx)
            if echo:
                what = (
                    f"{f.samples_per_s:.1f} samples/s, {f.cpu_s_per_1k_samples:.2f} CPU s/1k samples"
                    + (f" ({f.note})" if f.note else "")
                    if f.status == "ok" and f.samples_per_s and f.cpu_s_per_1k_samples is not None
                    else f"{f.status}: {f.note}"
                )
                print(f"s5loader bench: {tag}: {what}", file=sys.stderr, flush=True)
            runs[m].append(f)
    results = [_median_run(runs[m], ctx.settings.first_batch) for m in methods]
    base = next((f for f in results if f.method == "s5loader" and f.status == "ok"), None)
    for f in results:
        if base is not None and f.status == "ok" and base.samples_per_s and f.samples_per_s is not None:
            f.ratio_to_s5loader = f.samples_per_s / base.samples_per_s
            if base.cpu_s_per_1k_samples and f.cpu_s_per_1k_samples is not None:
                f.cpu_per_sample_ratio_to_s5loader = f.cpu_s_per_1k_samples / base.cpu_s_per_1k_samples
    return results


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not args.source.startswith("s3://") or len(args.source) <= len("s3://"):
            parser.error(f"SOURCE must be an s3://bucket/prefix URI, got {args.source!r}")
        if args.shards_prefix and not args.shards_prefix.startswith("s3://"):
            parser.error(f"--shards-prefix must be an s3:// URI, got {args.shards_prefix!r}")
        if args.compute_ms < 0 or not math.isfinite(args.compute_ms):
            parser.error(f"--compute-ms must be 0 or more, got {args.compute_ms}")
        if args.delay_ms is not None and (args.delay_ms < 0 or not math.isfinite(args.delay_ms)):
            parser.error(f"--delay-ms must be 0 or more, got {args.delay_ms}")
        count = args.count_requests or args.delay_ms is not None
        if count and args.generate is None and not (_endpoint(args.endpoint_url) or "").startswith("http://"):
            parser.error(
                "--count-requests and --delay-ms need a plain http:// endpoint (--endpoint-url or "
                "AWS_ENDPOINT_URL...): the proxy reads each request, which TLS would hide"
            )
        methods = _methods(parser, args.methods)
        try:
            access = Access.from_args(args)
        except ConfigError as exc:
            parser.error(str(exc))
        try:
            parse_size(args.budget, "budget")
        except (ConfigError, ValueError) as exc:
            parser.error(f"--budget: {exc}")
        if args.plot and args.generate is None:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                parser.error(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}")
    except SystemExit as exc:  # argparse: 2 with a message on stderr, 0 for --help
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    endpoint = _endpoint(args.endpoint_url)
    if args.region:
        os.environ["AWS_REGION"] = args.region  # every s5cmd the methods start reads it there
    shards = args.shards_prefix or shards_prefix(args.source)
    if args.generate is not None:
        t0 = time.monotonic()
        count, nbytes = generate(
            args.source,
            args.generate,
            sample_size=args.sample_size,
            label_size=args.label_size,
            shard_samples=args.shard_samples,
            shards=shards,
            endpoint=endpoint,
            seed=args.seed,
            labels=not args.no_label,
        )
        print(
            f"wrote {args.generate} samples ({count} objects with the shards, {nbytes / 1e6:.1f} MB of "
            f"samples) under {args.source} and {shards} in {time.monotonic() - t0:.1f}s"
        )
        return EXIT_OK
    settings = Settings(
        source=args.source,
        endpoint_url=endpoint,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        steps=args.steps,
        seconds=args.seconds,
        samples_per_call=args.samples_per_call,
        calls_in_flight=args.calls_in_flight,
        budget=args.budget,
        staging_dir=args.staging_dir,
        shards_prefix=shards,
        shard_shuffle=args.shard_shuffle,
        compute_ms=args.compute_ms,
        seed=args.seed,
        region=args.region or os.environ.get("AWS_REGION") or "us-east-1",
        count_requests=count,
        delay_ms=args.delay_ms or 0.0,
        access=access,
        prices=args.prices,
        first_batch=args.first_batch,
        s5cmd_workers=args.s5cmd_workers,
    )
    started = datetime.datetime.now(datetime.timezone.utc)
    with warnings.catch_warnings():
        # DataLoader warns when num_workers exceeds the CPU count; the table says how many ran.
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")
        results = run(settings, methods, repeat=args.repeat)
    print(format_table(results, wide=args.wide))
    machine = machine_info()
    doc = {
        "version": 1,
        "started": started.isoformat(timespec="seconds"),
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            **dataclasses.asdict(settings),
            "methods": methods,
            "repeat": args.repeat,
            # --steps N: calls no larger than the N steps need (s5loader, s5cmd-run)
            "samples_per_call_used": (
                min(settings.samples_per_call, settings.steps * settings.batch_size)
                if settings.steps
                else settings.samples_per_call
            ),
        },
        "machine": machine,
        "results": [dataclasses.asdict(f) for f in results],
    }
    if args.json_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_file)), exist_ok=True)
        with open(args.json_file, "w") as fh:
            json.dump(doc, fh, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(format_table(results, markdown=True) + "\n")
    if args.plot:
        write_plot(
            args.plot,
            results,
            title=f"{settings.source} - batch {settings.batch_size}, "
            f"{settings.num_workers} workers, {machine['logical_cpus']} CPUs",
        )
    return EXIT_FAILED if any(f.status == "failed" for f in results) else EXIT_OK


__all__ = [
    "main",
    "generate",
    "run",
    "Settings",
    "Figures",
    "METHODS",
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_USAGE",
]
