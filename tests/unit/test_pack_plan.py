"""The plan of ``s5loader pack``, pure logic: options, member names, order, the cut into shards,
the fingerprint, the rank split; the shard writer's bytes; the disk gate.

Private modules (``s5loader._index``, ``s5loader._pack``, ``s5loader._shards``,
``s5loader._staging``) are imported on purpose: their own behaviour is what these tests check."""

from __future__ import annotations

import io
import os
import tarfile
import threading

import pytest
from support.waits import stays_false

from s5loader import BudgetError, ConfigError, UnsafeArchiveError
from s5loader._index.sample import Field, Sample
from s5loader._pack import plan as _plan
from s5loader._pack.pipeline import Gate
from s5loader._pack.shard import ShardWriter
from s5loader._shards import tar as _tar


def sample(key: str, *fields: tuple[str, int], extra: dict | None = None) -> Sample:
    return Sample(key, tuple(Field(f, f"s3://b/{key}.{f}", n, "e" * 32) for f, n in fields), extra)


def test_options_are_checked_and_sizes_parsed() -> None:
    o = _plan.PackOptions(shard_size="4MB", budget="1GiB")
    assert (o.shard_size, o.budget) == (4_000_000, 1024**3)
    for bad in (
        {"shard_size": 10},
        {"group_by": "x"},
        {"label": "y"},
        {"workers": 0},
        {"missing": "ignore"},
        {"seed": 1.5},
        {"index_timeout": 0},
    ):
        with pytest.raises(ConfigError):
            _plan.PackOptions(**bad)  # type: ignore[arg-type]
    # the speed options do not change what the shards hold
    assert _plan.PackOptions(workers=1).content() == _plan.PackOptions(workers=99, budget="1MB").content()
    assert _plan.PackOptions(seed=1).content() == _plan.PackOptions(seed=2).content()  # no shuffle: no seed
    assert (
        _plan.PackOptions(shuffle=True, seed=1).content() != _plan.PackOptions(shuffle=True, seed=2).content()
    )


@pytest.mark.parametrize(
    "key, field",
    [("0001", "jpg"), ("dir/0001", "seg.jpg"), ("d" * 300, "cls"), ("ünï/k", "json"), ("a/b/c", "JPG")],
)
def test_member_names_split_back_into_key_and_field(key: str, field: str) -> None:
    name = _plan.check_member(key, field, "s3://b/x")
    assert _tar.split_name(name) == (key, field.lower())


@pytest.mark.parametrize(
    "key, field, why",
    [
        ("a.b/0001.jpg", "data", "read back"),  # group_by="object": the key keeps its dot
        ("folder.1", "txt", "read back"),
        ("f", "sub/x.mp4", "read back"),  # a '/' in the field (group_by="folder" with sub-folders)
        ("../x", "jpg", "'..'"),
        ("/abs", "jpg", "absolute"),
        ("a//b", "jpg", "empty"),
        ("a\udcff", "jpg", "not UTF-8"),
        ("a\nb", "jpg", "line break"),
    ],
)
def test_unsafe_member_names_are_refused_naming_the_object(key: str, field: str, why: str) -> None:
    with pytest.raises(UnsafeArchiveError, match=why) as err:
        _plan.check_member(key, field, "s3://b/the-object")
    assert "s3://b/the-object" in str(err.value)


def test_plan_samples_relative_keys_labels_extras_and_collisions() -> None:
    planned = _plan.plan_samples(
        [sample("p/0001", ("jpg", 10), extra={"label": 3, "caption": "x"}), sample("p/0002", ("jpg", 5))],
        "p/",
    )
    assert [s.key for s in planned] == ["0001", "0002"]
    names = [m.name for m in planned[0].members]
    assert names == ["0001.jpg", "0001.cls", "0001.json"]
    assert planned[0].members[1].data == b"3" and planned[0].members[2].data == b'{"caption": "x"}'
    with pytest.raises(ConfigError, match="read back the same"):
        _plan.plan_samples([sample("k", ("jpg", 1), ("JPG", 1))], "")
    with pytest.raises(ConfigError, match="also the key"):
        _plan.plan_samples([sample("k", ("jpg", 1)), sample("k", ("png", 1))], "")


def test_order_is_seeded_and_a_permutation() -> None:
    assert list(_plan.order(5, False, 9)) == [0, 1, 2, 3, 4]
    a, b = _plan.order(1000, True, 1), _plan.order(1000, True, 1)
    assert list(a) == list(b) and sorted(a) == list(range(1000)) and list(a) != list(range(1000))
    assert list(_plan.order(1000, True, 2)) != list(a)


def test_cut_keeps_samples_whole_and_shards_within_size() -> None:
    sizes = [1000, 3000, 500, 500, 9000, 100, 100]
    cuts = _plan.cut(sizes, 5100)  # members + the tar's two end blocks
    assert cuts == [(0, 2), (2, 4), (4, 5), (5, 7)]  # the 9000 sample is a shard of its own
    assert [i for a, b in cuts for i in range(a, b)] == list(range(len(sizes)))  # each sample once, in order
    assert _plan.cut([], 100) == []


def test_member_bytes_match_what_the_writer_writes(tmp_path) -> None:
    members = [("0001.jpg", 700), ("d" * 150 + ".cls", 3), ("ünï.txt", 512)]
    path = str(tmp_path / "s.tar")
    with ShardWriter(path) as w:
        for name, n in members:
            w.add(name, name.split(".")[0], n, io.BytesIO(b"x" * n))
        body_end = w.offset
    assert body_end == sum(_plan.member_bytes(name, n) for name, n in members)
    planned = [_plan.PlannedSample("k", tuple(_plan.Member(n, "", s, "") for n, s in members))]
    assert w.size <= _plan.shard_bytes(planned)


def test_the_same_samples_make_the_same_bytes(tmp_path) -> None:
    def write(path: str | None) -> ShardWriter:
        with ShardWriter(path) as w:
            for i in range(5):
                w.add(f"{i:04d}.bin", f"{i:04d}", 100 + i, io.BytesIO(bytes([i]) * (100 + i)))
        return w

    a, b, measured = write(str(tmp_path / "a.tar")), write(str(tmp_path / "b.tar")), write(None)
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    assert a.md5 == b.md5 and a.size == b.size == measured.size and a.nsamples == 5
    samples = _tar.scan_bytes((tmp_path / "a.tar").read_bytes(), "a.tar")
    assert [s.key for s in samples] == [f"{i:04d}" for i in range(5)]


def _tarfile_bytes(members: list[tuple[str, bytes]]) -> bytes:
    """The tar Python's ``tarfile`` writes of ``members``, with the writer's metadata."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime, info.uid, info.gid = len(data), 0o644, 0, 0, 0
            info.uname = info.gname = ""
            t.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_the_writer_writes_the_bytes_tarfile_writes(tmp_path) -> None:
    members = [
        ("train/0001.jpg", b"\xff" * 700),
        ("0002.cls", b"3"),
        ("0003.empty", b""),
        ("b" * 96 + ".txt", b"x" * 512),  # 100 bytes: the most a plain header names
        ("d" * 150 + ".cls", b"7" * 3),  # longer: tarfile's pax record
        ("ünï/0004.txt", b"caf\xc3\xa9"),  # not ASCII: tarfile's pax record
        ("0005.big", os.urandom(1 << 21)),  # copied in more than one chunk
    ]
    with ShardWriter(str(tmp_path / "s.tar")) as w:
        for name, data in members:
            w.add(name, name.split(".")[0], len(data), io.BytesIO(data))
    assert (tmp_path / "s.tar").read_bytes() == _tarfile_bytes(members)
    with tarfile.open(tmp_path / "s.tar") as t:
        read = [(m.name, t.extractfile(m)) for m in t.getmembers()]
        assert [(name, f.read()) for name, f in read if f is not None] == members


def test_a_member_cut_short_is_named(tmp_path) -> None:
    from s5loader import FetchError

    with pytest.raises(FetchError, match="0001.jpg: fewer than its 10 bytes"), ShardWriter(None) as w:
        w.add("0001.jpg", "0001", 10, io.BytesIO(b"12345"))


def test_fingerprint_changes_with_samples_and_options() -> None:
    planned = _plan.plan_samples([sample("a", ("jpg", 1)), sample("b", ("jpg", 2))], "")
    o = _plan.PackOptions()
    fp = _plan.fingerprint(planned, o)
    assert fp == _plan.fingerprint(list(planned), _plan.PackOptions(workers=3))
    assert fp != _plan.fingerprint(planned[::-1], o)
    assert fp != _plan.fingerprint(planned, _plan.PackOptions(shard_size="1MB"))
    other = _plan.plan_samples([sample("a", ("jpg", 1)), sample("b", ("jpg", 3))], "")
    assert fp != _plan.fingerprint(other, o)


def test_ranks_pack_disjoint_shards_that_cover_all() -> None:
    for world in (1, 2, 3, 8):
        parts = [_plan.rank_shards(10, r, world) for r in range(world)]
        flat = sorted(s for p in parts for s in p)
        assert flat == list(range(10))
    assert _plan.ranks_of([1, 3, 4], 2) == [0, 1]


def test_overlapping_source_and_dest_are_refused() -> None:
    with pytest.raises(ConfigError, match="overlap"):
        _plan.check_places("s3://bk/raw/", "s3://bk/raw/shards/")
    with pytest.raises(ConfigError, match="overlap"):
        _plan.check_places("s3://bk/raw/x/", "s3://bk/raw/")
    _plan.check_places("s3://bk/raw/", "s3://bk/raw-shards/")
    _plan.check_places("s3://bk/raw/", "s3://ck/raw/")


def test_gate_holds_shards_within_the_budget_and_refuses_more_than_it() -> None:
    gate = Gate(100)
    with pytest.raises(BudgetError, match="more than the budget"):
        gate.acquire(250, lambda: False)  # never alone beyond it: the plan refused such a shard first
    assert gate.acquire(60, lambda: False)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(gate.acquire(50, lambda: False)))
    t.start()
    stays_false(lambda: got, 0.2, "60 + 50 > 100, yet the second acquire did not wait for the first")
    gate.release(60)
    t.join(5)
    assert got == [True] and gate.peak == 60
    assert gate.acquire(50, lambda: False) and gate.peak == 100
    assert not gate.acquire(50, lambda: True)  # told to give up


def test_a_shard_takes_its_tar_and_its_largest_object_once_more(tmp_path) -> None:
    """What a shard takes while it is built: every staged object, and the tar growing as they
    are copied in; each is deleted only once copied, so the largest is there twice at worst."""
    from s5loader._pack.shard import ShardWriter
    from s5loader._staging.area import tree_bytes

    sizes = [3000, 700, 9000, 40]
    planned = [
        _plan.PlannedSample(f"{i:04d}", (_plan.Member(f"{i:04d}.bin", "", n, ""),))
        for i, n in enumerate(sizes)
    ]
    assert _plan.disk_bytes(planned) == _plan.shard_bytes(planned) + 9000
    staged = tmp_path / "staged"
    staged.mkdir()
    for i, n in enumerate(sizes):
        (staged / f"{i}").write_bytes(b"x" * n)
    most = tree_bytes(str(tmp_path))
    with ShardWriter(str(tmp_path / "s.tar")) as w:
        for i, p in enumerate(planned):
            path = str(staged / f"{i}")
            with open(path, "rb") as f:
                w.add(p.members[0].name, p.key, sizes[i], f)
                most = max(most, tree_bytes(str(tmp_path)))  # copied in, not yet deleted
            os.unlink(path)
    assert most <= _plan.disk_bytes(planned) and most > _plan.shard_bytes(planned) - 9000


def test_budget_check_names_the_sample_or_the_shard_that_cannot_fit() -> None:
    samples = [sample(f"{i:03d}", ("jpg", 3000), ("cls", 1)) for i in range(10)] + [
        sample("big", ("bin", 50_000))
    ]
    planned = _plan.plan_samples(samples, "")
    order = _plan.order(len(planned), False, 0)
    cuts = _plan.cut([planned[i].tar_bytes for i in order], 20_000)
    need = _plan.disk_bytes(planned[-1:])
    with pytest.raises(
        BudgetError,
        match=rf"s3://b/big.bin: its sample 'big' takes .*\({need} bytes\).*"
        r"budget of 48.8 KiB \(50000 bytes\)",
    ):
        _plan.check_budget(planned, order, cuts, 50_000, "s3://b/out/")
    small = planned[:10]
    cuts = _plan.cut([p.tar_bytes for p in small], 20_000)
    worst = max(_plan.disk_bytes(small[a:b]) for a, b in cuts)
    with pytest.raises(BudgetError, match=r"s3://b/out/shard-00000\d.tar takes .*smaller --shard-size"):
        _plan.check_budget(small, order[:10], cuts, worst - 1, "s3://b/out/")
    _plan.check_budget(small, order[:10], cuts, worst, "s3://b/out/")  # fits exactly


def test_whole_blocks_come_with_wildcard_lines_and_small_samples_with_raw_lines() -> None:
    from s5loader._index.blocks import plan_blocks
    from s5loader._pack.pipeline import Packer

    samples = [sample(f"t/{i:03d}", ("image", 10), ("label", 1)) for i in range(20)]
    # a sample of 13 objects under a prefix of its own: its LIST costs less than 13 HEADs
    samples[13] = sample("t/013", *((f"f{k:02d}", 5) for k in range(13)))
    listing = [f.uri[len("s3://b/") :] for s in samples for f in s.fields]
    blocks = plan_blocks(samples, 10, listing)
    planned = _plan.plan_samples(samples, "t/")
    packer = Packer(None, None, None, None, "raise", 4, lambda n, b: None, blocks)  # type: ignore[arg-type]
    numbers = list(range(15))  # the whole block t/00* (20 objects), half of t/01*
    lines, dests, where = packer._lines(numbers, [planned[n] for n in numbers], "/w/000000")
    assert lines[0] == "cp --exclude '*..*' 's3://b/t/00*' /w/000000/b0/\n"
    assert where[0, 0] == ("/w/000000/b0/000.image", "s3://b/t/000.image")
    # a sample of two objects: a cp --raw line each (two HEADs cost less than a LIST)
    assert sum(line.startswith("cp --raw") for line in lines) == 8
    assert where[12, 1] == ("/w/000000/12.1", "s3://b/t/012.label")
    assert "cp --exclude '*..*' 's3://b/t/013.f*' /w/000000/s13/\n" in lines
    assert len(lines) == 10
    # no listing (a manifest): one cp --raw line per object, named by position
    plain = Packer(None, None, None, None, "raise", 4, lambda n, b: None, None)  # type: ignore[arg-type]
    lines, _, where = plain._lines([0, 1], planned[:2], "/w/x")
    assert len(lines) == 4 and where[1, 0] == ("/w/x/1.0", "s3://b/t/001.image")


def test_an_archive_shard_is_marked_done_only_once_its_volumes_are_checked() -> None:
    from types import SimpleNamespace

    from s5loader._pack.split_archive import ArchivePacker

    marked: list[int] = []
    state = SimpleNamespace(mark_done=lambda shard, entry: marked.append(shard))
    packer = SimpleNamespace(state=state, on_shard=lambda n, size: None)
    archive = ArchivePacker(packer, 1000, Gate(10_000), set(), "s3://bk/a.tar.")  # type: ignore[arg-type]
    stream = SimpleNamespace(index=1)  # reading volume 1: volume 0 is checked
    archive._stream = stream
    entry = {"nsamples": 1, "filesize": 10}
    archive._unmarked = [(0, 0, entry), (1, 1, entry), (1, 2, entry), (2, 3, entry)]
    archive.mark(final=False)
    assert marked == [0]  # shards whose bytes came from volume 1 wait for its check
    stream.index = 2
    archive.mark(final=False)
    assert marked == [0, 1, 2]
    archive.mark(final=True)  # the end: every volume read and checked
    assert marked == [0, 1, 2, 3]
    archive.close()
