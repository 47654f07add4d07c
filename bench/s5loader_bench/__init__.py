"""s5loader's benchmark, ``s5loader bench``: loading methods measured on the same S3 objects.

A package of its own beside the runtime package ``s5loader``, which never imports it: the
``s5loader bench`` command imports it only when it runs. It uses only s5loader's public API.
Its optional dependencies (psutil, matplotlib, webdataset, s3torchconnector) come with
``pip install 's5loader[bench]'``.

Modules: :mod:`.cli` (arguments, the toy data set, tables and charts), :mod:`.methods` (the
loading methods and the timing), :mod:`.monitor` (CPU of the process tree, split by process
kind), :mod:`.proxy` (a latency-injecting proxy that counts S3 requests).
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``s5loader bench``: see :func:`s5loader_bench.cli.main`."""
    from .cli import main as cli_main

    return cli_main(argv)
