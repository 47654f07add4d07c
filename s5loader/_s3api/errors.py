"""The one mapping of botocore's exceptions to s5loader's: each names the object's ``s3://`` URI,
and an unreachable store or an untrusted certificate says what to check."""

from __future__ import annotations

from .._util.uri import CREDENTIALS_HINT, TLS_HINT, bucket_hint, endpoint_hint
from ..exceptions import (
    AccessDeniedError,
    EndpointError,
    FetchError,
    NoSuchBucketError,
    ObjectNotFoundError,
    S5LoaderError,
)


def boto3_error(exc: Exception, uri: str, endpoint: str | None = None) -> S5LoaderError:
    """Map a botocore exception about ``uri`` to one of ours; missing credentials, a missing
    bucket, an unreachable store (at ``endpoint``, default: the environment's) and an untrusted
    certificate end with what to check (as :func:`s5loader._s5cmd.output.explain` says it for
    s5cmd's errors)."""
    code = ""
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        code = str(resp.get("Error", {}).get("Code", ""))
    msg = f"{uri}: {code + ': ' if code else ''}{exc}"
    if code == "NoSuchBucket":
        return NoSuchBucketError(msg + bucket_hint(uri, endpoint))
    if code in ("NoSuchKey", "404", "NotFound"):
        return ObjectNotFoundError(msg)
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden"):
        return AccessDeniedError(msg)
    name = type(exc).__name__
    if name == "SSLError" or "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return EndpointError(msg + TLS_HINT)
    if name == "NoCredentialsError":
        return AccessDeniedError(msg + CREDENTIALS_HINT)
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError"):
        return EndpointError(msg + endpoint_hint(getattr(exc, "kwargs", {}).get("endpoint_url", endpoint)))
    return FetchError(msg)
