"""``s5loader bench`` measuring parts without a server: the step recorder and the first
batch, the request classifier and parser of the latency proxy, the CPU split by process kind,
and the wildcard cover of the needed keys."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from s5loader_bench import methods as bench_methods
from s5loader_bench.methods import Figures, Recorder, drive, wildcard_cover
from s5loader_bench.monitor import CpuSplit, ProcTimes
from s5loader_bench.proxy import RequestParser, classify


def test_recorder_windows_of_100_steps() -> None:
    rec = Recorder(batch_size=2, max_steps=300, seconds=None)
    rec.step_at = [0.01 * (k + 1) for k in range(250)]  # a step every 10 ms
    rec.samples, rec.bytes, rec.wait_s = 500, 5000, 1.0
    f = Figures("x")
    rec.fill(f)
    assert (
        f.steps == 250 and f.step100_mean_s == pytest.approx(1.0) and f.step100_var_s2 == pytest.approx(0.0)
    )
    assert f.samples_per_s == pytest.approx(200.0) and f.wait_fraction == pytest.approx(0.4)


class _Clock:
    """A clock for the bench's ``time`` module: ``sleep`` moves it on at once, so the figures
    are exact (and the test takes no time)."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_first_batch_is_timed_from_iter_of_the_first_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(bench_methods, "time", clock)

    class Slow:
        """A loader whose start (workers, staging) takes 0.2 s and whose batches take 0.01 s."""

        def __init__(self) -> None:
            self.epochs = 0

        def __iter__(self) -> Iterator[list[int]]:
            self.epochs += 1
            clock.sleep(0.2)
            for k in range(5):
                clock.sleep(0.01)
                yield [k, k]

    rec = Recorder(batch_size=2, max_steps=8, seconds=None)
    loader = Slow()
    clock.sleep(0.3)  # before iter(loader): not part of the first batch
    drive(lambda epoch: loader, rec, compute_ms=0)
    f = Figures("x")
    rec.fill(f)
    assert loader.epochs == 2 and f.steps == 8
    assert f.first_batch_s == pytest.approx(0.21)  # the first epoch's start and its first batch only
    assert f.step100_mean_s is None and rec.step_at[0] == pytest.approx(0.51)
    # the second epoch's start counts as a step's wait, not as a first batch
    assert rec.step_at[5] - rec.step_at[4] == pytest.approx(0.21)


@pytest.mark.parametrize(
    ("method", "target", "kind"),
    [
        ("GET", "/data/train/0001.image", "GET"),
        ("GET", "/data/train/0001.image?x-id=GetObject", "GET"),
        ("GET", "/train/0001.image", "GET"),  # virtual-hosted
        ("HEAD", "/data/train/0001.image", "HEAD"),
        ("GET", "/data?list-type=2&prefix=train%2F&encoding-type=url", "LIST"),
        ("GET", "/data/?delimiter=%2F&prefix=", "LIST"),
        ("GET", "/?list-type=2", "LIST"),
        ("GET", "/", "LIST"),
        ("GET", "/data?location", "other"),
        ("PUT", "/data/train/0001.image", "other"),
        ("DELETE", "/data/train/0001.image", "other"),
        ("get", "http://127.0.0.1:8333/data/k", "GET"),  # an absolute target
    ],
)
def test_classify(method: str, target: str, kind: str) -> None:
    assert classify(method, target) == kind


def _feed_in_pieces(parser: RequestParser, data: bytes, size: int) -> None:
    for i in range(0, len(data), size):
        parser.feed(data[i : i + size])


@pytest.mark.parametrize("piece", [1, 7, 64, 100_000])
def test_request_parser_follows_bodies_and_kept_alive_connections(piece: int) -> None:
    fake = b"GET /data/fake HTTP/1.1\r\nHost: x\r\n\r\n"  # inside bodies: never a request
    stream = (
        b"GET /data/a HTTP/1.1\r\nHost: x\r\n\r\n"
        + b"PUT /data/b HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(fake)
        + fake
        + b"HEAD /data/a HTTP/1.1\r\n\r\n"
        + b"PUT /data/c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x;ext=1\r\n" % len(fake)
        + fake
        + b"\r\n"
        + b"3\r\nabc\r\n0\r\nx-trailer: 1\r\n\r\n"
        + b"GET /data?list-type=2&prefix=t HTTP/1.1\r\n\r\n"
    )
    counts: dict[str, int] = {}
    _feed_in_pieces(RequestParser(counts), stream, piece)
    assert counts == {"GET": 1, "other": 2, "HEAD": 1, "LIST": 1}


def test_request_parser_gives_up_on_what_is_not_http() -> None:
    counts: dict[str, int] = {}
    parser = RequestParser(counts)
    parser.feed(b"\x16\x03\x01 TLS hello\r\n\r\n")
    parser.feed(b"GET /data/a HTTP/1.1\r\n\r\n")  # the stream is not followed any more
    assert counts == {"unreadable": 1}


def _p(pid: int, kind: str, own: float, reaped: float = 0.0) -> ProcTimes:
    return ProcTimes((pid, 1.0), kind, own, reaped)


def test_cpu_split_follows_processes_that_end_between_samples() -> None:
    split = CpuSplit()
    split.add(1.0, 0.0, [_p(10, "workers", 0.5)])  # the start: only what comes after counts
    split.add(1.2, 0.0, [_p(10, "workers", 0.7), _p(11, "s5cmd", 0.4)])
    # s5cmd 11 ended and was reaped by the training process with 0.6 s: 0.2 s after its last sample
    split.add(1.3, 0.6, [_p(10, "workers", 0.8)])
    assert split.result() == pytest.approx({"main": 0.3, "workers": 0.3, "s5cmd": 0.6, "unattributed": 0.0})
    # a process that started and ended between two samples: nobody to give it to
    split.add(1.3, 0.9, [_p(10, "workers", 0.8)])
    assert split.result()["unattributed"] == pytest.approx(0.3)
    # the worker ends and is reaped, with an s5cmd child of its own it had reaped unseen
    split.add(1.4, 0.9 + 0.8 + 0.5, [])
    r = split.result()
    assert r == pytest.approx({"main": 0.4, "workers": 0.8, "s5cmd": 0.6, "unattributed": 0.3})
    assert sum(r.values()) == pytest.approx((1.4 + 2.2) - (1.0 + 0.5))


def test_cpu_split_of_a_grandchild_seen_alive() -> None:
    split = CpuSplit()
    split.add(0.0, 0.0, [])
    split.add(0.1, 0.0, [_p(20, "workers", 0.2), _p(21, "s5cmd", 0.5)])
    # s5cmd 21 (a worker's child) ended with 0.55 s, reaped by worker 20; worker still alive
    split.add(0.1, 0.0, [_p(20, "workers", 0.3, reaped=0.55)])
    r = split.result()
    assert r["s5cmd"] == pytest.approx(0.55) and r["workers"] == pytest.approx(0.3)
    assert r["unattributed"] == 0.0


def test_cpu_split_leaves_excluded_processes_out() -> None:
    split = CpuSplit()
    split.add(0.0, 0.0, [_p(30, "excluded", 5.0), _p(31, "workers", 0.0)])
    split.add(0.0, 0.0, [_p(30, "excluded", 5.4), _p(31, "workers", 0.3)])
    split.add(0.1, 5.6, [_p(31, "workers", 0.4)])  # the excluded one ended, reaped with 5.6 s
    assert split.result() == pytest.approx({"main": 0.1, "workers": 0.4, "s5cmd": 0.0, "unattributed": 0.0})


def test_wildcard_cover_names_exactly_the_needed_keys() -> None:
    keys = [f"train/{i:06d}.{f}" for i in range(1000) for f in ("image", "label")] + ["train/odd*key"]
    for count in (1, 2, 12, 137, 1000):
        needed = {f"train/{i:06d}.{f}" for i in range(count) for f in ("image", "label")}
        prefixes, singles = wildcard_cover(keys, needed, "train/")
        matched = {k for k in keys for p in prefixes if k.startswith(p)} | set(singles)
        assert matched == needed
        assert len(prefixes) <= 40  # wildcards, not one line per object
    prefixes, singles = wildcard_cover(keys, {"train/odd*key", "train/000003.image"}, "train/")
    assert singles == ["train/odd*key"] and prefixes == ["train/000003.image"]


def test_a_bulk_pass_that_completed_nothing_says_what_s5cmd_copied(tmp_path) -> None:
    done = bench_methods._Completions.__new__(bench_methods._Completions)
    done.fields, done.unmatched, done.unmatched_count = {"s3://b/p/000000.image": (0, 1)}, [], 0
    argv = ["s5cmd", "cp", "s3://b/p/*", "/dev/shm/x/"]
    none = bench_methods._copied_none(argv, [], done, str(tmp_path))
    assert "reported no copy at all" in none and str(tmp_path) in none and "MB free" in none
    done.unmatched, done.unmatched_count = ["s3://b/q/7.image"], 3
    other = bench_methods._copied_none(argv, ["/dev/shm/x/7.image"] * 3, done, str(tmp_path))
    assert "3 of them of objects that are not in the index (such as s3://b/q/7.image" in other
    assert "such as s3://b/p/000000.image" in other and "exited with code 0" in other
