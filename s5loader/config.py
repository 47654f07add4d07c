"""The options, validated once: :class:`Access` (how to reach the store, for s5cmd and boto3
alike) and :class:`StagingOptions` (how samples are staged, for the sampler and the daemon).

Both are frozen dataclasses checked on creation, with messages that say what to change. The
sampler, the dataset constructors, the daemon and the command line all build these two
objects; nothing below them checks an option again.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import urllib.parse
from dataclasses import dataclass, fields, replace
from typing import Any

from ._util.botoclient import new_s3_client
from ._util.checks import boolean, optional_str, positive_int, seconds
from ._util.uri import ENDPOINT_VARS, parse_size
from .exceptions import ConfigError

log = logging.getLogger(__name__)

ADDRESSING_STYLES = ("auto", "path", "virtual")
ON_ERROR = ("raise", "skip")

_warned_insecure: set[str | None] = set()


def resolve_endpoint(endpoint_url: str | None) -> str | None:
    """The endpoint to use: the argument, else the standard environment variables.

    Raises:
        ConfigError: the URL carries credentials (``http://key:secret@host``), which would
            show in the process list; they belong in the AWS credential chain.
    """
    found = endpoint_url or next((os.environ[v] for v in ENDPOINT_VARS if os.environ.get(v)), None)
    if found and "@" in urllib.parse.urlsplit(found).netloc:
        raise ConfigError(
            "the endpoint URL carries credentials; pass them through the AWS credential chain "
            "(environment, profile) and give the endpoint as scheme://host:port"
        )
    return found


@dataclass(frozen=True)
class Access:
    """How to reach the store: the same settings for s5cmd (staging, listing) and boto3
    (listing fallbacks, HEADs, direct GETs, side fetches, uploads).

    Args:
        endpoint_url: the S3 endpoint; ``None``: ``AWS_ENDPOINT_URL_S3``,
            ``AWS_ENDPOINT_URL`` or ``S3_ENDPOINT_URL``, else AWS.
        anonymous: send unsigned requests and load no credentials (public buckets);
            s5cmd ``--no-sign-request``, boto3 ``signature_version=UNSIGNED``.
        profile: a named profile of the shared credentials and config files (else
            ``AWS_PROFILE``, else the default chain).
        credentials_file: a shared credentials file to read instead of
            ``~/.aws/credentials`` (as ``AWS_SHARED_CREDENTIALS_FILE``).
        region: the signing region (else ``AWS_REGION``, ``AWS_DEFAULT_REGION``, ``us-east-1``).
        requester_pays: send ``x-amz-request-payer: requester`` on every request, for
            requester-pays buckets.
        verify_ssl: verify the endpoint's TLS certificate. ``False`` (for self-signed
            on-premise stores) logs a warning.
        list_objects_v1: list with ListObjects (v1), for stores without ListObjectsV2.
        addressing_style: ``"auto"``, ``"path"`` or ``"virtual"``. s5cmd 2.3 has no such
            option: it uses virtual-host addressing on AWS and path addressing on a custom
            endpoint, so only the style it uses is accepted.

    Raises:
        ConfigError: an invalid or contradictory option, or one s5cmd cannot honour.
    """

    endpoint_url: str | None = None
    anonymous: bool = False
    profile: str | None = None
    credentials_file: str | None = None
    region: str | None = None
    requester_pays: bool = False
    verify_ssl: bool = True
    list_objects_v1: bool = False
    addressing_style: str = "auto"

    def __post_init__(self) -> None:
        for name in ("endpoint_url", "profile", "credentials_file", "region"):
            optional_str(name, getattr(self, name))
        for name in ("anonymous", "requester_pays", "verify_ssl", "list_objects_v1"):
            boolean(name, getattr(self, name))
        if self.anonymous and (self.profile or self.credentials_file):
            raise ConfigError(
                "anonymous=True sends unsigned requests and loads no credentials: "
                "drop profile/credentials_file, or anonymous"
            )
        if self.credentials_file is not None:
            path = os.path.abspath(os.path.expanduser(self.credentials_file))
            if not os.path.isfile(path):
                raise ConfigError(f"credentials_file {self.credentials_file!r} is not a file")
            object.__setattr__(self, "credentials_file", path)
        if self.addressing_style not in ADDRESSING_STYLES:
            raise ConfigError(
                f"addressing_style must be one of {', '.join(ADDRESSING_STYLES)}; "
                f"got {self.addressing_style!r}"
            )
        endpoint = self.endpoint()
        if self.addressing_style == "path" and not endpoint:
            raise ConfigError(
                "addressing_style='path' without an endpoint: s5cmd 2.3 always uses "
                "virtual-host addressing on AWS S3; leave addressing_style='auto'"
            )
        if self.addressing_style == "virtual" and endpoint:
            raise ConfigError(
                f"addressing_style='virtual' with the endpoint {endpoint}: s5cmd 2.3 always uses "
                "path addressing on a custom endpoint; use addressing_style='path' or 'auto'"
            )

    @classmethod
    def coerce(cls, access: Access | str | None, endpoint_url: str | None = None) -> Access:
        """One :class:`Access` from an ``access=`` and an ``endpoint_url=`` argument (a plain
        string ``access`` is an endpoint URL).

        Raises:
            ConfigError: both name an endpoint, and different ones.
        """
        if access is None or isinstance(access, str):
            if access and endpoint_url and access != endpoint_url:
                raise ConfigError(f"two endpoints given: {access!r} and {endpoint_url!r}")
            return cls(endpoint_url=endpoint_url or access or None)
        if not isinstance(access, Access):
            raise ConfigError(f"access must be an s5loader.Access, got {type(access).__name__}")
        if endpoint_url and access.endpoint_url and endpoint_url != access.endpoint_url:
            raise ConfigError(
                f"endpoint_url={endpoint_url!r} differs from "
                f"access.endpoint_url={access.endpoint_url!r}; give one"
            )
        if endpoint_url and not access.endpoint_url:
            return replace(access, endpoint_url=endpoint_url)
        return access

    def endpoint(self) -> str | None:
        """The endpoint in effect (the option, else the environment), or ``None`` for AWS."""
        return resolve_endpoint(self.endpoint_url)

    def region_name(self) -> str:
        """The region in effect: the option, ``AWS_REGION``, ``AWS_DEFAULT_REGION``, ``us-east-1``."""
        return (
            self.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        )

    def warn_insecure(self) -> None:
        """Log, once per endpoint and process, that TLS verification is off."""
        endpoint = self.endpoint()
        if not self.verify_ssl and endpoint not in _warned_insecure:
            _warned_insecure.add(endpoint)
            log.warning(
                "TLS certificate verification is off for %s: anyone on the path can read and "
                "alter the data; use it only for a trusted self-signed store",
                endpoint or "AWS S3",
            )

    def boto3_client(self) -> Any:
        """A new boto3 S3 client that sees the store as s5loader's own clients do: the same
        store, credentials, TLS and request options as the s5cmd calls get (for your code
        beside the loader: uploads, checks, a baseline).

        Raises:
            ConfigError: the profile does not exist.
        """
        if not self.verify_ssl:
            self.warn_insecure()
        return new_s3_client(
            endpoint=self.endpoint(),
            region=self.region_name(),
            anonymous=self.anonymous,
            profile=self.profile,
            credentials_file=self.credentials_file,
            requester_pays=self.requester_pays,
            verify_ssl=self.verify_ssl,
            addressing_style=self.addressing_style,
        )

    def s5cmd_flags(self) -> list[str]:
        """s5cmd's global flags for these settings (``--endpoint-url``, ``--no-sign-request``,
        ``--profile``, ...), for running s5cmd yourself; no secret is ever among them. s5cmd
        reads the region from ``AWS_REGION``."""
        flags: list[str] = []
        endpoint = self.endpoint()
        if endpoint:
            flags += ["--endpoint-url", endpoint]
        if self.anonymous:
            flags.append("--no-sign-request")
        if self.profile:
            flags += ["--profile", self.profile]
        if self.credentials_file:
            flags += ["--credentials-file", self.credentials_file]
        if self.requester_pays:
            flags += ["--request-payer", "requester"]
        if not self.verify_ssl:
            self.warn_insecure()
            flags.append("--no-verify-ssl")
        if self.list_objects_v1:
            flags.append("--use-list-objects-v1")
        # addressing_style: s5cmd picks path style on a custom endpoint and virtual-host style
        # on AWS by itself; __post_init__ refuses the combinations it cannot follow.
        return flags

    # -- the command line ----------------------------------------------------------------
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Add the access flags (``--endpoint-url``, ``--no-sign-request``, ``--profile``, ...),
        named as s5cmd names them, to a command's parser."""
        g = parser.add_argument_group("access to the store")
        g.add_argument(
            "--endpoint-url",
            help="the S3 endpoint (default: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL or "
            "S3_ENDPOINT_URL, else AWS)",
        )
        g.add_argument(
            "--no-sign-request",
            action="store_true",
            help="unsigned requests, no credentials (public buckets)",
        )
        g.add_argument(
            "--profile", help="a named profile of the shared credentials file (default: AWS_PROFILE)"
        )
        g.add_argument("--credentials-file", help="a credentials file instead of ~/.aws/credentials")
        g.add_argument("--region", help="the region (default: AWS_REGION, AWS_DEFAULT_REGION, us-east-1)")
        g.add_argument(
            "--request-payer", choices=["requester"], help="the requester pays (requester-pays buckets)"
        )
        g.add_argument(
            "--no-verify-ssl",
            action="store_true",
            help="do not verify the TLS certificate (self-signed stores; warns)",
        )
        g.add_argument(
            "--use-list-objects-v1", action="store_true", help="list with ListObjects v1 (old stores)"
        )
        g.add_argument(
            "--addressing-style",
            choices=list(ADDRESSING_STYLES),
            default="auto",
            help="path or virtual-host bucket addressing",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Access:
        """The :class:`Access` of the flags :meth:`add_arguments` added."""
        return cls(
            endpoint_url=args.endpoint_url or None,
            anonymous=bool(args.no_sign_request),
            profile=args.profile or None,
            credentials_file=args.credentials_file or None,
            region=args.region or None,
            requester_pays=args.request_payer == "requester",
            verify_ssl=not args.no_verify_ssl,
            list_objects_v1=bool(args.use_list_objects_v1),
            addressing_style=args.addressing_style,
        )

    def to_args(self) -> list[str]:
        """The flags :meth:`add_arguments` added that give these settings (the inverse of
        :meth:`from_args`), for running ``s5loader`` commands from Python."""
        argv = ["--endpoint-url", self.endpoint_url] if self.endpoint_url else []
        for flag, value in (
            ("--profile", self.profile),
            ("--credentials-file", self.credentials_file),
            ("--region", self.region),
        ):
            if value:
                argv += [flag, value]
        argv += [
            flag
            for flag, on in (
                ("--no-sign-request", self.anonymous),
                ("--no-verify-ssl", not self.verify_ssl),
                ("--use-list-objects-v1", self.list_objects_v1),
            )
            if on
        ]
        if self.requester_pays:
            argv += ["--request-payer", "requester"]
        if self.addressing_style != "auto":
            argv += ["--addressing-style", self.addressing_style]
        return argv


@dataclass(frozen=True)
class StagingOptions:
    """How samples are staged: one list of options, with the same names, defaults and checks,
    for every front end (:class:`~s5loader.S5Sampler`, :class:`~s5loader.S5IterableDataset`,
    :class:`~s5loader.Prefetcher` and ``s5loader prefetch``). Each takes one of these as
    ``options=``, or its fields as keyword arguments (which override ``options``' fields). The
    engine runs on this object.

    Args:
        budget: most bytes staged and not yet read (``"2GiB"``, ``"500MB"`` or an int);
            stored as an int of bytes.
        samples_per_call: samples per s5cmd command file.
        calls_in_flight: s5cmd calls running at once.
        s5cmd_workers: s5cmd's ``--numworkers`` (parallel requests per call). The defaults, 4
            calls of 32 workers, keep 128 requests in flight: s5cmd 2.3.0 keeps 2 idle
            connections per process, so more calls of fewer workers dial fewer new connections
            per request than fewer calls of many (docs/s5cmd-connections.md has the figures).
        block_size: most samples in a block for ``shuffle="block"`` and wildcard fetches; a
            key prefix of up to twice as many is one block where its key names would cut it
            only into parts too small for a wildcard line to pay for its LIST (fewer than 13
            objects: decimal keys' tens of one-object samples make blocks of a hundred).
        stall_timeout: seconds without progress before a call or copy counts as stalled.
        retries: retries of a sample that failed for a transient reason.
        retry_backoff: the first pause before a retry, in seconds (doubling).
        on_error: ``"raise"`` or ``"skip"`` a sample that cannot be fetched.
        verify: check each staged file's size and, for single-part uploads, MD5 ETag.
        keep_staged: keep staged files across epochs (sampler only).
        shrink_budget: shrink a budget larger than the free space instead of failing.
        staging_dir: the staging root (sampler only; ``None``: picked by free space).
        epoch_cache: bytes of read samples kept staged for later epochs, on top of the budget
            (``"8GiB"``; 0: none), for the node's local ranks together.
        keep_epoch_cache: leave the epoch cache behind on ``close()`` for a later run.

    Raises:
        ConfigError: an invalid option.
    """

    budget: int = 2 * 1024**3  # also a string such as "2GiB", turned into bytes on creation
    samples_per_call: int = 1000
    calls_in_flight: int = 4
    s5cmd_workers: int = 32
    block_size: int = 64
    stall_timeout: float = 60.0
    retries: int = 3
    retry_backoff: float = 0.5
    on_error: str = "raise"
    verify: bool = False
    keep_staged: bool = False
    shrink_budget: bool = False
    staging_dir: str | None = None
    epoch_cache: int = 0  # also a string such as "8GiB"
    keep_epoch_cache: bool = False

    @classmethod
    def merge(cls, options: StagingOptions | None, overrides: dict[str, Any], who: str) -> StagingOptions:
        """``options`` (default: the defaults) with the fields named in ``overrides`` replaced:
        how a front end turns its ``options=`` and keyword arguments into one object.

        Raises:
            ConfigError: ``options`` is not a :class:`StagingOptions`, a keyword is no staging
                option (naming the closest one), or a value is invalid.
        """
        if options is not None and not isinstance(options, StagingOptions):
            raise ConfigError(
                f"{who}: options must be an s5loader.StagingOptions, got {type(options).__name__}"
            )
        names = [f.name for f in fields(cls)]
        for name in overrides:
            if name not in names:
                close = difflib.get_close_matches(name, names, 1)
                hint = (
                    f"; did you mean {close[0]}?"
                    if close
                    else f"; the staging options are {', '.join(names)}"
                )
                raise ConfigError(f"{who} got an unknown option {name}={overrides[name]!r}{hint}")
        base = options if options is not None else cls()
        return replace(base, **overrides) if overrides else base

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", parse_size(self.budget, "budget"))
        object.__setattr__(
            self,
            "epoch_cache",
            0 if self.epoch_cache in (0, None) else parse_size(self.epoch_cache, "epoch_cache"),
        )
        if self.epoch_cache and self.keep_staged:
            raise ConfigError(
                "keep_staged=True keeps every staged sample already; epoch_cache is for a data set "
                "larger than the budget: give one or the other"
            )
        for name in ("samples_per_call", "calls_in_flight", "s5cmd_workers", "block_size"):
            positive_int(name, getattr(self, name))
        for name in ("verify", "keep_staged", "shrink_budget", "keep_epoch_cache"):
            boolean(name, getattr(self, name))
        if not isinstance(self.retries, int) or isinstance(self.retries, bool) or self.retries < 0:
            raise ConfigError(f"retries must be an int >= 0, got {self.retries!r}")
        seconds("stall_timeout", self.stall_timeout, positive=True)
        seconds("retry_backoff", self.retry_backoff, positive=False)
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"on_error must be one of {', '.join(ON_ERROR)}; got {self.on_error!r}")
        optional_str("staging_dir", self.staging_dir)
