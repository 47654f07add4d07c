"""Blocks without a server: samples that share a key prefix are planned as one wildcard line,
which never covers the objects of another sample.

Private modules (``s5loader._index``) are imported on purpose: their own behaviour is what these
tests check."""

from __future__ import annotations

from support.stores import Store, make_pairs, scratch_folders, staged_samples  # noqa: F401

from s5loader._index.blocks import plan_blocks
from s5loader._index.sample import Field, Sample


def samples_of(keys: list[str], fields=("image", "label")) -> list[Sample]:
    return [Sample(k, tuple(Field(f, f"s3://b/{k}.{f}", 1, "") for f in fields)) for k in keys]


def listing_of(samples: list[Sample]) -> list[str]:
    return [f.uri[7:] for s in samples for f in s.fields]


def test_numbered_keys_form_blocks_of_their_decade() -> None:
    samples = samples_of([f"train/{i:05d}" for i in range(2000)])
    layout = plan_blocks(samples, 64, listing_of(samples))
    assert len(layout.blocks) == 200
    blk = layout.blocks[12]
    assert (blk.start, blk.stop, blk.wildcard) == (120, 130, "s3://b/train/0012*")
    assert blk.rels[0] == ("00120.image", "00120.label")
    assert all(b >= 0 for b in layout.block_of)
    units = layout.units
    assert sorted(i for u in units for i in u) == list(range(2000))


def test_block_never_covers_objects_of_other_samples() -> None:
    # "a1" and "a10" share the prefix "train/a1": a block "train/a1*" would also match a10's
    keys = ["train/a1", "train/a10", "train/a11", "train/b"]
    layout = plan_blocks(samples_of(keys), 2, listing_of(samples_of(keys)))
    assert layout.blocks  # else the loop below checks nothing
    for blk in layout.blocks:
        prefix = blk.prefix
        covered = [k for k in keys for f in ("image", "label") if f"{k}.{f}".startswith(prefix)]
        assert len(covered) == 2 * len(blk)


def test_unsafe_keys_get_no_block() -> None:
    keys = ["d/x*y", "d/q'uote", "d/../up", "d/sp ace", "d/.hidden", "d/a..b"]
    layout = plan_blocks(samples_of(keys), 8, listing_of(samples_of(keys)))
    for b in layout.block_of:
        if b >= 0:
            assert all(part not in layout.blocks[b].prefix for part in ("*", ".."))
            assert " " not in "".join(layout.blocks[b].rels[0]) and "'" not in "".join(
                layout.blocks[b].rels[0]
            )
    assert layout.block_of[0] == -1 and layout.block_of[2] == -1 and layout.block_of[5] == -1


def test_objects_outside_the_samples_keep_blocks_exact() -> None:
    # README is left out by stem grouping, but a wildcard over train/ would fetch it
    samples = samples_of(["train/apple", "train/berry", "train/cherry"])
    listing = [*listing_of(samples), "train/README", "train/sub/"]
    layout = plan_blocks(samples, 8, listing)
    assert all(not blk.prefix == "train/" for blk in layout.blocks)
    for blk in layout.blocks:
        assert [k for k in listing if k.startswith(blk.prefix)] == [
            k for i in range(blk.start, blk.stop) for k in listing_of([samples[i]])
        ]
    assert plan_blocks(samples, 8, None).blocks == []  # no listing (manifest): no blocks


def test_numbered_one_object_samples_form_blocks_of_their_hundred() -> None:
    # a decade of one-object samples is 10 objects, too few for a wildcard line to pay for its
    # LIST (13): the hundred around them, within twice block_size, is one block instead
    samples = samples_of([f"raw/{i:06d}" for i in range(300)], fields=("bin",))
    layout = plan_blocks(samples, 64, listing_of(samples))
    assert [(b.start, b.stop, b.wildcard) for b in layout.blocks] == [
        (0, 100, "s3://b/raw/0000*"),
        (100, 200, "s3://b/raw/0001*"),
        (200, 300, "s3://b/raw/0002*"),
    ]
    # more than twice block_size: the decades again, though they do not pay
    layout = plan_blocks(samples, 32, listing_of(samples))
    assert len(layout.blocks) == 30 and max(len(b) for b in layout.blocks) == 10


def test_parts_that_pay_are_not_grown_into_their_prefix() -> None:
    # two objects a sample: a decade is 20 objects, which pays; hex keys: 16 a part, which pays
    two = samples_of([f"raw/{i:06d}" for i in range(300)])
    assert max(len(b) for b in plan_blocks(two, 64, listing_of(two)).blocks) == 10
    hexed = samples_of([f"raw/{i:04x}" for i in range(512)], fields=("bin",))
    assert max(len(b) for b in plan_blocks(hexed, 64, listing_of(hexed)).blocks) == 16


def test_a_daemon_state_from_before_its_block_rule_continues_only_over_blocks_cut_alike() -> None:
    from s5loader._daemon.cache_state import DaemonState
    from s5loader._index.blocks import GROW, block_count

    singles = samples_of([f"raw/{i:06d}" for i in range(300)], fields=("bin",))
    assert block_count(singles, 64, listing_of(singles)) == (3, True)  # hundreds: grown
    pairs = samples_of([f"raw/{i:06d}" for i in range(300)])
    assert block_count(pairs, 64, listing_of(pairs)) == (30, False)  # decades of 20 objects

    def state(rule: int | None) -> DaemonState:
        return DaemonState("s3://b/raw/", "stem", "block", 0, 1, 300, "fp", block_size=64, block_rule=rule)

    assert state(None).differences(state(GROW), lambda: False) == []  # cut alike before: it goes on
    assert state(None).differences(state(GROW), lambda: True) == [f"block_rule None (now {GROW})"]
    assert state(1).differences(state(GROW)) == [f"block_rule 1 (now {GROW})"]
