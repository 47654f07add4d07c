"""S5Dataset: a map-style dataset of S3 samples that reads what S5Sampler staged."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch.utils.data import Dataset

from . import _indexfile
from ._compact import SampleIndex
from ._index import (
    Sample,
    boto3_error,
    check_group_by,
    index_manifest,
    index_objects,
    index_prefix,
    make_boto3_client,
)
from ._s5cmd import S5cmd, resolve_endpoint
from ._share import shared_index
from ._stager import field_names
from ._uri import parse_s3_uri
from .exceptions import EmptySourceError, S3URIError

log = logging.getLogger(__name__)

Transform = Callable[[dict[str, Any]], Any]


class S5Dataset(Dataset[Any]):
    """Samples in S3, each a dict ``{"__key__": key, FIELD: bytes, ...}``.

    ``dataset[i]`` reads the sample's files from the staging directory of the
    :class:`~s5loader.S5Sampler` it is used with, and deletes them right after reading (the
    releaser: inline, so the budget is freed at once and nothing is left when a DataLoader
    worker exits). Without a sampler, or when a file is not staged, it fetches the sample
    directly from S3, so the dataset works with any sampler.

    Build one with :meth:`from_prefix`, :meth:`from_objects` or :meth:`from_manifest`.
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        *,
        endpoint_url: str | None = None,
        transform: Transform | None = None,
        source: str = "",
    ) -> None:
        if not samples:
            raise EmptySourceError(f"no sample in {source or 'the given objects'}")
        self._samples = SampleIndex.from_samples(samples, {"source": source})
        self.endpoint_url = endpoint_url
        self.transform = transform
        self.source = source
        self._staging_path: str | None = None
        self._keep_staged = False
        self._client: Any = None
        self._client_pid = -1
        self._warned_unstaged = False

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def from_prefix(
        cls,
        prefix: str,
        *,
        endpoint_url: str | None = None,
        group_by: str = "stem",
        transform: Transform | None = None,
    ) -> S5Dataset:
        """All objects under ``s3://bucket/prefix``, listed with one ``s5cmd ls``.

        Under ``torch.distributed`` or ``torchrun`` one process of the job lists and the
        others receive the index (see the README), so every rank must call this.

        Args:
            prefix: ``s3://bucket/prefix/``; a literal key prefix (a trailing ``/`` names a
                folder).
            endpoint_url: the S3 endpoint; else ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``
                or ``S3_ENDPOINT_URL``; else AWS.
            group_by: ``"stem"`` (``0001.image`` + ``0001.label`` is one sample with fields
                ``image`` and ``label``), ``"folder"`` (each sub-folder is one sample, its
                fields named by their path inside it) or ``"object"`` (one object, one
                sample, field ``data``).
            transform: called with each sample dict; its result is what ``dataset[i]`` returns.

        Raises:
            S3URIError: the prefix is not an s3 URI.
            NoSuchBucketError, AccessDeniedError, EndpointError: the listing failed.
            EmptySourceError: nothing under the prefix.
            ConfigError: an unknown ``group_by``.
        """
        check_group_by(group_by)
        parse_s3_uri(prefix)
        index = shared_index(
            lambda: index_prefix(prefix, S5cmd(endpoint_url), group_by),
            ["prefix", prefix, resolve_endpoint(endpoint_url), group_by],
        )
        return cls(index, endpoint_url=endpoint_url, transform=transform, source=prefix)

    @classmethod
    def from_objects(
        cls,
        uris: Iterable[str],
        *,
        endpoint_url: str | None = None,
        group_by: str = "object",
        transform: Transform | None = None,
    ) -> S5Dataset:
        """The given object URIs (sizes and ETags are read with one HEAD each).

        ``group_by="folder"`` makes each object's parent folder a sample.
        """
        check_group_by(group_by)
        uris = list(uris)
        for u in uris:
            if not parse_s3_uri(u).key:
                raise S3URIError(f"{u!r} names a bucket, not an object")
        digest = hashlib.sha256("\n".join(uris).encode("utf-8", "surrogatepass")).hexdigest()
        samples = shared_index(
            lambda: index_objects(uris, endpoint_url, group_by),
            ["objects", digest, resolve_endpoint(endpoint_url), group_by],
        )
        return cls(samples, endpoint_url=endpoint_url, transform=transform, source="the object list")

    @classmethod
    def from_manifest(
        cls,
        path_or_uri: str,
        *,
        endpoint_url: str | None = None,
        group_by: str = "object",
        transform: Transform | None = None,
    ) -> S5Dataset:
        """Objects listed in a JSON Lines manifest (a local path or an s3 URI).

        Each line is a URI string, or an object ``{"uri": ..., "size": ..., "etag": ...,
        ...}``; ``size`` and ``etag`` spare a HEAD request, and any other keys are carried
        into the sample dict.

        Raises:
            ManifestError: a line is broken (the message names its number).
        """
        check_group_by(group_by)
        samples = shared_index(
            lambda: index_manifest(path_or_uri, endpoint_url, group_by),
            ["manifest", path_or_uri, resolve_endpoint(endpoint_url), group_by],
        )
        return cls(samples, endpoint_url=endpoint_url, transform=transform, source=path_or_uri)

    @classmethod
    def from_index(
        cls,
        path_or_uri: str,
        *,
        endpoint_url: str | None = None,
        transform: Transform | None = None,
    ) -> S5Dataset:
        """The data set whose index :meth:`save_index` wrote (a local path or an s3 URI),
        without listing or reading the source again.

        Raises:
            IndexFileError: not an index file, another format version, or damaged.
        """
        if path_or_uri.startswith("s3://"):
            index = _indexfile.loads(_read_object(path_or_uri, endpoint_url), path_or_uri)
        else:
            index = _indexfile.load(path_or_uri)
        source = str(index.meta.get("source", path_or_uri))
        return cls(index, endpoint_url=endpoint_url, transform=transform, source=source)

    def save_index(self, path_or_uri: str) -> None:
        """Save the sample index (keys, fields, sizes, ETags, extra fields, the listing) to a
        local file or an s3 URI, for :meth:`from_index`. The format is versioned and
        checksummed; see the README."""
        data = self._samples.to_bytes()
        if not path_or_uri.startswith("s3://"):
            _indexfile.save(self._samples, path_or_uri)
            return
        u = parse_s3_uri(path_or_uri)
        client = make_boto3_client(self.endpoint_url)
        try:
            client.put_object(Bucket=u.bucket, Key=u.key, Body=data)
        except Exception as exc:
            raise boto3_error(exc, path_or_uri) from exc

    # -- map-style access ---------------------------------------------------------------
    @property
    def samples(self) -> SampleIndex:
        """The sample index: keys, fields, URIs and sizes (a sequence of :class:`Sample`)."""
        return self._samples

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def _listing(self) -> Sequence[str] | None:
        # every key the prefix listing returned; none for object lists and manifests
        return self._samples.listing

    @property
    def total_bytes(self) -> int:
        return self._samples.total_bytes

    def __getitem__(self, index: int) -> Any:
        sample = self._samples[index]
        data = None
        if self._staging_path is not None:
            data = self._read_staged(f"{self._staging_path}/{index}", sample)
            if data is None and not self._warned_unstaged:
                self._warned_unstaged = True
                log.warning(
                    "sample %d (%s) was not staged in %s; fetching it directly (further "
                    "cases are not logged)", index, sample.key, self._staging_path,
                )
        if data is None:
            data = self._fetch(sample)
        out: dict[str, Any] = {"__key__": sample.key}
        for f, value in zip(sample.fields, data, strict=True):
            out[f.name] = value
        if sample.extra:
            for k, v in sample.extra.items():
                out.setdefault(k, v)
        return self.transform(out) if self.transform is not None else out

    def _read_staged(self, folder: str, sample: Sample) -> list[bytes] | None:
        names = field_names(sample)
        paths = [f"{folder}/{n}" for n in names]
        data = []
        try:
            for p in paths:
                with open(p, "rb") as fh:
                    data.append(fh.read())
        except FileNotFoundError:
            if not data:
                return None
            raise
        if not self._keep_staged:
            self._release(folder, paths, nested=any("/" in n for n in names))
        return data

    @staticmethod
    def _release(folder: str, paths: list[str], nested: bool) -> None:
        if nested:
            shutil.rmtree(folder, ignore_errors=True)
            return
        for p in paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(folder)
        except OSError:
            shutil.rmtree(folder, ignore_errors=True)

    def _fetch(self, sample: Sample) -> list[bytes]:
        if self._client is None or self._client_pid != os.getpid():
            self._client = make_boto3_client(self.endpoint_url)
            self._client_pid = os.getpid()
        out = []
        for f in sample.fields:
            u = parse_s3_uri(f.uri)
            try:
                out.append(self._client.get_object(Bucket=u.bucket, Key=u.key)["Body"].read())
            except Exception as exc:
                raise boto3_error(exc, f.uri) from exc
        return out

    # -- wiring with the sampler ----------------------------------------------------------
    def _attach(self, staging_path: str | None, keep: bool = False) -> None:
        self._staging_path = staging_path
        self._keep_staged = keep

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None  # boto3 clients are neither picklable nor fork-safe
        state["_client_pid"] = -1
        return state

    def __repr__(self) -> str:
        return f"S5Dataset({self.source!r}, {len(self)} samples)"


def _read_object(uri: str, endpoint_url: str | None) -> bytes:
    u = parse_s3_uri(uri)
    try:
        return bytes(make_boto3_client(endpoint_url).get_object(Bucket=u.bucket, Key=u.key)["Body"].read())
    except Exception as exc:
        raise boto3_error(exc, uri) from exc
