"""The staging contract without a server: one layout both sides use, and releases announced
as events through the FIFO of the pass.

Private modules (``s5loader._index``, ``s5loader._staging``) are imported on purpose: their own
behaviour is what these tests check."""

from __future__ import annotations

import os
import stat

from s5loader._index.sample import Field, Sample
from s5loader._staging.layout import StagingLayout
from s5loader._staging.release_events import ReleaseEvents


def test_layout_paths_and_release_announce_the_index(tmp_path) -> None:
    layout = StagingLayout(str(tmp_path))
    sample = Sample("k", (Field("image", "s3://b/k.image", 3, ""), Field("label", "s3://b/k.label", 1, "")))
    paths = layout.paths(7, sample)
    assert paths == [f"{tmp_path}/7/image", f"{tmp_path}/7/label"]
    assert layout.path(7, sample, 1) == paths[1]
    events = ReleaseEvents(layout).open()
    try:
        assert stat.S_ISFIFO(os.stat(layout.releases).st_mode)
        assert events.read() == []
        os.makedirs(layout.sample_dir(7))
        for p in paths:
            with open(p, "wb") as fh:
                fh.write(b"x")
        layout.release(7, paths)
        assert not os.path.exists(layout.sample_dir(7))
        layout.notify(8)
        events.wake()  # a wake-up is no index
        assert events.read() == [7, 8]
    finally:
        events.close()
        events.close()  # idempotent
    layout.notify(9)  # nobody reads any more: dropped, never blocks or raises


def test_release_without_fifo_is_silent(tmp_path) -> None:
    layout = StagingLayout(str(tmp_path / "gone"))
    layout.release(3, [f"{tmp_path}/gone/3/data"])  # neither folder nor FIFO: nothing to do
    assert os.listdir(tmp_path) == []  # and nothing made: no folder, no FIFO
