#!/usr/bin/env python3
"""How well ``shuffle="block"`` mixes, against a full per-sample shuffle and key order.

For a synthetic data set of ``--samples`` samples cut into blocks of 16, 64 and 256 (the
``block_size`` option; real keys often form smaller blocks, e.g. ten for decimal numbers),
it prints, for each window size, the mean number of distinct blocks among 256 consecutive
samples of an epoch's order and the mean distance a sample moves from its key order as a
share of the data set (1/3 for a full shuffle, 0 for none). No server is involved: it studies
the ordering itself, which no public API exposes apart from a data set, so it imports the
private ``s5loader._sampling.order``.

    .venv/bin/python bench/shuffle_quality.py [--samples 100000] [--windows 256 1024 4096 8192]
"""

from __future__ import annotations

import argparse
import sys
import time

from s5loader._sampling.order import Order, shuffle_quality


def table(n: int, block_sizes: list[int], windows: list[int], span: int, seed: int) -> str:
    rows = [
        f"| block size | order | distinct blocks per {span} samples | displacement |",
        "|---:|---|---:|---:|",
    ]
    for size in block_sizes:
        units = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        unit_of = [i // size for i in range(n)]
        orders: list[tuple[str, list[int]]] = [("key order (`shuffle=False`)", list(range(n)))]
        orders += [
            (f'`"block"`, window {w}', Order("block", seed, 1, 0, False).indices(n, 0, units=units, window=w))
            for w in windows
        ]
        orders.append(("full shuffle (`shuffle=True`)", Order(True, seed, 1, 0, False).indices(n, 0)))
        for name, order in orders:
            q = shuffle_quality(order, unit_of, span)
            rows.append(f"| {size} | {name} | {q.units_per_span:.1f} | {q.displacement:.3f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/shuffle_quality.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--windows", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    p.add_argument("--span", type=int, default=256, help="run length measured, e.g. a batch (default 256)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.monotonic()
    print(table(args.samples, args.block_sizes, args.windows, args.span, args.seed))
    print(f"\n{args.samples} samples, epoch 0, one rank; {time.monotonic() - t0:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
