"""s5cmd's words for missing credentials and a missing bucket (as s5cmd 2.3 prints them) become
messages that say what is wrong and what to check, with the URI; boto3's errors say the same.

Private modules (``s5loader._s3api``, ``s5loader._s5cmd``) are imported on purpose: their own
behaviour is what these tests check."""

from __future__ import annotations

import botocore.exceptions

from s5loader import (
    AccessDeniedError,
    EndpointError,
    FetchError,
    NoSuchBucketError,
)
from s5loader._s3api.errors import boto3_error
from s5loader._s5cmd import error_for, error_from_exit

NO_CREDENTIALS = (
    "NoCredentialProviders: no valid providers in chain. Deprecated.\n\tFor verbose messaging see "
    "aws.Config.CredentialsChainVerboseErrors"
)
NO_BUCKET = (
    "NoSuchBucket: The specified bucket does not exist status code: 404, request id: "
    "SNKMXvhuRa69oqf0QDhtipQTa2FcoRy7fCmXA5uyBu05ngb68jVQ, host id: "
)


def test_no_credentials_from_a_listing_and_a_copy() -> None:
    listing = error_for("denied", f"cannot list s3://demo/shard/: {NO_CREDENTIALS} (s5cmd exit code 1)")
    copy = error_for("denied", f"cannot stage s3://demo/shard/0.tar: {NO_CREDENTIALS}")
    for exc, uri in ((listing, "s3://demo/shard/"), (copy, "s3://demo/shard/0.tar")):
        assert isinstance(exc, AccessDeniedError)
        message = str(exc)
        assert message.startswith(
            f"cannot {'list' if uri.endswith('/') else 'stage'} {uri}: no credentials were found"
        )
        assert "AWS_ACCESS_KEY_ID" in message and "Access(anonymous=True)" in message
        assert (
            "providers in chain" not in message and "Deprecated" not in message and "verbose" not in message
        )
    assert "(s5cmd exit code 1); set AWS_ACCESS_KEY_ID" in str(listing)


def test_no_bucket_names_the_bucket_and_the_endpoint() -> None:
    exc = error_from_exit(
        1, f'{{"operation":"ls","error":"{NO_BUCKET}"}}\n', "s3://dmeo/train/", "http://127.0.0.1:9000"
    )
    assert isinstance(exc, NoSuchBucketError)
    message = str(exc)
    assert message.startswith("s3://dmeo/train/: no such bucket (NoSuchBucket) (s5cmd exit code 1); ")
    assert "the store at http://127.0.0.1:9000 has no bucket 'dmeo'" in message and "endpoint_url=" in message
    assert "request id" not in message and "host id" not in message


def test_other_errors_keep_s5cmd_words() -> None:
    exc = error_for("transient", "cannot stage s3://b/k: InternalError: we broke status code: 500")
    assert (
        isinstance(exc, FetchError)
        and str(exc) == "cannot stage s3://b/k: InternalError: we broke status code: 500"
    )
    unreachable = error_for(
        "endpoint", "cannot list s3://b/: dial tcp 127.0.0.1:1: connection refused", "http://127.0.0.1:1"
    )
    assert isinstance(
        unreachable, EndpointError
    ) and "check that the store at http://127.0.0.1:1 is up" in str(unreachable)


def test_boto3_says_the_same() -> None:
    no_creds = boto3_error(botocore.exceptions.NoCredentialsError(), "s3://demo/x")
    assert isinstance(no_creds, AccessDeniedError) and "set AWS_ACCESS_KEY_ID" in str(no_creds)
    missing = botocore.exceptions.ClientError(
        {"Error": {"Code": "NoSuchBucket", "Message": "The specified bucket does not exist"}}, "ListObjectsV2"
    )
    no_bucket = boto3_error(missing, "s3://dmeo/train/", "http://127.0.0.1:9000")
    assert isinstance(no_bucket, NoSuchBucketError)
    assert "the store at http://127.0.0.1:9000 has no bucket 'dmeo'" in str(no_bucket)


def test_failure_line_is_matched_by_its_destination() -> None:
    from s5loader._s5cmd import parse_line, partial_of, reported_destinations

    # the shape s5cmd v2.3 prints for a failing cp --raw line and for one object of a wildcard
    line = b'{"operation":"cp","command":"cp s3://b/a b.bin /stage dir/.c1/.r/3.0","error":"AccessDenied: x"}'
    r = parse_line(line)
    assert r is not None and not r.ok and r.error == "AccessDenied: x"
    assert list(reported_destinations(r.command)) == [
        "s3://b/a b.bin /stage dir/.c1/.r/3.0",
        "b.bin /stage dir/.c1/.r/3.0",
        "/stage dir/.c1/.r/3.0",
        "dir/.c1/.r/3.0",
    ]
    assert list(partial_of("3.01083930865"))[:2] == ["3.0108393086", "3.010839308"]
    assert "3.0" in partial_of("3.01083930865") and "3.01" in partial_of("3.01083930865")
    assert list(partial_of("3.0")) == ["3."] and list(partial_of("x.bin")) == []


def test_edit_distance_counts_a_swap_of_neighbours_as_one_edit() -> None:
    from s5loader._index.near import edit_distance

    assert edit_distance("trian", "train") == 1
    assert edit_distance("train", "train") == 0
    assert edit_distance("trn", "train") == 2
    assert edit_distance("", "abc") == 3 and edit_distance("val", "train") == 4
