"""Labels from the layout (torchvision's ImageFolder: ``PREFIX/<class>/<image>``) and the
warnings for groupings that most likely do not fit the layout.

Both work on the compact index (:class:`~s5loader._index.compact.SampleIndex`) without building a
Python object per sample: a label is one int32 column of the index.
"""

from __future__ import annotations

import logging

import numpy as np

from ..exceptions import ConfigError
from .compact import SampleIndex

log = logging.getLogger(__name__)

LABELS = ("folder",)
# More objects per sample than this, on average, is the folder-per-class mistake.
_MANY_FIELDS = 20
# Distinct field names are collected from at most this many objects (evenly spread).
_NAME_SAMPLE = 200_000


def check_label(label: str | None) -> str | None:
    if label is not None and label not in LABELS:
        raise ConfigError(f"label must be None or one of {', '.join(LABELS)}; got {label!r}")
    return label


def folder_labels(index: SampleIndex, base: str | None, source: str = "") -> tuple[SampleIndex, list[str]]:
    """Label each sample with its class folder, as torchvision's ``ImageFolder`` does.

    The class of a sample is the first folder below ``base`` on its key (``train/cat/1.jpg``
    under ``train/`` is ``cat``), or, for object lists and manifests (``base`` None), the
    folder that holds it. Classes are the sorted folder names; each sample gets ``"label"``,
    its class's index. Samples in no class folder are left out with a warning
    (``ImageFolder`` ignores files beside the class folders).

    Returns:
        the labelled index (a ``label`` column) and the classes.

    Raises:
        ConfigError: a sample already has a field or manifest key named ``label``.
    """
    names: list[str | None] = []
    for i in range(len(index)):
        key = index.key(i)
        if base is not None:
            rel = key[len(base) :] if key.startswith(base) else key
            cls, slash, _ = rel.partition("/")
            names.append(cls if slash and cls else None)
        else:
            head, slash, _ = key.rpartition("/")
            names.append(head.rpartition("/")[2] if slash and head else None)
    _check_no_label_field(index)
    classes = sorted({n for n in names if n is not None})
    class_to_idx = {c: i for i, c in enumerate(classes)}
    labels = np.fromiter(
        (class_to_idx.get(n, -1) if n is not None else -1 for n in names), np.int32, len(names)
    )
    keep = labels >= 0
    if not keep.all():
        left_out = [index.key(int(i)) for i in np.flatnonzero(~keep)[:3]]
        log.warning(
            "label='folder' left out %d sample(s) of %s that lie in no class folder, e.g. %s",
            int((~keep).sum()),
            source or "the source",
            ", ".join(left_out),
        )
        # rare (files beside the class folders): rebuild the index from the kept samples
        kept = [index[int(i)] for i in np.flatnonzero(keep)]
        index = SampleIndex.from_samples(kept, index.meta)
        labels = labels[keep]
    index.set_column("label", labels)
    index.meta["classes"] = classes
    return index, classes


def _check_no_label_field(index: SampleIndex) -> None:
    for i in index.extras_at():
        extra = index.extra(i)
        if extra and "label" in extra:
            raise ConfigError(
                f"sample {index.key(i)!r} ({index.field(int(index.first[i])).uri}) already has a "
                "field 'label' (a manifest key); label='folder' would hide it (leave label=None and "
                "read it yourself)"
            )
    for j, name in _field_names(index, all_of_them=True):
        if name == "label":
            i = int(np.searchsorted(index.first, j, side="right")) - 1
            raise ConfigError(
                f"sample {index.key(i)!r} ({index.field(j).uri}) already has a field 'label'; "
                "label='folder' would hide it (leave label=None and read it yourself)"
            )


def _field_names(index: SampleIndex, all_of_them: bool = False) -> list[tuple[int, str]]:
    n = len(index.size)
    step = 1 if all_of_them or n <= _NAME_SAMPLE else n // _NAME_SAMPLE
    return [(j, index.field_name(j)) for j in range(0, n, step)]


def warn_grouping(index: SampleIndex, group_by: str, source: str) -> None:
    """Warn about groupings that most likely do not fit the layout: far fewer samples than
    objects (one sample per class folder), or stem fields named by extensions of mixed case
    (``jpg`` and ``JPEG`` in one set)."""
    n_objects, n = len(index.size), len(index)
    if n and n_objects >= 2 * _MANY_FIELDS and n_objects > _MANY_FIELDS * n:
        log.warning(
            "group_by=%r made %d sample(s) of %d objects in %s (%.0f objects per sample): if the "
            "folders are classes (an ImageFolder layout, train/<class>/<image>), use "
            "group_by='object', label='folder'",
            group_by,
            n,
            n_objects,
            source or "the source",
            n_objects / n,
        )
    if group_by != "stem":
        return
    _warn_folder_samples(index, source)
    counts: dict[str, int] = {}
    for _, name in _field_names(index):
        counts[name] = counts.get(name, 0) + 1
    if any(c != c.lower() for c in counts) and any(c == c.lower() and c.upper() != c for c in counts):
        log.warning(
            "group_by='stem' names fields by extension, case included, and %s mixes cases: %s; a "
            "sample has only the field of its own extension, so read e.g. sample.get('jpg') or "
            "sample.get('JPEG'), or use group_by='object' (field 'data')",
            source or "the source",
            ", ".join(f"{c!r} ({k})" for c, k in sorted(counts.items())),
        )


# group_by="stem" over folder-per-sample data (video/clip1/text.txt + video/clip1/video.mp4):
# nearly every sample has one field, and the same few file names recur in folder after folder.
_ONE_FIELD_SHARE = 0.9
_KEYS_LOOKED_AT = 2000


def _warn_folder_samples(index: SampleIndex, source: str) -> None:
    n = len(index)
    if n < 4 or float((index.field_counts() == 1).mean()) < _ONE_FIELD_SHARE:
        return
    step = max(1, n // _KEYS_LOOKED_AT)
    folders: set[str] = set()
    names: dict[str, int] = {}
    for i in range(0, n, step):
        folder, _, stem = index.key(i).rpartition("/")
        folders.add(folder)
        names[stem] = names.get(stem, 0) + 1
    looked = len(range(0, n, step))
    # the same stem in most folders, and folders of a few files each: one sample per folder
    if len(folders) >= 2 and len(names) * 4 <= looked and max(names.values()) * 2 >= len(folders):
        common = ", ".join(sorted(names, key=lambda k: -names[k])[:3])
        log.warning(
            "group_by='stem' made %d samples of one file each in %s, and the same file names (%s) "
            "recur in folder after folder: if each folder is one sample (clip1/text.txt + "
            "clip1/video.mp4), use group_by='folder' (s5loader prefetch: --group-by folder)",
            n,
            source or "the source",
            common,
        )
