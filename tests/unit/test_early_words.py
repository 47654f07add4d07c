"""A reader's wait for the sampler's word on a sample handed out before it was staged
(``StagingLayout.mark_early`` and ``wait_staged``): staged, not staged, an error, a pass folder
that goes; woken by the bell the sampler rings, or by looking where no FIFO can be made.

Private modules (``s5loader._staging``) are imported on purpose: their own behaviour is what
these tests check."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
from support.threads import in_thread

from s5loader import ObjectNotFoundError, S5LoaderError, StallError
from s5loader._staging.layout import NOT_STAGED, StagingLayout
from s5loader._staging.reader import error_of_word, wait_staged, word_of_error


@pytest.fixture
def layout(tmp_path: Path) -> StagingLayout:
    os.makedirs(tmp_path / "p1" / ".e")
    os.mkfifo(tmp_path / "p1" / ".released")  # as the engine makes it when the pass begins
    return StagingLayout(str(tmp_path / "p1"))


def wait_for_bell(layout: StagingLayout, index: int) -> None:
    """Until the reader listens on its bell (a condition, not a pause)."""
    done = threading.Event()
    while not os.path.exists(layout.early_bell(index)):
        done.wait(0.001)


def test_a_word_written_already_is_read_and_removed(layout: StagingLayout) -> None:
    layout.mark_early(7)
    assert wait_staged(layout, 7) is True
    assert os.listdir(os.path.join(layout.folder, ".e")) == []


def test_a_waiting_reader_is_woken_by_the_bell(layout: StagingLayout) -> None:
    t, got = in_thread(lambda: wait_staged(layout, 3))
    wait_for_bell(layout, 3)
    assert t.is_alive() and not got  # it waits for the word
    layout.mark_early(3)
    t.join(30)
    assert got == [True]
    assert os.listdir(os.path.join(layout.folder, ".e")) == []  # the word and the bell are gone


def test_an_error_word_is_raised_with_its_type_and_message(layout: StagingLayout) -> None:
    exc = ObjectNotFoundError("cannot stage s3://b/k.image: NoSuchKey")
    assert type(error_of_word(word_of_error(exc))) is ObjectNotFoundError
    t, got = in_thread(lambda: wait_staged(layout, 4))
    wait_for_bell(layout, 4)
    layout.mark_early(4, word_of_error(StallError("made no progress for 1s: s3://b/x")))
    t.join(30)
    assert isinstance(got[0], StallError) and str(got[0]) == "made no progress for 1s: s3://b/x"
    # a type s5loader does not have is raised as its base, with the message
    assert type(error_of_word(word_of_error(RuntimeError("boom")))) is S5LoaderError


def test_a_pass_that_stopped_first_is_an_error_not_a_wait(layout: StagingLayout) -> None:
    layout.mark_early(5, NOT_STAGED)
    with pytest.raises(
        S5LoaderError, match="sample 5 of the staging pass .* was not staged: the pass was closed first"
    ):
        wait_staged(layout, 5)


def test_a_pass_folder_that_goes_ends_the_wait(
    layout: StagingLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    from s5loader._staging import reader

    monkeypatch.setattr(reader, "_RECHECK_S", 0.01)
    t, got = in_thread(lambda: wait_staged(layout, 6))
    wait_for_bell(layout, 6)
    shutil.rmtree(layout.folder)  # a replaced pass's folder: the reader fetches directly
    t.join(30)
    assert got == [False]


def test_a_pass_folder_removed_and_made_again_ends_the_wait(
    layout: StagingLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    from s5loader._staging import reader

    monkeypatch.setattr(reader, "_RECHECK_S", 0.01)
    t, got = in_thread(lambda: wait_staged(layout, 9))
    wait_for_bell(layout, 9)
    shutil.rmtree(layout.folder)  # someone else removed the staging directory...
    os.makedirs(os.path.join(layout.folder, ".e"))  # ...and the engine's next file made it again
    t.join(30)
    assert got == [False]  # its word may be lost with the old folder: read it directly


def test_without_fifos_the_reader_looks_now_and_then(
    layout: StagingLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_fifo(path: str, mode: int = 0o666) -> None:
        raise PermissionError(1, "Operation not permitted", path)

    from s5loader._staging import reader

    monkeypatch.setattr(os, "mkfifo", no_fifo)
    started = threading.Event()
    real_gone = reader._gone

    def gone(layout: StagingLayout, parent: int) -> bool:  # the reader looked once and found no word
        started.set()
        return real_gone(layout, parent)

    monkeypatch.setattr(reader, "_gone", gone)
    t, got = in_thread(lambda: wait_staged(layout, 8))
    assert started.wait(30)
    layout.mark_early(8)  # no bell to ring: the next look finds the word
    t.join(30)
    assert got == [True]


def test_an_error_word_with_no_room_to_be_written_is_a_staging_space_error(
    layout: StagingLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    import builtins
    import errno

    from s5loader import StagingSpaceError

    real_open = builtins.open

    def full(path: str, mode: str = "r", *a: object, **kw: object) -> object:
        if str(path).endswith(".tmp") and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(builtins, "open", full)
    layout.mark_early(4, word_of_error(StallError("stalled")))  # the file system is full
    monkeypatch.setattr(builtins, "open", real_open)
    with pytest.raises(StagingSpaceError, match=f"{layout.folder} ran out of space"):
        wait_staged(layout, 4)
