"""How class-sorted tar shards mix, through the real path: the real s5cmd against SeaweedFS,
DataLoader workers, the sampler and the iterable dataset against WebDataset's shuffle buffer
holding the same bytes; every sample once, the budget on disk, the warning of a budget that holds
few shards, and a resumed order that counts what its samples give back."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
from support.shards import class_sorted_shards, leftovers
from support.stores import Peak, Store, on_disk
from torch.utils.data import DataLoader

from s5loader import S5Dataset, S5IterableDataset, S5Sampler, StateError, parse_size
from s5loader._sampling import units

SHARDS, PER_SHARD, SIZE = 40, 250, 3000  # ~3 kB samples, one class per shard
BUFFER, WORKERS, BATCH = 1000, 2, 32


def per_64(classes: list[int]) -> float:
    runs = [classes[a : a + 64] for a in range(0, len(classes) - 63, 64)]
    return sum(len(set(r)) for r in runs) / len(runs)


def webdataset_classes(shards: dict[str, bytes], folder: Path) -> list[int]:
    import webdataset as wds

    paths = []
    for name, data in sorted(shards.items()):
        (folder / name).write_bytes(data)
        paths.append(str(folder / name))
    ds = wds.WebDataset(paths, shardshuffle=len(paths), seed=0, empty_check=False).shuffle(BUFFER)
    loader = DataLoader(
        ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=lambda b: [int(x["cls"]) for x in b]
    )
    return [c for b in loader for c in b]


def test_class_sorted_shards_mix_as_well_as_webdataset_with_the_same_bytes_every_sample_once(
    seaweed: Store, staging_root: str, tmp_path: Path
) -> None:
    source, shards, big = class_sorted_shards(seaweed, SHARDS, PER_SHARD, SIZE)
    reference = webdataset_classes(shards, tmp_path)
    # the bytes of WebDataset's buffers: a buffer of BUFFER samples in each of the WORKERS workers
    budget = WORKERS * BUFFER * big // PER_SHARD
    everything = sorted(f"c{s}-{j:03d}" for s in range(SHARDS) for j in range(PER_SHARD))
    ds = S5Dataset.from_shards(source, endpoint_url=seaweed.endpoint)
    figures = {}
    with S5Sampler(ds, shuffle=True, seed=0, budget=budget, staging_dir=staging_root) as sampler:
        quality = sampler.shuffle_quality(span=BATCH)  # from the order alone
        loader = DataLoader(
            ds, sampler=sampler, batch_size=BATCH, num_workers=WORKERS, collate_fn=lambda b: b
        )
        with Peak(lambda: on_disk(sampler.staging_dir)) as peak:
            got = [x for b in loader for x in b]
        assert leftovers(sampler.staging_dir) == []
    assert sorted(x["__key__"] for x in got) == everything  # every sample once
    figures["sampler"] = [int(x["cls"]) for x in got]
    assert quality.units_per_64 == pytest.approx(per_64(figures["sampler"])) and quality.first_units >= 6
    assert 0 < peak.peak <= budget + 40 * 4096, (peak.peak, budget)  # whole blocks on disk
    with S5IterableDataset(
        ds,
        shuffle=True,
        seed=0,
        budget=budget,
        staging_dir=staging_root,
        batch_size=BATCH,
        num_workers=WORKERS,
    ) as it:
        with Peak(lambda: on_disk(staging_root)) as peak:
            got = [
                x
                for b in DataLoader(it, batch_size=BATCH, num_workers=WORKERS, collate_fn=lambda b: b)
                for x in b
            ]
        assert leftovers(staging_root) == []
    assert sorted(x["__key__"] for x in got) == everything
    figures["iterable"] = [int(x["cls"]) for x in got]
    assert 0 < peak.peak <= budget + 40 * 4096, (peak.peak, budget)
    for (
        form,
        classes,
    ) in figures.items():  # at the same bytes: 90% of WebDataset's mixing, a first batch better
        assert per_64(classes) >= 0.9 * per_64(reference), (form, per_64(classes), per_64(reference))
        assert len(set(classes[:64])) >= len(set(reference[:64])), form
    with S5Sampler(
        ds, shuffle=True, seed=0, staging_dir=staging_root
    ) as sampler:  # the default budget: all fit
        quality = sampler.shuffle_quality(span=64)
    assert quality.units_per_64 >= per_64(reference) and quality.first_units >= len(set(reference[:64]))


def test_a_budget_that_holds_few_shards_warns_at_iter_naming_one_that_mixes_like_a_buffer(
    seaweed: Store, staging_root: str
) -> None:
    source, _, big = class_sorted_shards(seaweed, 16, 50, SIZE)
    ds = S5Dataset.from_shards(source, endpoint_url=seaweed.endpoint)
    with S5Sampler(ds, shuffle=True, budget=3 * big, staging_dir=staging_root) as sampler:
        assert sampler.shuffle_quality(span=64).first_units >= 2  # three shards: the first batch mixes
        with pytest.warns(
            UserWarning,
            match=r"holds about 3 of its shards .* A budget of ([\d.]+ \w+) mixes at least "
            r"like that buffer.*`s5loader pack --shuffle`",
        ) as caught:
            it = iter(sampler)
            next(it)
        it.close()
    named = parse_size(re.search(r"A budget of ([\d.]+ \w+)", str(caught[0].message))[1].replace(" ", ""))
    assert 3 * big < named < 16 * 50 * big
    with S5IterableDataset(ds, shuffle=True, budget=3 * big, staging_dir=staging_root) as it:
        with pytest.warns(UserWarning, match=r"S5IterableDataset\(shuffle=True\) .* A budget of"):
            next(iter(it))
    for make in (
        lambda b: S5Sampler(ds, shuffle=True, budget=b, staging_dir=staging_root),
        lambda b: S5IterableDataset(ds, shuffle=True, budget=b, staging_dir=staging_root),
    ):
        with make(named) as loader, warnings.catch_warnings():
            warnings.simplefilter("error")  # the named budget: no warning
            next(iter(loader))
    with (
        S5Sampler(ds, shuffle=False, budget=3 * big, staging_dir=staging_root) as sampler,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("error")  # shard order on purpose: nothing to say
        next(iter(sampler))


def test_a_state_saved_mid_epoch_resumes_the_order_that_counted_what_was_read(
    seaweed: Store, staging_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, _, big = class_sorted_shards(seaweed, 12, 20, SIZE)
    ds = S5Dataset.from_shards(source, endpoint_url=seaweed.endpoint)
    opts = {"shuffle": True, "seed": 3, "budget": 4 * big, "staging_dir": staging_root}
    with S5Sampler(ds, **opts) as s:
        s.set_epoch(1)
        whole = [ds[i]["__key__"] for i in s]
    with S5Sampler(ds, **opts) as s:
        s.set_epoch(1)
        it = iter(s)
        head = [ds[next(it)]["__key__"] for _ in range(97)]
        state = s.state_dict()
        it.close()
    assert state["room"] == 3 * big  # the budget less a largest shard
    with S5Sampler(ds, **{**opts, "budget": 9 * big}) as s:  # another budget: the saved order goes on
        s.load_state_dict(state)
        rest = [ds[i]["__key__"] for i in s]
        assert leftovers(s.staging_dir) == []
    assert head + rest == whole and len(set(whole)) == 240
    with S5Sampler(ds, **{**opts, "epoch_cache": 4 * big}) as s:  # the cache keeps the order
        s.load_state_dict(state)
        assert [ds[i]["__key__"] for i in s] == rest
    with monkeypatch.context() as m:  # a staging directory that cannot punch holes keeps shards whole
        m.setattr(units, "punches_holes", lambda folder, most: False)
        with S5Sampler(ds, **opts) as s:
            with pytest.raises(StateError, match="counts the bytes its samples give back"):
                s.load_state_dict(state)


def test_the_shards_of_a_shuffled_pack_draw_no_mixing_warning(
    seaweed: Store, staging_root: str, tmp_path
) -> None:
    import s5loader

    seaweed.put({f"c{c}/{i:03d}.jpg": bytes([c]) * 2000 for c in range(6) for i in range(10)})
    made = {}
    for shuffled in (True, False):
        dest = seaweed.uri().replace("/train/", f"/packed-{shuffled}/")
        s5loader.pack(
            seaweed.uri(),
            dest,
            shard_size="12KB",
            shuffle=shuffled,
            label="folder",
            endpoint_url=seaweed.endpoint,
            staging_dir=str(tmp_path),
        )
        made[shuffled] = S5Dataset.from_shards(dest, endpoint_url=seaweed.endpoint)
    big = max(sh.size for sh in made[True].shards)
    assert made[True].shards.meta.get("shuffled") and not made[False].shards.meta.get("shuffled")
    with S5Sampler(made[True], shuffle=True, budget=3 * big, staging_dir=staging_root) as sampler:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the index says pack --shuffle mixed them: nothing to say
            next(iter(sampler))
    with S5Sampler(made[False], shuffle=True, budget=3 * big, staging_dir=staging_root) as sampler:
        with pytest.warns(UserWarning, match=r"`s5loader pack --shuffle`"):
            next(iter(sampler))
