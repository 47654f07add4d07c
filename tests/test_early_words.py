"""The sampler's words on samples handed out before they were staged, served on a socket in the
pass folder (``s5loader._staging.words``): staged, not staged, an error, a pass folder that
goes, a server that ends; only the sampler's own process and its descendants reach it, a pickle
runs nothing, and a reader talks to no process that is not its sampler.

Private modules are imported on purpose: the channel is the seam under test; the end-to-end
tests (tests/test_first_batch.py, the container tests) go through it with a real DataLoader."""

from __future__ import annotations

import io
import multiprocessing
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from support.strangers import orphan
from support.threads import in_thread
from support.waits import wait_for

from s5loader import ObjectNotFoundError, S5LoaderError, StallError
from s5loader._staging import words
from s5loader._staging.words import WORDS, WordServer, ask

FORK = multiprocessing.get_context("fork")

# A process of the same user that is none of the loader's: it connects to the socket ARGV[1],
# sends a pickle whose loading would create the file ARGV[2], and writes to ARGV[3] whether
# the other side closed the connection on it.
STRANGER = textwrap.dedent(
    """
    import os, pickle, socket, struct, sys
    path, mark, out = sys.argv[1:4]

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {mark}",))

    data = pickle.dumps(Evil())
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.settimeout(20)
    try:
        s.sendall(struct.pack(">I", len(data)) + data)
        closed = s.recv(1) == b""
    except OSError:
        closed = True
    open(out + ".tmp", "w").write("closed" if closed else "open")
    os.replace(out + ".tmp", out)
    """
)

# A server of the same user that is not the reader's sampler: it serves the socket ARGV[1]
# until ARGV[2] exists.
IMPOSTOR = textwrap.dedent(
    """
    import os, socket, sys, time
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sys.argv[1])
    s.listen(4)
    open(sys.argv[2] + ".bound", "w").close()
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.02)
    """
)


@pytest.fixture
def folder(tmp_path: Path) -> str:
    os.makedirs(tmp_path / "p1")
    return str(tmp_path / "p1")


@pytest.fixture
def server(folder: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(words, "_WATCH_S", 0.02)
    s = WordServer(folder)
    yield s
    s.close()


def test_a_word_settled_already_is_answered_once(server: WordServer, folder: str) -> None:
    server.settle(7, True)
    assert ask(folder, 7) is True
    assert server.words == {}  # answered: dropped


def test_a_waiting_reader_gets_the_word_when_it_is_settled(server: WordServer, folder: str) -> None:
    t, got = in_thread(lambda: ask(folder, 3))
    t.join(0.2)
    assert t.is_alive() and not got  # it waits for the word
    server.settle(3, True)
    t.join(30)
    assert got == [True]


def test_an_error_word_is_raised_with_its_type_and_message(server: WordServer, folder: str) -> None:
    server.settle(4, StallError("made no progress for 1s: s3://b/x"))
    with pytest.raises(StallError, match=r"^made no progress for 1s: s3://b/x$"):
        ask(folder, 4)
    server.settle(5, ObjectNotFoundError("cannot stage s3://b/k.image: NoSuchKey"))
    with pytest.raises(ObjectNotFoundError, match="s3://b/k.image"):
        ask(folder, 5)
    server.settle(6, RuntimeError("boom"))  # a built-in type comes back as itself
    with pytest.raises(RuntimeError, match="^boom$"):
        ask(folder, 6)


def test_a_pass_that_stopped_first_is_an_error_not_a_wait(server: WordServer, folder: str) -> None:
    server.settle(5, None)
    with pytest.raises(
        S5LoaderError, match="sample 5 of the staging pass .* was not staged: the pass was closed first"
    ):
        ask(folder, 5)


def test_a_pass_folder_that_goes_ends_the_wait(server: WordServer, folder: str) -> None:
    t, got = in_thread(lambda: ask(folder, 6))
    t.join(0.2)
    shutil.rmtree(folder)  # a replaced pass's folder: the reader fetches directly
    t.join(30)
    assert got == [False]
    wait_for(lambda: server.gone, what="the server to see its folder gone")


def test_a_pass_folder_removed_and_made_again_ends_the_wait(server: WordServer, folder: str) -> None:
    t, got = in_thread(lambda: ask(folder, 9))
    t.join(0.2)
    shutil.rmtree(folder)  # someone else removed the staging directory...
    os.makedirs(folder)  # ...and the engine's next file made it again
    t.join(30)
    assert got == [False]  # its word is lost with the old folder: read it directly
    assert ask(folder, 9) is False  # and nothing answers there any more


def test_a_pass_with_no_server_is_read_directly(folder: str) -> None:
    assert ask(folder, 1) is False


def test_a_server_that_ends_while_a_reader_waits_ends_the_wait(server: WordServer, folder: str) -> None:
    t, got = in_thread(lambda: ask(folder, 2))
    t.join(0.2)
    server.close()  # as the sampler's process ending closes every connection
    t.join(30)
    assert got == [False]


def test_a_folder_longer_than_a_socket_address_is_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(words, "_WATCH_S", 0.02)
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "p1"
    os.makedirs(deep)
    s = WordServer(str(deep))
    try:
        assert len(os.fsencode(str(deep / WORDS))) > 108 and os.path.exists(deep / WORDS)
        s.settle(1, True)
        assert ask(str(deep), 1) is True
    finally:
        s.close()


def forked_reader(folder: str, index: int, out: object) -> None:
    try:
        out.put(ask(folder, index))  # type: ignore[attr-defined]
    except BaseException as exc:  # noqa: BLE001 - handed to the test
        out.put(f"{type(exc).__name__}: {exc}")  # type: ignore[attr-defined]


def test_a_worker_forked_after_the_sampler_asked_gets_its_own_connection(
    server: WordServer, folder: str
) -> None:
    server.settle(1, True)
    assert ask(folder, 1) is True  # this process has a connection now
    server.settle(2, True)
    out = FORK.Queue()
    p = FORK.Process(target=forked_reader, args=(folder, 2, out))  # as a DataLoader's worker
    p.start()
    assert out.get(timeout=30) is True
    p.join(30)
    server.settle(3, True)
    assert ask(folder, 3) is True  # the parent's connection still answers its own questions


def test_a_stranger_and_a_pickle_reach_nothing_and_the_readers_go_on(
    server: WordServer, folder: str, tmp_path: Path
) -> None:
    mark = tmp_path / "pwned"
    path = os.path.join(folder, WORDS)
    # a process that this one did not start, and one that it did (as a worker would be)
    orphan(STRANGER, tmp_path / "stranger.log", path, str(mark), str(tmp_path / "stranger"))
    wait_for(lambda: (tmp_path / "stranger").exists(), what="the stranger's pickle")
    subprocess.run([sys.executable, "-c", STRANGER, path, str(mark), str(tmp_path / "child")], timeout=30)
    assert (tmp_path / "stranger").read_text() == "closed"
    assert (tmp_path / "child").read_text() == "closed"  # not a request: closed unread
    assert not mark.exists(), "a pickle sent to the sampler's words ran"
    server.settle(8, True)
    assert ask(folder, 8) is True


def test_a_reader_does_not_talk_to_a_server_that_is_not_its_sampler(folder: str, tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    orphan(IMPOSTOR, tmp_path / "impostor.log", os.path.join(folder, WORDS), str(stop))
    try:
        wait_for(lambda: Path(f"{stop}.bound").exists(), what="the stranger to bind the socket")
        with pytest.raises(
            S5LoaderError, match="is not this DataLoader's sampler but pid .*; it was sent nothing"
        ):
            ask(folder, 1)
    finally:
        stop.touch()


def test_a_wait_broken_off_leaves_no_answer_for_the_next_question(server: WordServer, folder: str) -> None:
    import signal

    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            ask(folder, 1)  # as Ctrl-C in a notebook, or a dataset's own timeout
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    server.settle(1, True)  # the word on the question broken off comes now ...
    server.settle(2, None)
    server.settle(3, RuntimeError("three"))
    with pytest.raises(S5LoaderError, match="sample 2 of the staging pass"):
        ask(folder, 2)  # ... and is not taken for the next question's
    with pytest.raises(RuntimeError, match="^three$"):
        ask(folder, 3)


def sampler_that_dies(folder: str, out: object) -> None:
    """A sampler's process: serves the words, forks a reader that waits for sample 1, then
    another child that keeps the server's socket open, and is killed."""
    import signal
    import time

    WordServer(folder)
    reader = FORK.Process(target=forked_reader, args=(folder, 1, out))
    reader.start()
    time.sleep(0.5)  # the reader connects and waits (if not yet, it finds no sampler: the same)
    holder = FORK.Process(target=time.sleep, args=(60,))  # as a validation loader's workers
    holder.start()
    out.put(("holder", holder.pid))  # type: ignore[attr-defined]
    out.close()  # type: ignore[attr-defined]
    out.join_thread()  # type: ignore[attr-defined]
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_reader_whose_sampler_was_killed_reads_directly_while_the_samplers_children_live(
    folder: str,
) -> None:
    import signal

    out = FORK.Queue()
    s = FORK.Process(target=sampler_that_dies, args=(folder, out))
    s.start()
    got = dict(
        x if isinstance(x, tuple) else ("reader", x) for x in (out.get(timeout=30), out.get(timeout=30))
    )
    os.kill(got["holder"], signal.SIGKILL)  # it still held the socket when the reader gave up
    s.join(30)
    assert got["reader"] is False


def test_threads_of_one_reader_wait_for_their_own_samples(server: WordServer, folder: str) -> None:
    first, got_first = in_thread(lambda: ask(folder, 1))
    second, got_second = in_thread(lambda: ask(folder, 2))
    server.settle(2, True)  # the later sample first: its thread does not wait behind the other
    second.join(30)
    assert got_second == [True] and first.is_alive()
    server.settle(1, True)
    first.join(30)
    assert got_first == [True]


def test_a_batch_is_asked_for_in_one_request_and_answered_in_its_order(
    server: WordServer, folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[object] = []
    read = words.read

    def recording(f: object) -> object:
        got = read(f)
        if not isinstance(f, io.BytesIO):  # the server's side: what a reader asked
            asked.append(got)
        return got

    monkeypatch.setattr(words, "read", recording)
    words.announce(folder, [5, 6, 7, 8])
    server.settle(8, True)  # out of order: answered in the batch's order all the same
    server.settle(6, RuntimeError("six"))
    late = threading.Timer(0.2, server.settle, (5, True))
    late.start()
    assert ask(folder, 5) is True  # 5 first: it waits for its word
    late.join()
    with pytest.raises(RuntimeError, match="^six$"):
        ask(folder, 6)  # an error word leaves the batch's other answers where they are
    server.settle(7, None)
    with pytest.raises(S5LoaderError, match="sample 7 of the staging pass"):
        ask(folder, 7)
    assert ask(folder, 8) is True
    assert asked == [[5, 6, 7, 8]] and server.words == {}


def test_a_batch_broken_off_leaves_its_answers_to_no_other_question(server: WordServer, folder: str) -> None:
    words.announce(folder, [1, 2, 3])
    for i in (1, 2, 3):
        server.settle(i, True)
    assert ask(folder, 1) is True  # then the reader raised: 2 and 3 are never read
    words.announce(folder, [4])
    server.settle(4, None)
    with pytest.raises(S5LoaderError, match="sample 4 of the staging pass"):
        ask(folder, 4)  # not the answer on 2, which came first on the old connection
    words.announce(folder, [5, 6])
    server.settle(6, RuntimeError("six"))
    with pytest.raises(RuntimeError, match="^six$"):
        ask(folder, 6)  # read out of the announced order: asked again on its own


def test_a_request_for_too_many_words_closes_the_connection(server: WordServer, folder: str) -> None:
    import socket as socketlib

    from s5loader._util.frames import frame

    s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    s.connect(os.path.join(folder, WORDS))
    s.settimeout(30)
    s.sendall(frame(list(range(words.MOST_ASKED + 1))))
    assert s.recv(1) == b""  # closed, nothing answered
    s.close()
    server.settle(1, True)
    assert ask(folder, 1) is True  # the server goes on


def test_words_for_a_reader_that_went_stay_for_the_next_question(server: WordServer, folder: str) -> None:
    import socket as socketlib

    from s5loader._util.frames import frame

    s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    s.connect(os.path.join(folder, WORDS))
    s.sendall(frame([1, 2]))
    s.close()  # a worker that asked for its batch and ended before the answers came
    server.settle(1, True)
    server.settle(2, RuntimeError("two"))
    # the first connection's thread could not send them: they were kept (else these would wait)
    t, got = in_thread(lambda: ask(folder, 1))
    t.join(30)
    assert got == [True]
    t, got = in_thread(lambda: ask(folder, 2))
    t.join(30)
    assert len(got) == 1 and isinstance(got[0], RuntimeError) and str(got[0]) == "two"
