"""Exception types raised by s5loader.

Every concrete type also subclasses a built-in exception, so existing ``except OSError`` or
``except ValueError`` clauses keep working. Every error about an object names its ``s3://``
URI. All types survive pickling, so an error raised in a DataLoader worker process reaches the
training loop with its message intact.
"""

from __future__ import annotations


class S5LoaderError(Exception):
    """Base class of every error s5loader raises on purpose."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # Built-in exceptions pickle their ``args``; subclasses with keyword-only state
        # would lose it, so every type here keeps its whole message in ``args[0]``.
        return (self.__class__, self.args)


class ConfigError(S5LoaderError, ValueError):
    """An argument or option is invalid (bad size, unknown ``group_by``, ...)."""


class S3URIError(S5LoaderError, ValueError):
    """A string is not a valid ``s3://bucket/key`` URI."""


class ManifestError(S5LoaderError, ValueError):
    """A manifest file cannot be read; the message names the line."""


class IndexFileError(S5LoaderError, ValueError):
    """A saved sample index cannot be used: not an index file, another format version, or
    damaged; the message names the file."""


class IndexShareError(S5LoaderError, TimeoutError):
    """Waiting for the sample index that another process of the job builds failed."""


class EmptySourceError(S5LoaderError, ValueError):
    """A prefix, manifest or object list holds no sample."""


class S5cmdNotFoundError(S5LoaderError, FileNotFoundError):
    """The s5cmd binary cannot be found; the message says how to install it."""


class NoSuchBucketError(S5LoaderError, FileNotFoundError):
    """The bucket does not exist."""


class ObjectNotFoundError(S5LoaderError, FileNotFoundError):
    """An object is missing (deleted after it was listed, or never there)."""


class AccessDeniedError(S5LoaderError, PermissionError):
    """The store refused the credentials or the request (403, bad signature)."""


class EndpointError(S5LoaderError, ConnectionError):
    """The S3 endpoint cannot be reached."""


class FetchError(S5LoaderError, OSError):
    """Objects could not be staged after all retries; the message names them."""


class BudgetError(S5LoaderError, ValueError):
    """A sample cannot fit the byte budget, or the budget cannot fit the staging directory."""


class StagingSpaceError(S5LoaderError, OSError):
    """The staging file system ran out of space (ENOSPC) while staging."""


class StallError(S5LoaderError, TimeoutError):
    """Staging made no progress for ``stall_timeout`` seconds, and retries did not help."""


class StateError(S5LoaderError, ValueError):
    """A ``state_dict`` given to ``load_state_dict`` does not fit this sampler."""


class PlatformError(S5LoaderError, OSError):
    """s5loader runs on Linux only; the message names what it needs that this system lacks."""


class DaemonError(S5LoaderError, RuntimeError):
    """The prefetch daemon cannot start (a second daemon on one cache, a bad cache)."""


class ChecksumError(FetchError):
    """An object's bytes do not match its ``.md5`` file or its ETag; the message names it."""


class UnsafeArchiveError(S5LoaderError, ValueError):
    """An archive member would land outside the destination (``..``, absolute, a link out)."""


class ShardError(S5LoaderError, ValueError):
    """A tar shard cannot be read: not a tar, damaged or truncated, or it disagrees with its
    index; the message names the shard's URI and the member."""


class DecodeError(S5LoaderError, ValueError):
    """A sample field cannot be decoded by its extension (``decode=True``); the message names
    the field, the sample's key and where it came from (the object's or the shard's URI)."""


class ShardIndexError(S5LoaderError, ValueError):
    """A shard index (a wids JSON shard list) is missing, cannot be read, or does not cover the
    shards; the message names it and says how to build one."""
