"""``s5loader bench`` tables without a server: the compact and wide tables, the markdown,
prices, dollars and connections per request, and the table the README quotes."""

from __future__ import annotations

import os

import pytest

from s5loader_bench import cli as bench
from s5loader_bench import methods as bench_methods
from s5loader_bench.methods import METHODS, Figures


def _realistic_results(counted: bool = False) -> list[Figures]:
    """Figures like a real run's (the README's loopback figures), every method, one skipped."""
    rates = {
        "s5loader": 396.0,
        "s5loader-block": 591.0,
        "s5loader-sorted": 601.0,
        "boto3": 239.0,
        "s5cmd-run": 343.0,
        "s5cmd-bulk": 590.0,
        "webdataset": 1302.4,
        "s5loader-shards": 1881.2,
        "s5loader-iterable": 1453.0,
    }
    cpu = {
        "s5loader": 2.68,
        "s5loader-block": 1.98,
        "s5loader-sorted": 1.95,
        "boto3": 4.18,
        "s5cmd-run": 2.44,
        "s5cmd-bulk": 1.07,
        "webdataset": 0.83,
        "s5loader-shards": 0.64,
        "s5loader-iterable": 0.67,
    }
    out = []
    for m in METHODS:
        if m not in rates:
            out.append(
                Figures(
                    m,
                    status="skipped",
                    note=f"{m} is not installed (No module named '{m}'); pip install 's5loader[bench]'",
                )
            )
            continue
        f = Figures(
            m,
            samples=2000,
            bytes=200_002_000,
            steps=500,
            seconds=2000 / rates[m],
            samples_per_s=rates[m],
            mb_per_s=rates[m] * 0.100001,
            step100_mean_s=400 / rates[m],
            step100_var_s2=0.0123,
            step100_s=[400 / rates[m]] * 5,
            wait_fraction=0.87,
            cpu_s=cpu[m] * 2,
            cpu_util=1.43,
            cpu_s_per_1k_samples=cpu[m],
            cpu_split_s_per_1k_samples={
                "s5cmd": cpu[m] / 2,
                "main": cpu[m] / 4,
                "workers": cpu[m] / 4,
                "unattributed": 0.01,
            },
            peak_mem_mb=1234.5,
            ratio_to_s5loader=rates[m] / rates["s5loader"],
            first_batch_s=0.25,
            repeats_samples_per_s=[rates[m] * 0.9, rates[m], rates[m] * 1.1],
        )
        f.num_workers = None if m.startswith("s5cmd") else 4
        if counted:
            f.requests = {"GET": 4000, "HEAD": 0, "LIST": 2000, "other": 0}
            bench_methods.fill_request_rates(f)
        if m == "webdataset":
            f.note, f.num_workers = "2 shards, ran with 2 workers instead of 4", 2
        out.append(f)
    return out


@pytest.mark.parametrize("counted", [False, True])
def test_default_table_is_compact(counted: bool) -> None:
    results = _realistic_results(counted)
    table = bench.format_table(results)  # what main prints without --wide
    lines = table.splitlines()
    assert max(len(ln) for ln in lines) <= 100, "\n" + table
    header = lines[0].split("  ")
    expected = list(bench.COMPACT_COLUMNS) + (["$/M samples"] if counted else [])
    assert [c.strip() for c in header if c.strip()] == expected
    by_method = {ln.split()[0]: ln for ln in lines[1 : 1 + len(METHODS)]}
    assert list(by_method) == list(METHODS)
    assert by_method["s5loader"].split()[1:6] == ["396.0", "39.6", "0.25", "1.00x", "2.68"]
    assert by_method["s3torchconnector"].split()[1] == "skipped"
    # what the compact columns leave out is said under the table: notes, skips, medians
    assert "webdataset: 2 shards, ran with 2 workers instead of 4" in table
    assert "s3torchconnector: skipped: s3torchconnector is not installed" in table
    assert "samples/s: the median of 3 repeats" in table
    assert len(lines) <= len(METHODS) + 8, "\n" + table  # a note per method at most, not per figure
    if counted:  # 2 GETs and a LIST per sample at S3 list prices: 2 x $0.0004 + $0.005 per 1,000
        assert by_method["s5loader"].split()[6] == "5.80"
    for wide_only in (
        "s/100 steps (mean)",
        "GET/HEAD/LIST/other per sample",
        "peak mem MB",
        "waited",
        "new conns/request",
        "requests/sample",
    ):
        assert wide_only not in table
    assert "--wide" in lines[-1]


def test_wide_table_and_markdown_have_every_column() -> None:
    results = _realistic_results(counted=True)
    wide = bench.format_table(results, wide=True)
    header = wide.splitlines()[0]
    assert all(c in header for c in bench.COLUMNS) and header.rstrip().endswith("note")
    assert max(len(ln) for ln in wide.splitlines()) > 200  # the full table: why it is not the default
    assert "2 shards, ran with 2 workers instead of 4" in wide and "median of 3 repeats" in wide
    md = bench.format_table(results, markdown=True)
    assert md.splitlines()[0] == "| " + " | ".join(bench.COLUMNS) + " |"
    assert bench.build_parser().parse_args(["s3://b/p/", "--wide"]).wide
    assert not bench.build_parser().parse_args(["s3://b/p/"]).wide


def test_prices_are_s3_list_prices_unless_given() -> None:
    parse = bench.build_parser().parse_args
    assert parse(["s3://b/p/"]).prices == {"GET": 0.0004, "HEAD": 0.0004, "LIST": 0.005, "other": 0.005}
    assert parse(["s3://b/p/", "--prices", "list=0.0054,GET=0.00043"]).prices == {
        "GET": 0.00043,
        "HEAD": 0.0004,
        "LIST": 0.0054,
        "other": 0.005,
    }


def test_dollars_and_connections_per_request() -> None:
    f = Figures(
        "x",
        samples=2000,
        objects=4000,
        requests={"GET": 4000, "HEAD": 4000, "LIST": 4, "other": 0, "unreadable": 1},
        new_connections=800,
    )
    bench_methods.fill_request_rates(f, bench_methods.S3_PRICES)
    # (8,000 x $0.0004 + 4 x $0.005) / 1,000 per 2,000 samples
    assert f.dollars_per_million_samples == pytest.approx(1.61)
    assert f.connections_per_request == pytest.approx(800 / 8004)
    bench_methods.fill_request_rates(f, {**bench_methods.S3_PRICES, "HEAD": 0.0})
    assert f.dollars_per_million_samples == pytest.approx(0.81)


def test_readme_table_quotes_dollars_connections_and_the_first_batch() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_run", os.path.join(os.path.dirname(__file__), "..", "..", "bench", "run.py")
    )
    assert spec is not None and spec.loader is not None
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)

    def doc(**by_method: dict) -> dict:  # type: ignore[type-arg]
        return {"results": [{"method": m, "status": "ok", **r} for m, r in by_method.items()]}

    counted = {
        "samples_per_s": 400.0,
        "first_batch_s": 0.3,
        "requests_per_sample": 4.0,
        "requests_per_sample_by_kind": {"GET": 2.0, "HEAD": 2.0, "LIST": 0.0},
        "dollars_per_million_samples": 1.61,
        "connections_per_request": 0.5,
        "peak_open_connections": 300,
    }
    runs = {
        "proxy": doc(
            **{"s5loader": counted, "s3torchconnector": {**counted, "dollars_per_million_samples": 0.81}}
        )
    }
    extra = {
        "first-direct": doc(s5loader={"first_batch_s": 0.21}, s3torchconnector={"first_batch_s": 0.35}),
        "first-proxy": doc(s5loader={"first_batch_s": 0.4}),
        "single": doc(s5loader={"dollars_per_million_samples": 0.8}),
    }
    table = run.readme_table(runs, 20.0, extra)
    rows = {
        cells[0]: cells[1:]
        for cells in ([c.strip() for c in ln.strip("|").split(" | ")] for ln in table.splitlines())
    }
    assert rows["first batch, s, batch 32 and 4 workers: direct / 20 ms proxy"][:2] == [
        "0.21 / 0.40",
        "0.35 / -",
    ]
    assert rows["$ per million samples at S3 list prices (image + label, proxy run)"][:2] == ["1.61", "0.81"]
    assert rows["$ per million samples at S3 list prices (one object per sample)"][0] == "0.80"
    assert rows["new TCP connections per request / most open at once (proxy run)"][0] == "0.500 / 300"
