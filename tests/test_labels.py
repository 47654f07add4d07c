"""ImageFolder layouts: label="folder" gives torchvision's classes and labels; groupings that do
not fit the layout are warned about."""

from __future__ import annotations

import json
import logging

import pytest
from support.stores import Store
from torch.utils.data import DataLoader

from s5loader import S5Dataset, S5Sampler
from s5loader.exceptions import ConfigError

# An ImageFolder layout: class folders (not in sorted order of creation), mixed .jpg/.JPEG.
LAYOUT = {
    "zebra/z1.JPEG": b"z1",
    "zebra/z2.jpg": b"z2",
    "Ant/a1.jpg": b"a1",
    "cat/c1.JPEG": b"c1",
    "cat/c2.jpg": b"c2",
    "cat/sub/c3.jpg": b"c3",  # ImageFolder finds images in sub-folders of a class too
}


def torchvision_classes(keys: list[str]) -> tuple[list[str], dict[str, int]]:
    """torchvision's documented rule: classes are the sorted class folder names and
    class_to_idx = {name: i}."""
    classes = sorted({k.split("/", 1)[0] for k in keys})
    return classes, {c: i for i, c in enumerate(classes)}


def collate(batch: list[dict]) -> list[dict]:
    return batch


def test_from_prefix_labels_like_imagefolder(seaweed: Store, staging_root: str) -> None:
    seaweed.put(LAYOUT)
    classes, class_to_idx = torchvision_classes(list(LAYOUT))
    ds = S5Dataset.from_prefix(
        seaweed.uri(), endpoint_url=seaweed.endpoint, group_by="object", label="folder"
    )
    assert ds.classes == classes == ["Ant", "cat", "zebra"]
    assert ds.class_to_idx == class_to_idx
    with S5Sampler(ds, staging_dir=staging_root, batch_size=2) as sampler:
        got = [
            s
            for b in DataLoader(ds, sampler=sampler, batch_size=2, num_workers=2, collate_fn=collate)
            for s in b
        ]
    assert len(got) == len(LAYOUT)
    for s in got:
        rel = s["__key__"][len(seaweed.prefix) :]
        assert s["data"] == LAYOUT[rel]
        assert s["label"] == class_to_idx[rel.split("/", 1)[0]]
        assert type(s["label"]) is int


def test_stem_grouping_labels_and_warns_of_mixed_case(
    seaweed: Store, caplog: pytest.LogCaptureFixture
) -> None:
    seaweed.put(LAYOUT)
    _, class_to_idx = torchvision_classes(list(LAYOUT))
    with caplog.at_level(logging.WARNING, logger="s5loader"):
        ds = S5Dataset.from_prefix(
            seaweed.uri(), endpoint_url=seaweed.endpoint, group_by="stem", label="folder"
        )
    assert "mixes cases" in caplog.text and "'JPEG'" in caplog.text and "'jpg'" in caplog.text
    assert {ds[i]["__key__"][len(seaweed.prefix) :]: ds[i]["label"] for i in range(len(ds))} == {
        k.rpartition(".")[0]: class_to_idx[k.split("/", 1)[0]] for k in LAYOUT
    }


def test_folder_grouping_of_class_folders_is_warned_about(
    moto: Store, caplog: pytest.LogCaptureFixture
) -> None:
    moto.put({f"c{c}/{i:03d}.jpg": b"x" for c in range(2) for i in range(30)})
    with caplog.at_level(logging.WARNING, logger="s5loader"):
        ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint, group_by="folder")
    assert len(ds) == 2
    assert "made 2 sample(s) of 60 objects" in caplog.text and "label='folder'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="s5loader"):
        S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint, group_by="object", label="folder")
    assert caplog.text == ""  # the right grouping is quiet


def test_objects_and_manifest_take_the_parent_folder(moto: Store, tmp_path) -> None:
    moto.put(LAYOUT)
    uris = [moto.uri(k) for k in LAYOUT]
    by_objects = S5Dataset.from_objects(uris, endpoint_url=moto.endpoint, label="folder")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(u) + "\n" for u in uris))
    by_manifest = S5Dataset.from_manifest(str(manifest), endpoint_url=moto.endpoint, label="folder")
    # the folder that holds each object: cat/sub/c3.jpg is in class "sub" here
    parents = sorted({k.rsplit("/", 1)[0].rsplit("/", 1)[-1] for k in LAYOUT})
    for ds in (by_objects, by_manifest):
        assert ds.classes == parents
        for i in range(len(ds)):
            s = ds[i]
            assert ds.classes[s["label"]] == s["__key__"].rsplit("/", 2)[-2]


def test_label_conflicts_and_bad_values_are_clear(moto: Store) -> None:
    moto.put({"cat/0001.image": b"i", "cat/0001.label": b"3"})
    with pytest.raises(ConfigError, match="already has a field 'label'"):
        S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint, group_by="stem", label="folder")
    with pytest.raises(ConfigError, match="label must be None or one of folder"):
        S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint, label="class")
    with pytest.raises(ConfigError, match="group_by='folder'"):
        S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint, group_by="folder", label="folder")
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint)
    assert (ds.classes, ds.class_to_idx) == ([], {})


def test_labels_survive_a_saved_index_and_pickling(moto: Store, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import pickle

    moto.put(LAYOUT)
    ds = S5Dataset.from_prefix(moto.uri(), endpoint_url=moto.endpoint, group_by="object", label="folder")
    labels = [ds[i]["label"] for i in range(len(ds))]
    assert sorted(set(labels)) == [0, 1, 2]
    path = str(tmp_path / "index.s5i")
    ds.save_index(path)
    for again in (S5Dataset.from_index(path, endpoint_url=moto.endpoint), pickle.loads(pickle.dumps(ds))):
        assert again.classes == ds.classes and again.class_to_idx == ds.class_to_idx
        assert [again[i]["label"] for i in range(len(again))] == labels
