"""The one channel's frames without a socket: the feed's messages go many to a frame, in order,
no frame longer than the channel accepts, and a frame that is no list of messages is refused.

Private modules (``s5loader._util.frames``, ``s5loader._sampling.wire``) are imported on purpose:
the frame format is what these tests check."""

from __future__ import annotations

import io

import pytest

from s5loader._sampling import wire
from s5loader._staging.reader import StagedIndex
from s5loader._util import frames


def _read_all(data: bytes) -> list[object]:
    f, out = io.BytesIO(data), []
    while True:
        try:
            out.append(frames.read(f))
        except EOFError:
            return out


def test_messages_go_many_to_a_frame_in_order_and_no_frame_is_too_long() -> None:
    folder = "/dev/shm/s5loader/" + "p" * 3000  # long folders: few messages fit in one frame
    msgs = [(wire.INDEX, StagedIndex(i, folder, False, i % 2 == 0, False, True)) for i in range(200)]
    data = frames.frames_of([wire.dumps(wire.encode(m)) for m in [*msgs, (wire.END, None)]])
    got = _read_all(data)
    assert 1 < len(got) < 200  # cut where a frame is full, not one frame a message
    assert all(len(frames.dumps(g)) <= frames.MAX_FRAME for g in got)
    back = [m for g in got for m in wire.decode_frame(g, None)]
    assert back == [*msgs, (wire.END, None)]
    assert [tuple(s.__dict__.values()) for _, s in back[:-1]] == [tuple(s.__dict__.values()) for _, s in msgs]
    assert frames.frames_of([]) == b""


@pytest.mark.parametrize("raw", [[], {"i": 1}, "i", [["i", [1]], ["nope", None]], [["i", [-1]]]])
def test_a_frame_that_is_no_list_of_the_feeds_messages_is_refused(raw: object) -> None:
    with pytest.raises(wire.FrameError):
        wire.decode_frame(raw, None)
