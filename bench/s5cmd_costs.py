#!/usr/bin/env python3
"""What s5cmd itself spends per object: CPU, peak memory and S3 requests, by command-file line
shape and by Go runtime setting.

    .venv/bin/python bench/s5cmd_costs.py [--objects 4000] [--size 100KB] [--repeat 3]
        [--grid oat|full] [--gogc 100,200,400,800,off:256MiB,off:512MiB]
        [--gomaxprocs default,1,2] [--numworkers 32,64,128,256] [--also GOGC=400,NUMWORKERS=64]

1. starts the embedded SeaweedFS (``s5loader.testing.localserver.SeaweedFS``) in a temporary folder and
   uploads ``--objects`` random objects of ``--size`` bytes under ``--source`` (default
   ``s3://costs/obj/``) with ``s5cmd cp`` of a local folder (or uses ``--endpoint-url``, where
   they already are or where ``--upload`` puts them);
2. for every setting of the grid and every line shape, runs ``s5cmd --json run FILE`` into a
   tmpfs folder and takes the CPU (user + sys) and the peak RSS of the s5cmd process from
   ``os.wait4`` (s5cmd is started by a small interpreter: Linux would otherwise report this
   process's own peak RSS as s5cmd's), and the server's CPU from ``/proc``; every run is
   checked (one success line and one file per object). The line shapes are what s5loader writes:

   - ``raw``: one ``cp --raw SOURCE DEST`` per object (``shuffle=True``);
   - ``block10``: one ``cp --exclude '*..*' 'PREFIX*' FOLDER/`` per block of 10 objects
     (``shuffle="block"``);
   - ``prefix``: one such wildcard line for the whole prefix (a bulk copy);
   - ``head`` and ``presign`` (only when asked for): one ``head`` (a HEAD request) or
     ``presign`` (a signed URL, no request) line per object, to take a ``cp --raw`` line's
     HEAD apart from the rest of its cost.

   Repeats are interleaved (the order of the runs is shuffled within each repeat), and every
   figure is the median over the repeats;
3. counts the S3 requests (GET, HEAD, LIST) each shape sends per object, once per shape with
   the default setting, through the request-counting proxy of ``s5loader_bench`` run as a child
   process (so its CPU is nobody's figure);
4. writes ``bench/results/s5cmd-costs.json`` (every run, the medians, the machine) and
   ``bench/results/s5cmd-costs.md`` (the tables).

``--grid oat`` (the default) varies one setting at a time from the base (s5cmd's defaults and
s5loader's ``--numworkers 256``), plus every ``--also`` combination; ``--grid full`` runs the
whole product of ``--gogc`` x ``--gomaxprocs`` x ``--numworkers`` (large: bound it yourself).
A GOGC value ``off:512MiB`` means ``GOGC=off GOMEMLIMIT=512MiB``; ``100:512MiB`` sets both.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHAPES = ("raw", "block10", "prefix")
# Not copies: one ``head`` (a HEAD request) or ``presign`` (a signature, no request) per object,
# to take the HEAD of a ``cp --raw`` line apart from the rest of the line's cost.
PROBES = ("head", "presign")
SOURCE = "s3://costs/obj/"
MiB = 1 << 20
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
}


# -- the pure parts: settings, command lines, aggregation ------------------------------------------
@dataclasses.dataclass(frozen=True)
class Setting:
    """One Go runtime + s5cmd setting. ``None``: left to s5cmd (the variable is not set)."""

    gogc: str | None = None
    gomemlimit: str | None = None
    gomaxprocs: int | None = None
    numworkers: int = 256

    @property
    def label(self) -> str:
        parts = [f"GOGC={self.gogc or 'default'}"]
        if self.gomemlimit:
            parts.append(f"GOMEMLIMIT={self.gomemlimit}")
        parts.append(f"GOMAXPROCS={self.gomaxprocs or 'default'}")
        parts.append(f"numworkers={self.numworkers}")
        return " ".join(parts)

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with this setting's Go variables set, and any inherited one removed."""
        env = {k: v for k, v in base.items() if k not in ("GOGC", "GOMEMLIMIT", "GOMAXPROCS")}
        if self.gogc:
            env["GOGC"] = self.gogc
        if self.gomemlimit:
            env["GOMEMLIMIT"] = self.gomemlimit
        if self.gomaxprocs:
            env["GOMAXPROCS"] = str(self.gomaxprocs)
        return env


def parse_size(text: str) -> int:
    """``"100KB"``, ``"1MiB"`` or a number of bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (try 100KB, 1MiB or a number of bytes)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def parse_gogc(item: str) -> tuple[str | None, str | None]:
    """One ``--gogc`` value: ``default``/``100``/``off``, optionally ``:GOMEMLIMIT``
    (``off:512MiB``). ``100`` is Go's default and leaves the variable unset."""
    value, _, limit = item.strip().partition(":")
    value = value.strip().lower()
    if value in ("", "default", "100"):
        gogc = None
    elif value == "off" or value.isdigit():
        gogc = value
    else:
        raise ValueError(f"GOGC must be a number, 'off' or 'default', got {item!r}")
    if limit and not re.fullmatch(r"\d+(B|KiB|MiB|GiB)?", limit.strip()):
        raise ValueError(f"GOMEMLIMIT must look like 512MiB, got {limit!r}")
    if gogc == "off" and not limit:
        raise ValueError("GOGC=off without a GOMEMLIMIT grows without bound; write off:512MiB")
    return gogc, (limit.strip() or None)


def parse_gomaxprocs(item: str) -> int | None:
    item = item.strip().lower()
    if item in ("", "default"):
        return None
    if not item.isdigit() or int(item) < 1:
        raise ValueError(f"GOMAXPROCS must be a positive number or 'default', got {item!r}")
    return int(item)


def parse_numworkers(item: str) -> int:
    if not item.strip().isdigit() or int(item) < 1:
        raise ValueError(f"--numworkers must be positive numbers, got {item!r}")
    return int(item)


def parse_setting(text: str, base: Setting) -> Setting:
    """``GOGC=400,GOMAXPROCS=1,NUMWORKERS=64,GOMEMLIMIT=512MiB`` (any subset) over ``base``."""
    fields: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep:
            raise ValueError(f"expected NAME=VALUE in {text!r}, got {part!r}")
        if key == "gogc":
            fields["gogc"], limit = parse_gogc(value)
            if limit:
                fields["gomemlimit"] = limit
        elif key == "gomemlimit":
            fields["gomemlimit"] = parse_gogc(f"100:{value}")[1]
        elif key == "gomaxprocs":
            fields["gomaxprocs"] = parse_gomaxprocs(value)
        elif key == "numworkers":
            fields["numworkers"] = parse_numworkers(value)
        else:
            raise ValueError(
                f"unknown setting {key!r} in {text!r} (GOGC, GOMEMLIMIT, GOMAXPROCS, NUMWORKERS)"
            )
    return dataclasses.replace(base, **fields)


def grid(
    kind: str,
    gogc: Sequence[tuple[str | None, str | None]],
    gomaxprocs: Sequence[int | None],
    numworkers: Sequence[int],
    base: Setting,
    also: Sequence[Setting] = (),
) -> list[Setting]:
    """The settings to run, ``base`` first, without duplicates. ``oat``: one variable at a time
    from ``base``; ``full``: the whole product."""
    if kind == "full":
        found = [Setting(g, m, p, n) for (g, m), p, n in itertools.product(gogc, gomaxprocs, numworkers)]
    elif kind == "oat":
        found = [dataclasses.replace(base, gogc=g, gomemlimit=m) for g, m in gogc]
        found += [dataclasses.replace(base, gomaxprocs=p) for p in gomaxprocs]
        found += [dataclasses.replace(base, numworkers=n) for n in numworkers]
    else:
        raise ValueError(f"--grid must be 'oat' or 'full', got {kind!r}")
    out: list[Setting] = []
    for s in [base, *found, *also]:
        if s not in out:
            out.append(s)
    return out


def split_source(source: str) -> tuple[str, str]:
    """``s3://bucket/prefix/`` as (bucket, prefix)."""
    m = re.fullmatch(r"s3://([^/*?\[]+)/([^*?\[]*)", source)
    if not m or (m.group(2) and not m.group(2).endswith("/")):
        raise ValueError(f"the source must look like s3://bucket/prefix/ (no wildcards), got {source!r}")
    return m.group(1), m.group(2)


def object_keys(n: int, prefix: str) -> list[str]:
    """The keys of the data set: ``PREFIX000000.bin`` ... (10 per block ``PREFIX00000*``)."""
    return [f"{prefix}{i:06d}.bin" for i in range(n)]


def command_lines(shape: str, bucket: str, prefix: str, keys: Sequence[str], dest: str) -> list[str]:
    """The ``s5cmd run`` lines of one shape, copying every key of ``bucket`` (all under
    ``prefix``) into ``dest``, written as s5loader writes them (``s5loader._s5cmd.copy_line``
    and ``wildcard_line``)."""
    src = f"s3://{bucket}/"
    if shape == "raw":
        return [f"cp --raw {shlex.quote(src + k)} {shlex.quote(os.path.join(dest, k))}\n" for k in keys]
    if shape == "block10":
        blocks = sorted({k[:-5] for k in keys})  # PREFIX00012 of PREFIX000123.bin: 10 keys each
        return [
            f"cp --exclude '*..*' {shlex.quote(src + b + '*')} {shlex.quote(os.path.join(dest, b) + '/')}\n"
            for b in blocks
        ]
    if shape == "prefix":
        return [
            f"cp --exclude '*..*' {shlex.quote(src + prefix + '*')} "
            f"{shlex.quote(os.path.join(dest, prefix))}\n"
        ]
    if shape in PROBES:
        return [f"{shape} {shlex.quote(src + k)}\n" for k in keys]
    raise ValueError(f"unknown line shape {shape!r}; one of {', '.join(SHAPES + PROBES)}")


def count_successes(output: Iterable[str], shape: str = "raw") -> tuple[int, list[str]]:
    """The objects ``s5cmd --json`` reports as done (copied; for the probes, an object's
    ``head`` record or a presigned URL), and its error lines (at most 5)."""
    ok, errors = 0, list[str]()
    for line in output:
        if shape == "presign" and line.startswith("http"):
            ok += 1
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if line.strip() and len(errors) < 5:
                errors.append(line.strip())
            continue
        if isinstance(rec, dict) and (rec.get("success") is True or (shape == "head" and "size" in rec)):
            ok += 1
        elif len(errors) < 5:
            errors.append(line.strip())
    return ok, errors


def aggregate(runs: Sequence[dict[str, Any]], objects: int) -> list[dict[str, Any]]:
    """Medians per (setting, shape) over the repeats, in first-seen order, with the change of
    s5cmd's CPU against the base setting (the first one) of the same shape."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["setting"], r["shape"]), []).append(r)
    rows = []
    for (setting, shape), rs in groups.items():
        cpu = statistics.median(r["user_s"] + r["sys_s"] for r in rs)
        rows.append(
            {
                "setting": setting,
                "shape": shape,
                "repeats": len(rs),
                "cpu_s": cpu,
                "cpu_ms_per_object": 1000 * cpu / objects,
                "cpu_ms_per_object_min": 1000 * min(r["user_s"] + r["sys_s"] for r in rs) / objects,
                "cpu_ms_per_object_max": 1000 * max(r["user_s"] + r["sys_s"] for r in rs) / objects,
                "user_s": statistics.median(r["user_s"] for r in rs),
                "sys_s": statistics.median(r["sys_s"] for r in rs),
                "maxrss_mib": statistics.median(r["maxrss_kib"] for r in rs) / 1024,
                "maxrss_mib_max": max(r["maxrss_kib"] for r in rs) / 1024,
                "wall_s": statistics.median(r["wall_s"] for r in rs),
                "server_cpu_ms_per_object": 1000 * statistics.median(r["server_cpu_s"] for r in rs) / objects,
            }
        )
    base = rows[0]["setting"] if rows else ""
    base_cpu = {r["shape"]: r["cpu_s"] for r in rows if r["setting"] == base}
    for r in rows:
        ref = base_cpu.get(r["shape"])
        r["cpu_vs_base"] = (r["cpu_s"] / ref - 1) if ref else None
    return rows


def markdown(doc: dict[str, Any]) -> str:
    """The tables of a result document."""
    s = doc["settings"]
    out = [
        "## s5cmd's own costs per object",
        "",
        f"{s['objects']} objects of {s['size']} bytes in a local SeaweedFS, copied by `s5cmd --json run "
        f"FILE` into tmpfs; {doc['machine']['cpus']} CPUs, s5cmd {doc['s5cmd_version']}. CPU: user + sys of "
        f"the s5cmd process (`wait4`), median of {s['repeat']} interleaved repeats (min-max in brackets); "
        "RSS: peak resident memory of s5cmd (median, max); server: the SeaweedFS process's CPU during the "
        f"run. Made by `bench/s5cmd_costs.py` in {doc['elapsed_s']:.0f} s.",
        "",
    ]
    if doc.get("requests"):
        out += [
            "### S3 requests per object (default setting)",
            "",
            "| line shape | lines | GET | HEAD | LIST | other | total |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for shape, c in doc["requests"].items():
            per = {k: c.get(k, 0) / s["objects"] for k in ("GET", "HEAD", "LIST", "other")}
            out.append(
                f"| {shape} | {c['lines']} | {per['GET']:.3f} | {per['HEAD']:.3f} | {per['LIST']:.4f} | "
                f"{per['other']:.3f} | {sum(per.values()):.3f} |"
            )
        out.append("")
    out += [
        "### CPU and memory by setting",
        "",
        "| setting | shape | s5cmd CPU ms/object | vs base | user s | sys s | peak RSS MiB (max) | "
        "server CPU ms/object | wall s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in s["shapes"]:
        for r in doc["summary"]:
            if r["shape"] != shape:
                continue
            vs = (
                "base"
                if r["cpu_vs_base"] is None or r["setting"] == doc["summary"][0]["setting"]
                else f"{100 * r['cpu_vs_base']:+.0f}%"
            )
            out.append(
                f"| {r['setting']} | {shape} | {r['cpu_ms_per_object']:.3f} "
                f"({r['cpu_ms_per_object_min']:.3f}-{r['cpu_ms_per_object_max']:.3f}) | {vs} | "
                f"{r['user_s']:.2f} | {r['sys_s']:.2f} | {r['maxrss_mib']:.0f} ({r['maxrss_mib_max']:.0f}) | "
                f"{r['server_cpu_ms_per_object']:.3f} | {r['wall_s']:.2f} |"
            )
    return "\n".join(out) + "\n"


# -- the measuring parts ----------------------------------------------------------------------------
def _s5cmd() -> str:
    sys.path.insert(0, ROOT)
    from s5loader import find_s5cmd

    return find_s5cmd()


def _proc_cpu(pid: int) -> float:
    """user + sys seconds of a live process (all its threads) and its waited-for children."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


# Runs s5cmd from a small interpreter and writes its rusage (``wait4``) to argv[1]. Linux keeps
# the peak RSS of the process that forked across exec: s5cmd started straight from this (large)
# Python would report this process's RSS as its own peak. From here the floor is this small
# interpreter's (about 10 MiB), far below s5cmd's.
_SPAWN = """
import json, os, sys
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
_, status, u = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump({"user_s": u.ru_utime, "sys_s": u.ru_stime, "maxrss_kib": u.ru_maxrss}, f)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _base_env(endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID="local", AWS_SECRET_ACCESS_KEY="local", AWS_REGION="us-east-1")
    return env


def run_once(
    s5cmd: str,
    endpoint: str,
    setting: Setting,
    shape: str,
    source: str,
    keys: Sequence[str],
    work: str,
    server_pid: int | None,
) -> dict[str, Any]:
    """One measured ``s5cmd run``; raises if any object was not copied."""
    dest = tempfile.mkdtemp(prefix=f"{shape}-", dir=work)
    cmd_file = os.path.join(work, f"{shape}.txt")
    with open(cmd_file, "w") as f:
        f.writelines(command_lines(shape, *split_source(source), keys, dest))
    out_path, err_path = cmd_file + ".out", cmd_file + ".err"
    argv = [
        s5cmd,
        "--json",
        "--retry-count",
        "3",
        "--endpoint-url",
        endpoint,
        "--numworkers",
        str(setting.numworkers),
        "run",
        cmd_file,
    ]
    server0 = _proc_cpu(server_pid) if server_pid else 0.0
    t0 = time.monotonic()
    usage_path = cmd_file + ".usage"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _SPAWN, usage_path, *argv],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=setting.env(_base_env(endpoint)),
            check=False,
        )
    wall = time.monotonic() - t0
    with open(usage_path) as f:
        usage = json.load(f)
    server = (_proc_cpu(server_pid) - server0) if server_pid else 0.0
    with open(out_path, errors="replace") as f:
        ok, errors = count_successes(f, shape)
    files = sum(len(names) for _, _, names in os.walk(dest))
    shutil.rmtree(dest)
    if proc.returncode != 0 or ok != len(keys) or files != (0 if shape in PROBES else len(keys)):
        with open(err_path, errors="replace") as f:
            tail = f.read()[-2000:]
        raise RuntimeError(
            f"{shlex.join(argv)} ({setting.label}): exit code {proc.returncode}, {ok} copies "
            f"reported and {files} files for {len(keys)} objects; {errors} {tail}"
        )
    return {
        "setting": setting.label,
        "shape": shape,
        "user_s": usage["user_s"],
        "sys_s": usage["sys_s"],
        "maxrss_kib": usage["maxrss_kib"],
        "wall_s": wall,
        "server_cpu_s": server,
    }


def count_requests(
    s5cmd: str, endpoint: str, source: str, keys: Sequence[str], work: str, shapes: Sequence[str]
) -> dict[str, dict[str, int]]:
    """The S3 requests of one run per shape (default setting) through the counting proxy."""
    sys.path.insert(0, HERE)
    from s5loader_bench.proxy import ProxyProcess

    out: dict[str, dict[str, int]] = {}
    with ProxyProcess(endpoint.split("://", 1)[-1], delay_ms=0) as proxy:
        for shape in shapes:
            before = proxy.counts()
            run_once(s5cmd, proxy.endpoint, Setting(), shape, source, keys, work, None)
            after = proxy.counts()
            out[shape] = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
            out[shape]["lines"] = len(command_lines(shape, *split_source(source), keys, "/d"))
    return out


def upload(s5cmd: str, endpoint: str, source: str, keys: Sequence[str], size: int, work: str) -> None:
    """Write ``keys`` (random bytes, ``size`` each) into the source's bucket with ``s5cmd cp``."""
    bucket, _ = split_source(source)
    src = tempfile.mkdtemp(prefix="upload-", dir=work)
    for key in keys:
        path = os.path.join(src, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(os.urandom(size))
    argv = [s5cmd, "--endpoint-url", endpoint, "--numworkers", "64", "cp", src + "/", f"s3://{bucket}/"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=_base_env(endpoint), check=False)
    shutil.rmtree(src)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} exited with code {proc.returncode}: {proc.stderr[-2000:]}")


def _parser() -> argparse.ArgumentParser:
    """The arguments of ``s5cmd_costs.py``."""
    p = argparse.ArgumentParser(prog="s5cmd_costs.py", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--objects", type=int, default=4000, help="objects in the data set (default 4000)")
    p.add_argument(
        "--size", type=parse_size, default=parse_size("100KB"), help="bytes per object (default 100KB)"
    )
    p.add_argument(
        "--repeat", type=int, default=3, help="repeats of every run; figures are medians (default 3)"
    )
    p.add_argument(
        "--shapes",
        default=",".join(SHAPES),
        help=(
            f"line shapes (default {','.join(SHAPES)}; also {' and '.join(PROBES)}: one such command per "
            "object)"
        ),
    )
    p.add_argument(
        "--grid",
        default="oat",
        choices=("oat", "full"),
        help="oat: one variable at a time from the base (default); full: the whole product",
    )
    p.add_argument(
        "--gogc",
        default="100,200,400,800,off:256MiB,off:512MiB",
        help="GOGC values, each optionally :GOMEMLIMIT (default 100,200,400,800,off:256MiB,off:512MiB)",
    )
    p.add_argument("--gomaxprocs", default="default,1,2", help="GOMAXPROCS values (default default,1,2)")
    p.add_argument(
        "--numworkers", default="32,64,128,256", help="s5cmd --numworkers values (default 32,64,128,256)"
    )
    p.add_argument(
        "--base", default="numworkers=256", help="the base setting (default numworkers=256, as s5loader)"
    )
    p.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="SETTING",
        help="one more setting to run, e.g. GOGC=400,GOMAXPROCS=1,NUMWORKERS=64 (repeatable)",
    )
    p.add_argument("--no-requests", action="store_true", help="do not count requests through the proxy")
    p.add_argument(
        "--source", default=SOURCE, help=f"where the objects are, s3://bucket/prefix/ (default {SOURCE})"
    )
    p.add_argument(
        "--endpoint-url", help="use this server (its bucket must exist) instead of a SeaweedFS of its own"
    )
    p.add_argument(
        "--upload",
        action="store_true",
        help="with --endpoint-url: upload the objects first (a server of its own is always filled)",
    )
    p.add_argument(
        "--work-dir",
        default="/dev/shm" if os.path.isdir("/dev/shm") else None,
        help="where the copies land (default /dev/shm)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the run order")
    p.add_argument("--json", default=os.path.join(HERE, "results", "s5cmd-costs.json"))
    p.add_argument("--markdown", default=os.path.join(HERE, "results", "s5cmd-costs.md"))
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    try:
        if args.objects < 10 or args.repeat < 1:
            raise ValueError("--objects must be 10 or more and --repeat 1 or more")
        shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
        bucket, prefix = split_source(args.source)
        for shape in shapes:
            command_lines(shape, bucket, prefix, [], "/d")
        base = parse_setting(args.base, Setting())
        settings = grid(
            args.grid,
            [parse_gogc(x) for x in args.gogc.split(",")],
            [parse_gomaxprocs(x) for x in args.gomaxprocs.split(",")],
            [parse_numworkers(x) for x in args.numworkers.split(",")],
            base,
            [parse_setting(a, base) for a in args.also],
        )
    except ValueError as exc:
        p.error(str(exc))
    s5cmd = _s5cmd()
    keys = object_keys(args.objects, prefix)
    t0 = time.monotonic()
    work = tempfile.mkdtemp(prefix="s5cmd-costs-", dir=args.work_dir)
    server: Any = None
    try:
        if args.endpoint_url:
            endpoint, server_pid = args.endpoint_url, None
        else:
            from s5loader.testing import SeaweedFS

            server = SeaweedFS(tempfile.mkdtemp(prefix="s5cmd-costs-weed-"), buckets=(bucket,)).start()
            endpoint, server_pid = server.endpoint, server.proc.pid
        if server is not None or args.upload:
            print(f"{endpoint}: uploading {args.objects} x {args.size} B", file=sys.stderr)
            upload(s5cmd, endpoint, args.source, keys, args.size, work)
        requests = (
            {} if args.no_requests else count_requests(s5cmd, endpoint, args.source, keys, work, shapes)
        )
        for shape, c in requests.items():
            print(f"requests {shape}: {c}", file=sys.stderr)
        rng = random.Random(args.seed)
        runs = []
        plan = [(s, shape) for s in settings for shape in shapes]
        for rep in range(args.repeat):
            order = plan[:]
            rng.shuffle(order)
            for i, (setting, shape) in enumerate(order):
                r = run_once(s5cmd, endpoint, setting, shape, args.source, keys, work, server_pid)
                r["repeat"] = rep
                runs.append(r)
                print(
                    f"[{rep + 1}/{args.repeat} {i + 1}/{len(order)}] {setting.label} {shape}: "
                    f"cpu {r['user_s'] + r['sys_s']:.2f}s rss {r['maxrss_kib'] / 1024:.0f}MiB "
                    f"wall {r['wall_s']:.2f}s",
                    file=sys.stderr,
                )
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(server.data_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    # the summary keeps the grid's order (base first), whatever order the runs had
    runs.sort(key=lambda r: ([s.label for s in settings].index(r["setting"]), shapes.index(r["shape"])))
    version = subprocess.run([s5cmd, "version"], capture_output=True, text=True, check=False).stdout.strip()
    doc = {
        "settings": {
            "source": args.source,
            "objects": args.objects,
            "size": args.size,
            "repeat": args.repeat,
            "shapes": shapes,
            "grid": args.grid,
            "base": base.label,
            "settings": [s.label for s in settings],
            "seed": args.seed,
        },
        "machine": {
            "cpus": len(os.sched_getaffinity(0)),
            "platform": platform.platform(),
            "load_avg_end": os.getloadavg(),
            "python": platform.python_version(),
        },
        "s5cmd_version": version,
        "elapsed_s": time.monotonic() - t0,
        "requests": requests,
        "summary": aggregate(runs, args.objects),
        "runs": runs,
    }
    for path in (args.json, args.markdown):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    with open(args.markdown, "w") as f:
        f.write(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
