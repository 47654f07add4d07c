"""The one mapping of botocore's exceptions to s5loader's: each names the object's ``s3://`` URI,
and an unreachable store or an untrusted certificate says what to check."""

from __future__ import annotations

from .._util.uri import TLS_HINT, endpoint_hint
from ..exceptions import (
    AccessDeniedError,
    EndpointError,
    FetchError,
    NoSuchBucketError,
    ObjectNotFoundError,
    S5LoaderError,
)


def boto3_error(exc: Exception, uri: str) -> S5LoaderError:
    """Map a botocore exception about ``uri`` to one of ours."""
    code = ""
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        code = str(resp.get("Error", {}).get("Code", ""))
    msg = f"{uri}: {code + ': ' if code else ''}{exc}"
    if code == "NoSuchBucket":
        return NoSuchBucketError(msg)
    if code in ("NoSuchKey", "404", "NotFound"):
        return ObjectNotFoundError(msg)
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden"):
        return AccessDeniedError(msg)
    name = type(exc).__name__
    if name == "SSLError" or "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return EndpointError(msg + TLS_HINT)
    if name == "NoCredentialsError":
        return AccessDeniedError(msg)
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError"):
        return EndpointError(msg + endpoint_hint(getattr(exc, "kwargs", {}).get("endpoint_url")))
    return FetchError(msg)
