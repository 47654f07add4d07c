"""``bench/s5cmd_costs.py``: its settings grammar, the command lines it writes (the very lines
s5loader writes), its aggregation. A short real run against SeaweedFS is in
``tests/test_s5cmd_costs_run.py``.

Private modules (``s5loader._s5cmd``) are imported on purpose: their own behaviour is what these
tests check."""

from __future__ import annotations

import os
import shlex

import pytest
import s5cmd_costs as costs  # bench/ is on the path (pyproject.toml)

from s5loader._s5cmd import copy_line, wildcard_line


def test_parse_gogc() -> None:
    assert costs.parse_gogc("100") == (None, None)
    assert costs.parse_gogc("default") == (None, None)
    assert costs.parse_gogc("400") == ("400", None)
    assert costs.parse_gogc("off:512MiB") == ("off", "512MiB")
    assert costs.parse_gogc("200:1GiB") == ("200", "1GiB")
    for bad in ("off", "lots", "400:big"):
        with pytest.raises(ValueError):
            costs.parse_gogc(bad)


def test_parse_setting_over_a_base() -> None:
    base = costs.Setting(numworkers=256)
    s = costs.parse_setting("GOGC=400,GOMEMLIMIT=512MiB,NUMWORKERS=64,GOMAXPROCS=1", base)
    assert s == costs.Setting("400", "512MiB", 1, 64)
    assert costs.parse_setting("gogc=off:256MiB", base) == costs.Setting("off", "256MiB", None, 256)
    with pytest.raises(ValueError, match="unknown setting"):
        costs.parse_setting("GOFAST=1", base)
    with pytest.raises(ValueError):
        costs.parse_setting("NUMWORKERS=0", base)


def test_setting_env_replaces_inherited_go_variables() -> None:
    env = costs.Setting("400", "512MiB", 2, 64).env({"GOGC": "50", "GOMAXPROCS": "9", "HOME": "/h"})
    assert env == {"GOGC": "400", "GOMEMLIMIT": "512MiB", "GOMAXPROCS": "2", "HOME": "/h"}
    assert costs.Setting().env({"GOGC": "50", "GOMEMLIMIT": "1GiB", "HOME": "/h"}) == {"HOME": "/h"}


def test_one_at_a_time_grid_starts_at_the_base_without_duplicates() -> None:
    base = costs.Setting(numworkers=256)
    settings = costs.grid(
        "oat",
        [(None, None), ("400", None)],
        [None, 1],
        [64, 256],
        base,
        [costs.Setting("400", None, None, 64)],
    )
    assert settings == [
        base,
        costs.Setting("400", None, None, 256),
        costs.Setting(None, None, 1, 256),
        costs.Setting(numworkers=64),
        costs.Setting("400", None, None, 64),
    ]
    assert len(costs.grid("full", [(None, None), ("400", None)], [None, 1], [64, 256], base)) == 8
    with pytest.raises(ValueError):
        costs.grid("some", [], [], [], base)


def test_command_lines_are_the_lines_s5loader_writes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    keys = costs.object_keys(25, "p/")
    assert keys[0] == "p/000000.bin" and keys[-1] == "p/000024.bin"
    dest = str(tmp_path)
    raw = costs.command_lines("raw", "b", "p/", keys, dest)
    assert raw == [copy_line(f"s3://b/{k}", os.path.join(dest, k)) for k in keys]
    block = costs.command_lines("block10", "b", "p/", keys, dest)
    assert block == [
        wildcard_line(f"s3://b/p/0000{i}*", os.path.join(dest, f"p/0000{i}") + "/") for i in range(3)
    ]
    assert costs.command_lines("prefix", "b", "p/", keys, dest) == [wildcard_line("s3://b/p/*", dest + "/p/")]
    # every line is one s5cmd command: cp, flags, source, destination
    for line in raw + block:
        assert shlex.split(line)[0] == "cp"
    assert costs.command_lines("head", "b", "p/", keys[:2], dest) == [
        "head s3://b/p/000000.bin\n",
        "head s3://b/p/000001.bin\n",
    ]
    with pytest.raises(ValueError, match="unknown line shape"):
        costs.command_lines("zigzag", "b", "p/", keys, dest)


def test_split_source() -> None:
    assert costs.split_source("s3://b/obj/") == ("b", "obj/")
    assert costs.split_source("s3://b/") == ("b", "")
    for bad in ("s3://b/obj", "s3://b/o*/", "/tmp/x/"):
        with pytest.raises(ValueError):
            costs.split_source(bad)


def test_count_successes() -> None:
    lines = [
        '{"operation":"cp","success":true,"source":"s3://b/k"}\n',
        '{"operation":"cp","success":false,"error":"NoSuchKey"}\n',
        "ERROR something\n",
        "\n",
        '{"operation":"cp","success":true}\n',
    ]
    ok, errors = costs.count_successes(lines)
    assert ok == 2
    assert len(errors) == 2 and "NoSuchKey" in errors[0]
    assert costs.count_successes(['{"key":"s3://b/k","size":3}\n', "ERROR x\n"], "head")[0] == 1
    assert costs.count_successes(["http://h/b/k?X-Amz-Signature=1\n", "ERROR x\n"], "presign")[0] == 1


def test_aggregate_takes_medians_and_compares_with_the_base() -> None:
    def run(setting: str, shape: str, cpu: float, rss: int) -> dict[str, object]:
        return {
            "setting": setting,
            "shape": shape,
            "user_s": cpu * 0.75,
            "sys_s": cpu * 0.25,
            "maxrss_kib": rss,
            "wall_s": 1.0,
            "server_cpu_s": 2.0,
        }

    runs = [
        run("base", "raw", 4.0, 1024),
        run("base", "raw", 6.0, 3072),
        run("base", "raw", 5.0, 2048),
        run("fast", "raw", 4.0, 4096),
        run("fast", "raw", 3.0, 5120),
        run("fast", "raw", 100.0, 6144),
        run("base", "prefix", 2.0, 1024),
    ]
    rows = costs.aggregate(runs, 1000)
    assert [(r["setting"], r["shape"]) for r in rows] == [
        ("base", "raw"),
        ("fast", "raw"),
        ("base", "prefix"),
    ]
    base, fast, prefix = rows
    assert base["cpu_s"] == 5.0 and base["cpu_ms_per_object"] == 5.0 and base["repeats"] == 3
    assert base["cpu_ms_per_object_min"] == 4.0 and base["cpu_ms_per_object_max"] == 6.0
    assert base["maxrss_mib"] == 2.0 and base["maxrss_mib_max"] == 3.0
    assert base["cpu_vs_base"] == 0.0
    assert fast["cpu_s"] == 4.0 and fast["cpu_vs_base"] == pytest.approx(
        -0.2
    )  # the outlier is not the median
    assert prefix["cpu_vs_base"] == 0.0 and prefix["server_cpu_ms_per_object"] == 2.0
    assert "| fast | raw | 4.000" in costs.markdown(
        {
            "settings": {"objects": 1000, "size": 1, "repeat": 3, "shapes": ["raw", "prefix"]},
            "machine": {"cpus": 2},
            "s5cmd_version": "v",
            "elapsed_s": 1.0,
            "requests": {},
            "summary": rows,
        }
    )
