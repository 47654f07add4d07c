"""One progress helper for long operations: a bar on a terminal, a line every few seconds in a
job log.

A private module (``s5loader._index``) is imported only where it is the seam under test; the
rest goes through the public API."""

from __future__ import annotations

import io
import logging
import os
import sys

from support.stores import Store

from s5loader import fetch
from s5loader.progress import Progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_bar_is_redrawn_in_place_and_ended() -> None:
    out = FakeTerminal()
    with Progress("fetching", 4_000_000, unit="bytes", stream=out) as p:
        p.set(1_000_000)
        assert out.getvalue().startswith("\r\x1b[Kfetching [#######.......................]  25.0%")
        p.set(4_000_000)  # within 0.1 s of the last draw: not redrawn yet
    text = out.getvalue()
    assert "100.0%" in text and "MB/s" in text and text.endswith("\n") and text.count("\n") == 1


def test_terminal_counter_without_total_and_silent_before_delay() -> None:
    out = FakeTerminal()
    p = Progress("listing s3://b/p/", stream=out, delay=3600)
    p.set(5000)
    p.close()
    assert out.getvalue() == ""  # quicker than the delay: nothing shown
    p = Progress("listing s3://b/p/", stream=out)
    p.set(5000)
    p.close()
    assert "listing s3://b/p/  5000 objects" in out.getvalue() and "[#" not in out.getvalue()


def test_job_log_gets_lines_not_a_bar(caplog) -> None:
    out = io.StringIO()  # not a terminal
    p = Progress("uploading", 10, stream=out, interval=0)
    p.update(5)
    p.update(5)
    p.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 3
    assert lines[0].startswith("uploading:  50.0%  5 objects of 10")
    assert lines[-1].startswith("uploading: 100.0%  10 objects of 10") and lines[-1].endswith("s")
    # library code hands its lines to a logger instead
    caplog.set_level(logging.INFO, logger="test.progress")
    p = Progress(
        "listing", stream=out, interval=0, logger=logging.getLogger("test.progress"), final_line=False
    )
    p.set(3000)
    p.close()
    assert len(caplog.records) == 1 and caplog.records[0].getMessage().startswith("listing  3000 objects")


def test_fetch_command_draws_a_bar_on_a_terminal(moto: Store, tmp_path, monkeypatch) -> None:
    moto.put({"a.bin": os.urandom(3000), "b.bin": os.urandom(5000)})
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert fetch.main([moto.uri(), str(tmp_path / "d"), "--endpoint-url", moto.endpoint]) == 0
    text = term.getvalue()
    assert f"\r\x1b[Kfetching into {tmp_path / 'd'} [{'#' * 30}] 100.0%" in text and text.endswith("\n")


def test_listing_a_prefix_shows_its_count_on_a_terminal(moto: Store, monkeypatch) -> None:
    import s5loader._index.listing
    from s5loader import S5Dataset

    moto.put({f"{i:04d}.bin": b"x" for i in range(5)})
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(s5loader._index.listing, "_PROGRESS_DELAY", 0.0)  # as if the listing were long
    S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    assert f"\r\x1b[Klisting {moto.uri()}  5 objects" in term.getvalue() and term.getvalue().endswith("\n")
