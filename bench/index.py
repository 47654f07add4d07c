#!/usr/bin/env python3
"""The sample index at scale: build time, memory, pickled size, sampler creation, forked
workers, and ``from_prefix`` over real objects in the embedded SeaweedFS.

    .venv/bin/python bench/index.py manifest --objects 1000000
    .venv/bin/python bench/index.py prefix --objects 100000
    .venv/bin/python bench/index.py manifest --objects 1000000 --json out.json
    .venv/bin/python bench/index.py manifest --labels --before ../old-tree
    .venv/bin/python bench/index.py manifest --labels --group-by stem --repeat 3 --before ../old-tree
    .venv/bin/python bench/index.py manifest --labels text --repeat 3 --before ../old-tree

``manifest``: writes a synthetic JSON Lines manifest (ImageNet-like keys
``train/nXXXXXXXX/nXXXXXXXX_N.JPEG`` with sizes and MD5 ETags, so nothing is fetched), then,
in a fresh Python process, builds ``S5Dataset.from_manifest`` and measures the resident memory
it added, the pickled size (what each worker receives under ``spawn``), an ``S5Sampler``'s
creation, and the private memory each of 4 forked DataLoader workers adds while it reads every
sample of the index (``dataset.samples[i]``, what ``dataset[i]`` does first). ``--repeat N``
builds the index N times in fresh processes (the trees taking turns with ``--before``) and
reports the least CPU time (``build_cpu_s``) and every run's (``build_cpu_runs``).

``prefix``: uploads small objects into a local SeaweedFS with ``s5cmd cp``, then times
``s5cmd ls --json`` alone, the parsing of its output alone, and ``from_prefix`` (with its
resident memory added).

Only the public API is used for the measured steps; the numbers are printed as JSON.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 1 << 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def private_bytes() -> int:
    """Private (copied or written) memory of this process: what a forked child adds."""
    total = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1]) * 1024
    return total


def write_manifest(path: str, n: int, labels: str | None = None) -> None:
    """``labels``: ``int`` (a class number) or ``text`` (a class name beyond ASCII, escaped as
    ``json.dumps`` writes it) on every line, or none."""
    classes = 1000
    with open(path, "w") as f:
        for i in range(n):
            c = f"n{10000000 + i % classes:08d}"
            etag = hashlib.md5(i.to_bytes(8, "little")).hexdigest()
            size = 50_000 + (i * 7919) % 150_000
            label = {
                None: "",
                "int": f', "label": {i % classes}',
                "text": f', "label": {json.dumps(f"类别{i % classes}")}',
            }[labels]
            uri = f"s3://bench/train/{c}/{c}_{i // classes}.JPEG"
            f.write(f'{{"uri": "{uri}", "size": {size}, "etag": "{etag}"{label}}}\n')


# -- the measured process (a fresh interpreter, so RSS is its own) ---------------------------------
_BASE: dict[str, int] = {}


def _worker_init(_: int) -> None:
    _BASE["private"] = private_bytes()


class _Touch:
    """Reads every sample of the index the way a worker's ``dataset[i]`` starts."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> int:
        return self.ds.samples[i].size


def _collate(batch: list[int]) -> tuple[int, int]:
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return (info.id if info else -1, private_bytes() - _BASE.get("private", 0))


def measure_manifest(
    path: str, staging: str, group_by: str = "object", build_only: str = ""
) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    from s5loader import S5Dataset, S5Sampler

    torch.set_num_threads(1)
    gc.collect()
    before = rss()
    t0, c0 = time.perf_counter(), time.process_time()
    ds = S5Dataset.from_manifest(path, group_by=group_by)
    build_s, build_cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    gc.collect()
    added = rss() - before
    if build_only:
        return {"samples": len(ds), "build_s": round(build_s, 2), "build_cpu_s": round(build_cpu, 2)}
    t0 = time.perf_counter()
    blob = pickle.dumps(ds)
    pickle_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    pickle.loads(blob)
    unpickle_s = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    sampler = S5Sampler(ds, budget="4GiB", staging_dir=staging, shrink_budget=True)
    sampler_s, sampler_cpu = time.perf_counter() - t0, time.process_time() - c0
    sampler.close()
    del sampler
    loader = DataLoader(
        _Touch(ds),
        batch_size=10_000,
        num_workers=4,
        collate_fn=_collate,
        worker_init_fn=_worker_init,
        multiprocessing_context="fork",
    )
    per_worker: dict[int, int] = {}
    t0 = time.perf_counter()
    for wid, grown in loader:
        per_worker[wid] = max(per_worker.get(wid, 0), grown)
    workers_s = time.perf_counter() - t0
    return {
        "samples": len(ds),
        "build_s": round(build_s, 2),
        "build_cpu_s": round(build_cpu, 2),
        "rss_added_mb": round(added / MiB, 1),
        "peak_rss_added_mb": round(peak / MiB, 1),
        "bytes_per_object": round(added / len(ds), 1),
        "pickled_mb": round(len(blob) / MiB, 1),
        "pickle_s": round(pickle_s, 2),
        "unpickle_s": round(unpickle_s, 2),
        "sampler_s": round(sampler_s, 2),
        "sampler_cpu_s": round(sampler_cpu, 2),
        "worker_added_mb": [round(per_worker[w] / MiB, 1) for w in sorted(per_worker)],
        "workers_iterate_s": round(workers_s, 1),
    }


def measure_prefix(uri: str, endpoint: str) -> dict[str, Any]:
    from s5loader import S5Dataset, find_s5cmd

    # from_prefix first, in the fresh process, so that the memory it adds is its own
    gc.collect()
    before = rss()
    t0, c0 = time.perf_counter(), time.process_time()
    ds = S5Dataset.from_prefix(uri, endpoint_url=endpoint, group_by="object")
    prefix_s, prefix_cpu = time.perf_counter() - t0, time.process_time() - c0
    gc.collect()
    added = rss() - before
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    env = {**os.environ, "AWS_REGION": "us-east-1"}
    argv = [find_s5cmd(), "--json", "--endpoint-url", endpoint, "ls", uri + "*"]
    t0 = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, env=env, check=True).stdout
    ls_s = time.perf_counter() - t0
    lines = out.splitlines()
    t0 = time.perf_counter()
    for line in lines:
        json.loads(line)
    parse_s = time.perf_counter() - t0
    del out, lines
    # the same objects listed as 8 parallel runs of s5cmd ls over the top-level folders
    tops = [
        rec["key"]
        for x in subprocess.run(
            argv[:-1] + [uri], capture_output=True, env=env, check=True
        ).stdout.splitlines()
        if (rec := json.loads(x)).get("type") == "directory"
    ]
    t0 = time.perf_counter()
    procs: list[subprocess.Popen[bytes]] = []
    for top in tops:
        if len(procs) >= 8:
            procs.pop(0).wait()
        procs.append(subprocess.Popen(argv[:-1] + [top + "*"], stdout=subprocess.DEVNULL, env=env))
    for proc in procs:
        proc.wait()
    parallel_s = time.perf_counter() - t0 if tops else None
    return {
        "objects": len(ds),
        "s5cmd_ls_s": round(ls_s, 2),
        "json_parse_s": round(parse_s, 2),
        "s5cmd_ls_8_parallel_s": round(parallel_s, 2) if parallel_s is not None else None,
        "top_folders": len(tops),
        "from_prefix_s": round(prefix_s, 2),
        "from_prefix_python_cpu_s": round(prefix_cpu, 2),
        "rss_added_mb": round(added / MiB, 1),
        "bytes_per_object": round(added / len(ds), 1),
        "peak_rss_added_mb": round(peak / MiB, 1),
    }


def upload(endpoint: str, bucket: str, n: int, work: str) -> str:
    from s5loader import find_s5cmd

    src = os.path.join(work, "src")
    for d in range(n // 1000 + 1):
        os.makedirs(os.path.join(src, f"d{d:04d}"), exist_ok=True)
    for i in range(n):
        with open(os.path.join(src, f"d{i // 1000:04d}", f"{i:08d}.bin"), "wb") as f:
            f.write(i.to_bytes(8, "little"))
    env = {
        **os.environ,
        "AWS_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", "any"),
        "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", "any"),
    }
    subprocess.run(
        [
            find_s5cmd(),
            "--endpoint-url",
            endpoint,
            "--numworkers",
            "64",
            "cp",
            src + "/",
            f"s3://{bucket}/many/",
        ],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    shutil.rmtree(src)
    return f"s3://{bucket}/many/"


def repeat_manifest(args: argparse.Namespace, path: str, staging: str) -> dict[str, Any]:
    """The manifest measured in fresh processes, ``args.repeat`` times per tree (this one and
    ``args.before``, taking turns); after the first, only the build."""
    trees = [None, args.before] if args.before else [None]
    runs: dict[str | None, list[dict[str, Any]]] = {t: [] for t in trees}
    for r in range(max(1, args.repeat)):
        for tree in trees:
            child = ["manifest", path, staging, args.group_by, "1" if r else ""]
            env = {**os.environ, "PYTHONPATH": tree} if tree else None
            runs[tree].append(
                json.loads(
                    subprocess.run(
                        [sys.executable, __file__, "manifest", "--_child", *child],
                        check=True,
                        capture_output=True,
                        text=True,
                        env=env,
                        cwd=tree,
                    ).stdout
                )
            )
    out = []
    for tree in trees:
        res, best = runs[tree][0], min(runs[tree], key=lambda x: x["build_cpu_s"])
        res.update(
            build_s=best["build_s"],
            build_cpu_s=best["build_cpu_s"],
            build_cpu_runs=[x["build_cpu_s"] for x in runs[tree]],
        )
        out.append(res)
    result = {**out[0], "labels": args.labels, "group_by": args.group_by}
    if args.before:
        result["before"] = out[1]
    return result


def _parser() -> argparse.ArgumentParser:
    """The arguments of ``index.py``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["manifest", "prefix"])
    p.add_argument("--objects", type=int, default=1_000_000)
    p.add_argument("--json", help="also write the result here")
    p.add_argument(
        "--labels",
        nargs="?",
        const="int",
        choices=["int", "text"],
        help=(
            "manifest: a label on every line, as most manifests carry: a number (int) or a name beyond "
            "ASCII (text)"
        ),
    )
    p.add_argument(
        "--before", metavar="TREE", help="also measure the s5loader source tree TREE on the same data"
    )
    p.add_argument(
        "--group-by", default="object", choices=["object", "stem", "folder"], help="manifest: the grouping"
    )
    p.add_argument(
        "--repeat", type=int, default=1, help="manifest: build the index this many times (least CPU kept)"
    )
    p.add_argument("--_child", nargs="+", help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = _parser().parse_args()
    if args._child:  # the measured process
        kind, *rest = args._child
        out = measure_manifest(*rest) if kind == "manifest" else measure_prefix(*rest)
        print(json.dumps(out))
        return
    work = tempfile.mkdtemp(prefix="s5loader-bench-index-")
    try:
        if args.what == "manifest":
            path = os.path.join(work, "manifest.jsonl")
            t0 = time.perf_counter()
            write_manifest(path, args.objects, args.labels)
            print(f"wrote {args.objects} lines in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
            os.makedirs(os.path.join(work, "staging"))
            result = repeat_manifest(args, path, os.path.join(work, "staging"))
        else:
            from s5loader.testing import SeaweedFS

            os.environ.setdefault("AWS_ACCESS_KEY_ID", "any")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "any")
            with SeaweedFS(os.path.join(work, "weed"), buckets=("bench",)) as s3:
                t0 = time.perf_counter()
                uri = upload(s3.endpoint, "bench", args.objects, work)
                print(f"uploaded {args.objects} objects in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
                child = ["prefix", uri, s3.endpoint]
                result = json.loads(
                    subprocess.run(
                        [sys.executable, __file__, "prefix", "--_child", *child],
                        check=True,
                        capture_output=True,
                        text=True,
                    ).stdout
                )
                if args.before:
                    env = {**os.environ, "PYTHONPATH": args.before}
                    result["before"] = json.loads(
                        subprocess.run(
                            [sys.executable, __file__, "prefix", "--_child", *child],
                            check=True,
                            capture_output=True,
                            text=True,
                            env=env,
                            cwd=args.before,
                        ).stdout
                    )
        result["what"] = args.what
        result["load_average"] = os.getloadavg()[0]
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
