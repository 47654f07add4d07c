"""The hand-off between a rank's staging host and its DataLoader workers takes no code and no
stranger: real processes (the host and a worker forked from one parent, as a DataLoader forks
its workers) and a process that is not one of them (a grandchild of the test, as another
program of the same user would be), connecting to the host's abstract socket with a pickle, or
binding the host's name first.

Private modules (``s5loader._sampling.feed`` and ``.wire``) are imported: the channel is the seam under test;
the end-to-end tests of the iterable go through it with a real DataLoader."""

from __future__ import annotations

import multiprocessing
import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from support.strangers import orphan
from support.waits import wait_for

from s5loader import FetchError, S5LoaderError, StallError
from s5loader._sampling import feed, wire
from s5loader._staging.reader import StagedIndex

FORK = multiprocessing.get_context("fork")

# A process of the same user that is no worker of the loader: it sends ARGV[2] (a pickle whose
# loading would create the file ARGV[3], or a hello claiming worker 1) to the abstract socket
# ARGV[1], then writes to ARGV[4] whether the other side closed the connection on it.
STRANGER = textwrap.dedent(
    """
    import json, os, pickle, socket, struct, sys
    name, what, mark, out = sys.argv[1:5]

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {mark}",))

    data = pickle.dumps(Evil()) if what == "pickle" else json.dumps([1, 2, 0, 0, []]).encode()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\\0" + name)
    s.settimeout(20)
    try:
        s.sendall(struct.pack(">I", len(data)) + data)
        closed = s.recv(1) == b""
    except OSError:  # refused before it was read
        closed = True
    open(out + ".tmp", "w").write("closed" if closed else "open")
    os.replace(out + ".tmp", out)  # whole when it appears
    """
)

# A process of the same user that binds the host's name before the host: a worker must not talk
# to it. It holds the name until ARGV[2] exists.
IMPOSTOR = textwrap.dedent(
    """
    import os, socket, sys, time
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind("\\0" + sys.argv[1])
    s.listen(4)
    open(sys.argv[2] + ".bound", "w").close()
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.02)
    """
)


def host(name: str, root: str, out: Any, key: str = "") -> None:
    """Worker 0 of 2: the rank's host; stages positions 0-5 (folders in ``root``)."""

    def serve(hellos: dict[int, feed.Hello]) -> Any:
        for pos in range(6):
            yield pos, (feed.INDEX, StagedIndex(pos, os.path.join(root, "p0"), frees=True))

    h = feed.FeedHost(name, feed.Hello(0, 2, 0, 0, (), key), serve, lambda pos: pos % 2).start()
    got = [(kind, int(x) if x is not None else None) for kind, x in feed.local(h)]
    h.wait_readers(30)
    h.close()
    out.put(("host", got))


def worker(name: str, root: str, out: Any, key: str = "") -> None:
    """Worker 1 of 2: connects to the host and reads its share."""
    try:
        got = [
            (kind, (int(x), x.folder, x.frees) if kind == feed.INDEX else None)
            for kind, x in feed.connect(name, feed.Hello(1, 2, 0, 0, (), key), timeout=30, root=root)
        ]
        out.put(("worker", got))
    except StallError as exc:
        out.put(("worker", f"StallError: {exc}"))


def run_worker(name: str, root: str, out: Any, key: str = "") -> dict[str, Any]:
    """Worker 1 in a process forked from this one; what it and the host put in ``out``."""
    w = FORK.Process(target=worker, args=(name, root, out, key))
    w.start()
    results = dict(out.get(timeout=60) for _ in range(2))
    w.join(30)
    return results


def end(h: Any) -> None:
    h.join(30)
    if h.is_alive():
        h.kill()


def worker_share(root: str) -> list[Any]:
    """What worker 1 of 2 gets of the host's six positions."""
    folder = os.path.join(root, "p0")
    return [(feed.INDEX, (p, folder, True)) for p in (1, 3, 5)] + [(feed.END, None)]


def test_a_stranger_and_a_pickle_reach_nothing_and_the_pass_goes_on(tmp_path: Path) -> None:
    name, root = f"s5loader-test-{secrets.token_hex(4)}", str(tmp_path / "area")
    mark = tmp_path / "pwned"
    out = FORK.Queue()
    h = FORK.Process(target=host, args=(name, root, out))
    h.start()
    try:
        # before the worker: a stranger with a pickle, a stranger claiming worker 1, and a sibling
        # of the host (the same parent, as another worker) with a pickle
        wait_for(lambda: f"@{name}" in Path("/proc/net/unix").read_text(), what="the host's socket")
        for what in ("pickle", "hello"):
            orphan(
                STRANGER, tmp_path / f"{what}.log", name, what, str(mark), str(tmp_path / f"stranger-{what}")
            )
            wait_for(
                lambda what=what: (tmp_path / f"stranger-{what}").exists(), what=f"the stranger's {what}"
            )
            assert (tmp_path / f"stranger-{what}").read_text() == "closed"
        sibling = FORK.Process(
            target=subprocess.run,
            args=([sys.executable, "-c", STRANGER, name, "pickle", str(mark), str(tmp_path / "sibling")],),
        )
        sibling.start()  # its child does the sending: a grandchild again, so run the script here
        sibling.join(30)
        results = run_worker(name, root, out)
    finally:
        end(h)
    assert not mark.exists(), "a pickle sent to the feed ran"
    assert results["host"] == [(feed.INDEX, p) for p in (0, 2, 4)] + [(feed.END, None)]
    assert results["worker"] == worker_share(root)


def test_a_worker_does_not_talk_to_a_stranger_that_took_the_hosts_name(tmp_path: Path) -> None:
    name, root = f"s5loader-test-{secrets.token_hex(4)}", str(tmp_path / "area")
    stop = tmp_path / "stop"
    orphan(IMPOSTOR, tmp_path / "impostor.log", name, str(stop))
    try:
        wait_for(lambda: Path(f"{stop}.bound").exists(), what="the stranger to bind the name")
        out = FORK.Queue()
        w = FORK.Process(target=worker, args=(name, root, out))
        w.start()
        _, got = out.get(timeout=60)
        w.join(30)
        # the host itself, coming late, says that its name is taken
        with pytest.raises(StallError, match="cannot take its socket"):
            feed.FeedHost(name, feed.Hello(0, 2, 0, 0, ()), lambda hellos: iter(()), lambda pos: 0).start()
    finally:
        stop.touch()
    assert isinstance(got, str) and got.startswith("StallError: "), got
    assert "found another process at its staging host's socket" in got and "sent that process nothing" in got


@pytest.mark.parametrize(
    "raw",
    [
        ["i", [3, "/elsewhere/p0", False, False, False, False]],  # a folder outside the staging area
        ["i", ["3"]],
        ["x", ["s5loader.exceptions", "ConfigError"]],
        {"i": 3},
        ["z", None],
    ],
)
def test_a_message_that_is_not_the_feeds_is_refused(raw: Any, tmp_path: Path) -> None:
    with pytest.raises(wire.FrameError):
        wire.decode(raw, str(tmp_path))


def test_messages_cross_as_plain_data_and_errors_keep_their_type(tmp_path: Path) -> None:
    from s5loader import BudgetError

    staged = StagedIndex(7, str(tmp_path / "p1"), keep=True, early=True)
    kind, back = wire.decode(wire.encode((feed.INDEX, staged)), str(tmp_path))
    assert kind == feed.INDEX and (int(back), back.folder, back.keep, back.early) == (
        7,
        staged.folder,
        True,
        True,
    )
    for exc in (BudgetError("the budget of 1 MB is full"), OSError("disk"), RuntimeError("r")):
        kind, err = wire.decode(wire.encode((feed.ERROR, exc)), None)
        assert kind == feed.ERROR and type(err) is type(exc) and str(err) == str(exc)
    _, other = wire.decode(["x", ["mylib", "SomethingElse", "boom"]], None)
    assert type(other) is S5LoaderError and str(other) == "mylib.SomethingElse: boom"
    # a name that s5loader also uses, from another module, is not taken for s5loader's
    _, theirs = wire.decode(["x", ["google.protobuf.message", "DecodeError", "bad"]], None)
    assert type(theirs) is S5LoaderError

    class Unreadable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    for exc in (Unreadable(), FetchError("x" * 100_000)):  # the frame stays small and decodes
        frame = wire.frame(wire.encode((feed.ERROR, exc)))
        assert len(frame) < wire.MAX_FRAME
        _, back = wire.decode(wire.encode((feed.ERROR, exc)), None)
        assert isinstance(back, S5LoaderError)


def sibling_without_the_key(name: str, out: Any) -> None:
    """A process with the workers' parent (as an orphan that PID 1 adopted is, where the training
    process is PID 1) that says a well-formed hello of worker 1 without the loader's key."""
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + name)
    s.settimeout(20)
    s.sendall(wire.hello_bytes(feed.Hello(1, 2, 0, 0, (), "not-the-key")))
    try:
        closed = s.recv(1) == b""
    except OSError:
        closed = True
    out.put(("sibling", closed))


def test_a_sibling_without_the_loaders_key_is_refused(tmp_path: Path) -> None:
    name, root, key = f"s5loader-test-{secrets.token_hex(4)}", str(tmp_path / "area"), secrets.token_hex(16)
    out = FORK.Queue()
    h = FORK.Process(target=host, args=(name, root, out, key))
    h.start()
    try:
        wait_for(lambda: f"@{name}" in Path("/proc/net/unix").read_text(), what="the host's socket")
        s = FORK.Process(target=sibling_without_the_key, args=(name, out))
        s.start()
        assert out.get(timeout=60) == ("sibling", True)  # closed on it: it gets nothing
        s.join(30)
        results = run_worker(name, root, out, key)
    finally:
        end(h)
    assert results["worker"] == worker_share(root)
