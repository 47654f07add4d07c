"""Metrics without a server: throughput over the last window, down to zero when idle, and every
field in the dictionary a JSON log writes.

Private modules (``s5loader._engine``) are imported on purpose: their own behaviour is what these
tests check."""

from __future__ import annotations

import pytest

from s5loader._engine.counters import RATE_WINDOW_S, Metrics, Throughput


def test_throughput_rates_over_the_last_window_and_down_to_zero_when_idle() -> None:
    t = Throughput(100.0)
    assert t.rates(100.0, 0, 0) == (0.0, 0.0)
    for k in range(1, 41):  # 40 points a quarter second apart: 1 MB and 10 samples a second
        t.add(100.0 + k / 4, k * 250_000, k * 10 // 4)
    mb_s, samples_s = t.rates(110.0, 10_000_000, 100)
    assert mb_s == pytest.approx(1.0) and samples_s == pytest.approx(10.0)
    t.add(110.1, 0, 0)  # closer than a quarter second to the last point: not kept
    assert t.points[-1][0] == 110.0
    # nothing more lands: the rate falls as the window moves on, to zero once it is past
    assert t.rates(110.0 + RATE_WINDOW_S / 2, 10_000_000, 100)[0] < 1.0
    assert t.rates(110.0 + RATE_WINDOW_S + 1, 10_000_000, 100) == (0.0, 0.0)


def test_metrics_as_dict_has_every_field() -> None:
    m = Metrics(epoch=2, budget=10, skips=1)
    d = m.as_dict()
    assert d["epoch"] == 2 and d["budget"] == 10 and d["skips"] == 1
    assert set(d) >= {
        "staged_bytes",
        "ready_ahead",
        "calls_in_flight",
        "objects_in_flight",
        "mb_s",
        "samples_s",
        "waited_s",
        "retries",
        "position",
    }
