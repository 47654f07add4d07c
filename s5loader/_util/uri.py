"""Parsing ``s3://bucket/key`` URIs and the sizes users type (``"2GiB"``)."""

from __future__ import annotations

import math
import os
import re
from typing import NamedTuple

from ..exceptions import ConfigError, S3URIError

# Bucket names per the S3 rules, loosened a little for S3-compatible stores
# (underscores and upper case are accepted by several of them).
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")


# Where the endpoint comes from when no endpoint_url is given, in this order (boto3's own two,
# then s5cmd's).
ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL")


TLS_HINT = (
    "; the endpoint's TLS certificate is not trusted: for a self-signed store pass "
    "Access(verify_ssl=False) (--no-verify-ssl), or add its CA to the system's trust store"
)


# Where the endpoint is set, as error messages say it.
_ENDPOINT_FROM = (
    f"endpoint_url= (--endpoint-url), else {', '.join(ENDPOINT_VARS[:-1])} or {ENDPOINT_VARS[-1]}"
)


def _store(endpoint: str | None) -> str:
    """The store an endpoint (default: the environment's) names, in words."""
    if endpoint is None:
        endpoint = next((os.environ[v] for v in ENDPOINT_VARS if os.environ.get(v)), None)
    return f"the store at {endpoint}" if endpoint else "AWS S3 (no endpoint is set)"


def endpoint_hint(endpoint: str | None) -> str:
    """What to check when the store cannot be reached, for the end of an error message."""
    return (
        f"; check that {_store(endpoint)} is up and reachable. The endpoint is {_ENDPOINT_FROM}; for the "
        'local test server, run eval "$(bin/s3-local start)" in this shell first'
    )


CREDENTIALS_HINT = (
    "; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or name a profile of "
    "~/.aws/credentials with AWS_PROFILE or Access(profile=...) (--profile), or another credentials "
    "file with Access(credentials_file=...) (--credentials-file); a public bucket needs none: "
    "Access(anonymous=True) (--no-sign-request)"
)


def bucket_hint(uri: str, endpoint: str | None) -> str:
    """What to check when the bucket of ``uri`` does not exist, for the end of an error message."""
    bucket = uri[5:].split("/", 1)[0] if uri.startswith("s3://") else uri
    return (
        f"; {_store(endpoint)} has no bucket {bucket!r}: check the bucket's name in the URI, and that the "
        f"endpoint is the store that holds it ({_ENDPOINT_FROM})"
    )


# The Python API's words in the hints above, and the command line's for the same thing: an
# error the CLI prints names only the flag.
_CLI_WORDS = (
    ("endpoint_url= (--endpoint-url)", "--endpoint-url"),
    ("Access(verify_ssl=False) (--no-verify-ssl)", "--no-verify-ssl"),
)


def for_cli(message: str) -> str:
    """``message`` as the command line says it: its flags without the Python arguments."""
    for python, flag in _CLI_WORDS:
        message = message.replace(python, flag)
    return message


class S3URI(NamedTuple):
    """A parsed ``s3://bucket/key`` URI."""

    bucket: str
    key: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def parse_s3_uri(uri: str) -> S3URI:
    """Split ``s3://bucket/key`` into its bucket and key.

    Raises:
        S3URIError: the string is not an s3 URI or the bucket name is invalid.
    """
    if not isinstance(uri, str):
        raise S3URIError(f"expected an s3:// URI string, got {type(uri).__name__}: {uri!r}")
    if not uri.startswith("s3://"):
        raise S3URIError(f"not an s3 URI (it must start with 's3://'): {uri!r}")
    rest = uri[5:]
    bucket, _, key = rest.partition("/")
    if not _BUCKET_RE.match(bucket):
        raise S3URIError(f"invalid bucket name {bucket!r} in {uri!r}")
    return S3URI(bucket, key)


def as_folder(uri: str) -> str:
    """A prefix URI as the folder it names: ``s3://b/train`` is ``s3://b/train/``, so that a
    listing never reaches the sibling folders ``train-old/`` or ``trainval/``; a bucket
    (``s3://b`` or ``s3://b/``) stays the whole bucket."""
    u = parse_s3_uri(uri)
    if not u.key or u.key.endswith("/"):
        return f"s3://{u.bucket}/{u.key}"
    return f"s3://{u.bucket}/{u.key}/"


COMPRESSED_TAR = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")
#: The compressed shards s5loader reads (gzip); the rest of COMPRESSED_TAR it names and refuses.
GZIP_TAR = (".tar.gz", ".tgz")
#: The names of the tar shards s5loader reads.
SHARD_SUFFIXES = (".tar", *GZIP_TAR)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?i?B?)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "ki": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "mi": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "gi": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
    "ti": 1024**4,
    "p": 1000**5,
    "pb": 1000**5,
    "pib": 1024**5,
    "pi": 1024**5,
}


def parse_size(value: int | str, name: str = "size") -> int:
    """Turn ``"4GiB"``, ``"500MB"``, ``"1.5G"`` or an int of bytes into bytes.

    Raises:
        ConfigError: the value is not a positive size.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a size such as '2GiB' or an int of bytes, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(
                f"{name}={value!r} is not a size: use an int of bytes or a string like "
                "'2GiB', '500MB', '64KiB'"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(f"{name} must be a size such as '2GiB' or an int of bytes, got {value!r}")
    if n <= 0:
        raise ConfigError(f"{name} must be positive, got {value!r}")
    return n


def format_size(n: float, exact: bool = False) -> str:
    """Format bytes for people: ``1.5 GiB``; a size that reads round in decimal units (as one
    typed ``"300kB"``) in those too: ``293.0 KiB (300 kB)``; ``exact``: with the count of bytes
    instead, ``293.0 KiB (300000 bytes)``."""
    decimal = f"{int(n)} bytes" if exact else _decimal(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            text = f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
            return f"{text} ({decimal})" if decimal else text
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _decimal(n: float) -> str | None:
    """``n`` bytes in decimal units when that reads round (at most two decimals: ``1.5 MB``) and
    the binary units do not (``2 GiB`` stays as it is)."""
    if n != int(n) or n < 1024:
        return None
    level = 1024 ** min(4, int(math.log(n, 1024)))
    if n % level == 0:
        return None  # a whole number of KiB, MiB, ...: as typed
    for scale, unit in ((1000**4, "TB"), (1000**3, "GB"), (1000**2, "MB"), (1000, "kB")):
        if n >= scale:
            return None if n % (scale // 100 or 1) else f"{n / scale:g} {unit}"
    return None
