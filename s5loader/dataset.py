"""S5Dataset: a map-style dataset of S3 samples that reads what S5Sampler staged."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch.utils.data import Dataset

from ._index import sources as _sources
from ._index.compact import SampleIndex
from ._index.sample import DISK, Sample
from ._index.share import shared_object
from ._shards.index import Shard, load_shards
from ._shards.shardset import ShardSet
from ._staging.plainindex import PlainIndices
from ._staging.reader import ObjectReader, announce_early
from ._staging.reader import StagedIndex as StagedIndex  # the index type samplers yield
from .config import Access
from .decode import decode
from .exceptions import EmptySourceError

log = logging.getLogger(__name__)

Transform = Callable[[dict[str, Any]], Any]


class S5Dataset(Dataset[Any]):
    """Samples in S3, each a dict ``{"__key__": key, FIELD: bytes, ...}``.

    ``dataset[i]``, for an index ``i`` an :class:`~s5loader.S5Sampler` yielded, reads the
    sample's files from that sampler's staging directory (for one of the first samples of a
    pass, which the sampler hands out before they are staged, once they are, raising the
    sampler's error if staging fails), and deletes them right after
    reading (the releaser: inline, so the budget is freed at once and nothing is left when a
    DataLoader worker exits). Any number of samplers may share one dataset; each index says
    where its sample was staged. For any other index (no sampler, another sampler), or when a
    file is not staged, it fetches the sample directly from S3, so the dataset works with any
    sampler.

    Build one with :meth:`from_prefix`, :meth:`from_objects`, :meth:`from_manifest` or
    :meth:`from_shards` (tar shards in the WebDataset format).
    """

    #: The tar shards of a data set made by :meth:`from_shards` (a sequence of shards that
    #: also locates samples in them and reads them); None for objects.
    shards: ShardSet | None = None

    def __init__(
        self,
        samples: Sequence[Sample],
        *,
        endpoint_url: str | None = None,
        transform: Transform | None = None,
        source: str = "",
        decode: bool = False,
        access: Access | None = None,
        shards: ShardSet | None = None,
    ) -> None:
        #: How the store is reached, by the sampler's s5cmd calls and the direct GETs alike.
        self.access = Access.coerce(access, endpoint_url)
        # What the engine stages (the index: samples, or one unit per shard) and how a sample
        # is read: the one place where raw objects and tar shards part ways.
        units = shards.units if shards is not None else samples
        self._reader: ObjectReader | ShardSet = shards if shards is not None else ObjectReader(len(samples))
        if not units:
            raise EmptySourceError(f"no sample in {source or 'the given objects'}")
        self.shards = shards
        self._samples = SampleIndex.from_samples(units, {"source": source})
        disk = self._reader.disk
        if disk is not None:  # compressed shards: staged, they take more than their objects
            self._samples.set_column(DISK, disk)
        self.transform = transform
        self.decode = bool(decode)
        # the staging directories of the S5Samplers over this dataset (see staging/plainindex.py)
        self._plain = PlainIndices()
        self.source = source
        #: Class names (sorted folder names) with ``label="folder"``, as torchvision's ImageFolder;
        #: over tar shards, those their index names (``s5loader pack --label folder`` writes them).
        meta = shards.meta if shards is not None else self._samples.meta
        self.classes: list[str] = list(meta.get("classes", []))
        #: Class name -> the int ``"label"`` of its samples.
        self.class_to_idx: dict[str, int] = {c: i for i, c in enumerate(self.classes)}

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def from_prefix(
        cls,
        prefix: str,
        *,
        endpoint_url: str | None = None,
        group_by: str = "stem",
        transform: Transform | None = None,
        label: str | None = None,
        decode: bool = False,
        access: Access | None = None,
    ) -> S5Dataset:
        """All objects under ``s3://bucket/prefix``, listed with one ``s5cmd ls``.

        Under ``torch.distributed`` or ``torchrun`` one process of the job lists and the
        others receive the index (see the README), so every rank must call this.

        Args:
            prefix: ``s3://bucket/folder/``. A prefix always names a folder: ``s3://b/train``
                reads ``s3://b/train/``, never the sibling keys ``train-old/...`` or
                ``trainval/...``.
            endpoint_url: the S3 endpoint; else ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``
                or ``S3_ENDPOINT_URL``; else AWS.
            group_by: ``"stem"`` (``0001.image`` + ``0001.label`` is one sample with fields
                ``image`` and ``label``), ``"folder"`` (each sub-folder is one sample, its
                fields named by their path inside it) or ``"object"`` (one object, one
                sample, field ``data``).
            transform: called with each sample dict; its result is what ``dataset[i]`` returns.
            decode: decode each field by its extension before ``transform``
                (:func:`s5loader.decode.decode`: ``cls`` -> int, ``json``, ``npy``, images
                through Pillow, ...; nothing is unpickled).
            label: ``"folder"``: an ImageFolder layout (``PREFIX/<class>/<image>``): each sample
                gets an int ``"label"``, the index of its class folder (the first folder below
                the prefix) in :attr:`classes`, the sorted folder names, as torchvision's
                ``ImageFolder``; :attr:`class_to_idx` maps names to labels. ``None``: no label.
            access: how to reach the store: an :class:`~s5loader.Access` (anonymous,
                profile, credentials file, region, requester pays, TLS verification,
                ListObjects v1, addressing). The listing, the sampler's s5cmd calls and the
                direct GETs all use it. ``endpoint_url`` may be given here or there.

        Raises:
            S3URIError: the prefix is not an s3 URI.
            NoSuchBucketError, AccessDeniedError, EndpointError: the listing failed.
            EmptySourceError: nothing under the prefix (the message names keys beside an
                empty folder that share its name).
            ConfigError: an unknown ``group_by`` or ``label``; ``label="folder"`` with
                ``group_by="folder"`` (the samples would be the class folders).
        """
        index, store = _sources.prefix_index(prefix, access, endpoint_url, group_by, label)
        return cls(index, source=prefix, access=store, transform=transform, decode=decode)

    @classmethod
    def from_objects(
        cls,
        uris: Iterable[str],
        *,
        endpoint_url: str | None = None,
        group_by: str = "object",
        transform: Transform | None = None,
        label: str | None = None,
        access: Access | None = None,
    ) -> S5Dataset:
        """The given object URIs (sizes and ETags are read with one HEAD each).

        ``group_by="folder"`` makes each object's parent folder a sample. ``label="folder"``
        labels each sample with the folder that holds it (``.../train/cat/1.jpg``: ``cat``),
        as :meth:`from_prefix` does.
        """
        index, store = _sources.objects_index(uris, access, endpoint_url, group_by, label)
        return cls(index, source="the object list", access=store, transform=transform)

    @classmethod
    def from_manifest(
        cls,
        path_or_uri: str,
        *,
        endpoint_url: str | None = None,
        group_by: str = "object",
        transform: Transform | None = None,
        label: str | None = None,
        access: Access | None = None,
    ) -> S5Dataset:
        """Objects listed in a JSON Lines manifest (a local path or an s3 URI).

        Each line is a URI string, or an object ``{"uri": ..., "size": ..., "etag": ...,
        ...}``; ``size`` and ``etag`` spare a HEAD request, and any other keys are carried
        into the sample dict. ``label="folder"`` labels each sample with the folder that
        holds it, as :meth:`from_objects` does.

        Raises:
            ManifestError: a line is broken (the message names its number).
        """
        index, store = _sources.manifest_index(path_or_uri, access, endpoint_url, group_by, label)
        return cls(index, source=path_or_uri, access=store, transform=transform)

    @classmethod
    def from_shards(
        cls,
        source: str | Sequence[str],
        *,
        index: str | None = None,
        endpoint_url: str | None = None,
        transform: Transform | None = None,
        decode: bool = False,
        access: Access | None = None,
    ) -> S5Dataset:
        """Samples of tar shards in the WebDataset format (``0001.jpg`` + ``0001.cls`` in a
        shard is the sample ``{"__key__": "0001", "jpg": b"...", "cls": b"..."}``).

        :class:`~s5loader.S5Sampler` stages each shard whole with one s5cmd ``cp`` and the
        workers read samples from it; the budget counts whole shards.

        Args:
            source: ``s3://bucket/prefix/`` (every ``*.tar`` below it), a brace pattern
                (``s3://bucket/train/shard-{000000..000999}.tar``) or a list of shard URIs.
            index: a wids JSON shard list (s3 URI or local path) with each shard's
                ``nsamples``; default: ``wids.json`` in the shards' folder, as
                ``s5loader index-shards SOURCE`` writes it.
            endpoint_url: the S3 endpoint (as :meth:`from_prefix`).
            transform: called with each sample dict; its result is what ``dataset[i]`` returns.
            decode: decode fields by extension before ``transform`` (see :mod:`s5loader.decode`).
            access: how to reach the store (:class:`~s5loader.Access`), for the shards and the index.

        Raises:
            ShardIndexError: no index (the message says to run ``s5loader index-shards``), a
                bad one, or one that lacks a shard.
            ObjectNotFoundError: a shard the pattern or list names does not exist.
            EmptySourceError: no shard, or no sample in the shards.
        """
        store = Access.coerce(access, endpoint_url)
        # one process of the job reads the index (and lists a prefix); the others receive it
        what = ["shards", repr(source), index, store.endpoint()]
        shards, where, meta = shared_object(
            lambda: load_shards(source, index, store),
            what,
            lambda found: [[list(sh) for sh in found[0]], found[1], found[2]],
            lambda plain: ([Shard(*sh) for sh in plain[0]], str(plain[1]), dict(plain[2])),
        )
        name = source if isinstance(source, str) else f"{len(shards)} shards"
        shard_set = ShardSet(shards, store, name, where, meta)
        return cls([], access=store, transform=transform, decode=decode, source=name, shards=shard_set)

    @classmethod
    def from_index(
        cls,
        path_or_uri: str,
        *,
        endpoint_url: str | None = None,
        transform: Transform | None = None,
        access: Access | None = None,
    ) -> S5Dataset:
        """The data set whose index :meth:`save_index` wrote (a local path or an s3 URI),
        without listing or reading the source again.

        Raises:
            IndexFileError: not an index file, another format version, or damaged.
        """
        store = Access.coerce(access, endpoint_url)
        index = _sources.load_index(path_or_uri, store)
        source = str(index.meta.get("source", path_or_uri))
        return cls(index, access=store, transform=transform, source=source)

    def save_index(self, path_or_uri: str) -> None:
        """Save the sample index (keys, fields, sizes, ETags, extra fields, the listing) to a
        local file or an s3 URI, for :meth:`from_index`. The format is versioned and
        checksummed; see the README."""
        _sources.save_index(self._samples, path_or_uri, self.access)

    @property
    def endpoint_url(self) -> str | None:
        """The endpoint given (``access.endpoint_url``); setting it changes :attr:`access`."""
        return self.access.endpoint_url

    @endpoint_url.setter
    def endpoint_url(self, value: str | None) -> None:
        self.access = dataclasses.replace(self.access, endpoint_url=value)

    # -- map-style access ---------------------------------------------------------------
    @property
    def samples(self) -> SampleIndex:
        """The sample index: keys, fields, URIs and sizes (a sequence of :class:`Sample`)."""
        return self._samples

    def __len__(self) -> int:
        return self._reader.samples

    @property
    def _listing(self) -> Sequence[str] | None:
        # every key the prefix listing returned; none for object lists and manifests
        return self._samples.listing

    @property
    def total_bytes(self) -> int:
        return self._samples.total_bytes

    def __getitem__(self, index: int) -> Any:
        if self._plain.roots and not isinstance(index, StagedIndex):
            self._plain.check(int(index), self._reader.unit_of(index))
        member, where = self._reader.read(index, self._samples, self.access)
        return self._finish(member, where)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """A DataLoader batch, as ``[self[i] for i in indices]``; the sampler's words on its
        samples handed out before they were staged are asked for in one request."""
        announce_early(indices)
        return [self[i] for i in indices]

    def _finish(self, out: dict[str, Any], where: str | dict[str, str] = "") -> Any:
        if self.decode:
            out = decode(out, where)
        return self.transform(out) if self.transform is not None else out

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()  # boto3 clients live in _s3api, one per process: none here

    def __repr__(self) -> str:
        return f"S5Dataset({self.source!r}, {self._reader.describe()})"
