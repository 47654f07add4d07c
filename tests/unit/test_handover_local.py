"""The hand-over of the prefetch daemon without a server, on folders made by the test: the
consumer waits, deletes and stops at the end; the ledger looks at an unchanged cache without
listing it; the command help shows every default.

Private modules (``s5loader._daemon``) are imported on purpose: their own behaviour is what these
tests check."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

import s5loader._daemon.cache_state as daemon_state
from s5loader._daemon import (
    build_parser,
    sample_folder_name,
)
from s5loader._daemon.cache_state import Ledger
from s5loader.consume import END_MARKER, consume, ready_names
from s5loader.exceptions import StallError


def test_consume_waits_deletes_and_stops_at_end(tmp_path: Path) -> None:
    cache = tmp_path / "c"

    def deliver(seq: int) -> None:
        tmp = tmp_path / f"tmp{seq}"
        tmp.mkdir()
        (tmp / "label").write_bytes(str(seq).encode())
        os.rename(tmp, cache / sample_folder_name(seq, f"k/{seq}"))

    def daemon() -> None:  # starts after the consumer, delivers slowly, then ends
        time.sleep(0.2)
        cache.mkdir()
        for seq in range(3):
            deliver(seq)
            time.sleep(0.1)
        (cache / END_MARKER).write_text("{}")

    t = threading.Thread(target=daemon)
    t.start()
    seen = []
    for s in consume(cache, poll_interval=0.01, timeout=5):
        seen.append((s.name, s.read("label"), s.key))
        assert os.path.isdir(s.path)
        assert [n for n in ready_names(str(cache)) if n < s.name] == []  # the last one was deleted
    t.join()
    assert seen == [(sample_folder_name(i, f"k/{i}"), str(i).encode(), f"k_{i}") for i in range(3)]
    assert ready_names(str(cache)) == []

    # leaving the loop early keeps the current sample for the next consumer
    (cache / END_MARKER).unlink()
    for seq in (3, 4):
        deliver(seq)
    gen = consume(cache)
    s = next(gen)
    gen.close()  # as a break does
    assert ready_names(str(cache))[0] == s.name
    seqs = []
    with pytest.raises(StallError):  # no end marker and nothing more arrives
        for x in consume(cache, timeout=0.3, poll_interval=0.01):
            seqs.append(x.seq)
    assert seqs == [3, 4] and ready_names(str(cache)) == []


def test_ledger_looks_at_an_unchanged_cache_without_listing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine asks about every delivered sample several times a second while the cache is
    full: an unchanged cache costs a stat, not a listing of thousands of folders."""
    monkeypatch.setattr(
        daemon_state, "_MTIME_MARGIN_NS", 0, raising=False
    )  # no waiting for coarse timestamps
    cache = tmp_path / "cache"
    cache.mkdir()
    ledger = Ledger(str(cache))
    for seq in range(2000):
        name = sample_folder_name(seq, f"train/{seq}")
        (cache / name).mkdir()
        ledger.add(seq, name, 100)
    listed: list[str] = []
    real_listdir = os.listdir

    def listdir(path: str = ".") -> list[str]:
        if os.fspath(path) == str(cache):
            listed.append(os.fspath(path))
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", listdir)
    time.sleep(0.05)  # the folders' last change is older than the first listing
    for _ in range(100):
        ledger.refresh(force=True)
        assert not any(ledger.is_released(seq) for seq in range(0, 2000, 50))
    assert len(listed) <= 2, f"{len(listed)} listings of an unchanged cache"
    shutil.rmtree(cache / sample_folder_name(7, "train/7"))  # consumed
    ledger.refresh(force=True)
    assert ledger.is_released(7) and not ledger.is_released(8) and ledger.count == 1999


def test_help_shows_every_default() -> None:
    text = build_parser().format_help().split("options:", 1)[1]
    for option, default in (
        ("--group-by", "stem"),
        ("--seed", "0"),
        ("--epochs", "1"),
        ("--samples-per-call", "1000"),
        ("--calls-in-flight", "4"),
        ("--s5cmd-workers", "32"),
        ("--block-size", "64"),
        ("--on-error", "raise"),
        ("--shuffle", "off"),
    ):
        section = text.split(f"\n  {option}", 1)[1].split("\n  --", 1)[0]
        assert f"(default: {default})" in " ".join(section.split()), (option, section)


def test_the_delivery_window_waits_for_the_consumer_then_the_budget_and_warns_a_holder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Deliveries.await_window over real folders in a cache: within the window it delivers at
    once; with the window full it waits for a deletion, delivers into the engine's budget where
    that has room, stops on a stop, and warns a consumer that holds the window too long."""
    from s5loader._daemon import delivery

    cache = tmp_path / "c"
    cache.mkdir()
    ledger = Ledger(str(cache))

    class Stream:  # the engine's side: its budget's room, and what it holds beyond the window
        room = False

        def beyond_held(self, released: object) -> int:
            return 0

        def room_for(self, size: int, held: int, budget: int) -> bool:
            return self.room

    def hold(seq: int) -> None:
        name = sample_folder_name(seq, f"k{seq}")
        (cache / name).mkdir()
        ledger.add(seq, name, 100)

    d = delivery.Deliveries.__new__(delivery.Deliveries)
    d.ledger, d.stream, d.cache = ledger, Stream(), str(cache)  # type: ignore[assignment]
    stop = threading.Event()
    assert d.await_window(250, 100, 10_000, stop, lambda: None) is True  # holds nothing
    hold(0)
    assert d.await_window(250, 100, 10_000, stop, lambda: None) is True  # 100 + 100 within 250
    hold(1)
    threading.Timer(0.2, lambda: shutil.rmtree(cache / sample_folder_name(0, "k0"))).start()
    t = time.monotonic()
    assert d.await_window(250, 100, 10_000, stop, lambda: None) is True  # after the consumer deleted one
    assert time.monotonic() - t >= 0.15
    hold(2)
    d.stream.room = True  # type: ignore[attr-defined]
    assert d.await_window(250, 100, 10_000, stop, lambda: None) is False  # into the engine's budget
    d.stream.room = False  # type: ignore[attr-defined]
    monkeypatch.setattr(delivery, "HELD_WARN_S", 0.1)
    threading.Timer(0.4, stop.set).start()
    with caplog.at_level("WARNING", logger="s5loader._daemon.delivery"):
        assert d.await_window(250, 100, 10_000, stop, lambda: None) is None  # stopped while held
    assert "holds 2 delivered samples" in caplog.text and str(cache) in caplog.text
