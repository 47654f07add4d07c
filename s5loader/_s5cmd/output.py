"""Reading s5cmd's output: its JSON lines (copies, listings), the last error in its stderr,
which destination a failure is about, and the exception each kind of error becomes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import NamedTuple

from .._util.uri import CREDENTIALS_HINT, TLS_HINT, bucket_hint, endpoint_hint
from ..exceptions import (
    AccessDeniedError,
    EndpointError,
    FetchError,
    NoSuchBucketError,
    ObjectNotFoundError,
    S5LoaderError,
    StagingSpaceError,
)


class ObjectInfo(NamedTuple):
    """One object as listed: its URI, key, size in bytes and ETag (without quotes)."""

    uri: str
    key: str
    size: int
    etag: str


class Result(NamedTuple):
    """One line of ``s5cmd --json`` output about a copy."""

    ok: bool
    source: str
    destination: str
    error: str
    command: str


def classify(error: str) -> str:
    """Sort an s5cmd error message into ``not_found``, ``denied``, ``no_space``, ``bucket``,
    ``endpoint``, ``tls`` (the endpoint's certificate is not trusted) or ``transient``."""
    e = error.lower()
    if "no space left" in e or "enospc" in e or "disk quota" in e:
        return "no_space"
    if "x509:" in e or "tls: " in e or "certificate verify failed" in e:
        return "tls"
    if "nosuchbucket" in e:
        return "bucket"
    if "nosuchkey" in e or "status code: 404" in e or "not found" in e or "no object found" in e:
        return "not_found"
    if any(
        s in e
        for s in (
            "accessdenied",
            "access denied",
            "status code: 403",
            "invalidaccesskeyid",
            "signaturedoesnotmatch",
            "forbidden",
            "nocredentialproviders",
        )
    ):
        return "denied"
    if "no such host" in e:
        return "endpoint"
    return "transient"


# s5cmd's words (the AWS Go SDK's) for errors a user can fix, from their code to the end of
# s5cmd's message (the end of the text, or the exit code that follows it): they are cut to their
# code, and the message ends with what to check.
_NO_CREDENTIALS = re.compile(r"NoCredentialProviders:.*?\s*(?=\(s5cmd exit code|\Z)", re.DOTALL)
_NO_BUCKET = re.compile(r"NoSuchBucket:.*?\s*(?=\(s5cmd exit code|\Z)", re.DOTALL)
_URI = re.compile(r"s3://[^\s/]+")


def explain(message: str, endpoint: str | None = None) -> str:
    """``message`` (about an ``s3://`` URI, holding s5cmd's error) with s5cmd's words for missing
    credentials or a missing bucket cut to their code, and what to check at its end (as
    :func:`~s5loader._s3api.errors.boto3_error` says it for boto3's errors)."""
    for words, what in (
        (_NO_CREDENTIALS, "no credentials were found (NoCredentialProviders)"),
        (_NO_BUCKET, "no such bucket (NoSuchBucket)"),
    ):
        found = words.search(message)
        if found is None:
            continue
        cut = (
            message[: found.start()]
            + what
            + (" " if found.end() < len(message) else "")
            + message[found.end() :]
        )
        if words is _NO_CREDENTIALS:
            return cut + CREDENTIALS_HINT
        uri = _URI.search(message)
        return cut + (bucket_hint(uri.group(0), endpoint) if uri else "")
    return message


def error_for(kind: str, message: str, endpoint: str | None = None) -> S5LoaderError:
    """The exception type for an error kind from :func:`classify`; the message ends with what
    to check for an unreachable store (about ``endpoint``, default: the environment's), for
    missing credentials and for a missing bucket (see :func:`explain`)."""
    message = explain(message, endpoint)
    if kind == "endpoint":
        message += endpoint_hint(endpoint)
    types: dict[str, type[S5LoaderError]] = {
        "not_found": ObjectNotFoundError,
        "bucket": NoSuchBucketError,
        "denied": AccessDeniedError,
        "endpoint": EndpointError,
        "tls": EndpointError,
    }
    return types.get(kind, FetchError)(message + (TLS_HINT if kind == "tls" else ""))


def ls_object(line: bytes) -> ObjectInfo | None:
    """One object of ``s5cmd ls --json`` output; ``None`` for other lines."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None  # not a listing line
    if isinstance(rec, dict) and rec.get("type") == "file":
        uri = rec["key"]
        key = uri.split("/", 3)[3] if uri.count("/") >= 3 else ""
        return ObjectInfo(uri, key, int(rec.get("size", 0)), rec.get("etag", "").strip('"'))
    return None


def looks_unreachable(msg: str) -> bool:
    m = msg.lower()
    return any(s in m for s in ("connection refused", "no such host", "dial tcp", "i/o timeout"))


def last_error(stderr: str) -> str:
    """The last error message in s5cmd's stderr (JSON lines or plain text)."""
    for line in reversed(stderr.strip().splitlines()):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            return line[-500:]
        if isinstance(rec, dict) and rec.get("error"):
            return str(rec["error"])[-500:]
    return ""


def parse_line(line: bytes | bytearray | str) -> Result | None:
    """Parse one line of ``s5cmd --json`` output; ``None`` for lines about something else."""
    try:
        rec = json.loads(line)
    except ValueError:
        text = line.decode("utf-8", "replace") if isinstance(line, (bytes, bytearray)) else line
        text = text.strip()
        return Result(False, "", "", text, "") if text else None
    if not isinstance(rec, dict):
        return None
    if rec.get("success"):
        return Result(True, rec.get("source", ""), rec.get("destination", ""), "", "")
    if "error" in rec:
        return Result(False, "", "", str(rec["error"]), str(rec.get("command", "")))
    return None


def reported_destinations(command: str) -> Iterator[str]:
    """Where a failure line's ``command`` field may name the destination, longest first.

    s5cmd prints the failing copy as ``cp [FLAGS] SOURCE DESTINATION``, unquoted, with one
    object's source and destination even for a wildcard line (for an error of the whole line,
    the line's own pattern and folder). Sources and destinations may hold spaces, so the
    destination is some suffix after a space; the caller looks each up among the
    destinations it wrote.
    """
    for i, c in enumerate(command):
        if c == " ":
            yield command[i + 1 :]


def partial_of(name: str) -> Iterator[str]:
    """The destination file names that ``name`` can be s5cmd's temporary file for.

    s5cmd downloads into ``DESTINATION`` followed by random digits, in the destination's
    folder, and renames it when the object is complete; the file appears when the GET
    starts and its modification time moves with every write.
    """
    for k in range(len(name) - 1, 0, -1):
        if not name[k].isdigit():
            return
        yield name[:k]


def error_from_exit(rc: int, stderr: bytes | str, what: str, endpoint: str | None = None) -> S5LoaderError:
    """The exception for an s5cmd run about ``what`` (an ``s3://`` URI) that exited ``rc``.

    A full local disk is a ``StagingSpaceError``; everything else is sorted by
    :func:`classify`.
    """
    text = stderr.decode("utf-8", "replace") if isinstance(stderr, bytes) else stderr
    msg = last_error(text) or f"exit code {rc}"
    kind = classify(msg)
    full = f"{what}: {msg} (s5cmd exit code {rc})"
    if kind == "no_space":
        return StagingSpaceError(full)
    if kind == "transient" and looks_unreachable(msg):
        kind = "endpoint"
    return error_for(kind, full, endpoint)
