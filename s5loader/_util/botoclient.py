"""Making boto3 S3 clients from plain settings (the fields of :class:`~s5loader.config.Access`).

Every client this process makes shares one botocore data loader (the parsed S3 service model
and endpoint rules): parsing that JSON is most of what a new client costs, and it holds parsed
JSON only, so a forked DataLoader worker inherits it safely.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ..exceptions import ConfigError

# one data loader per botocore data path, shared by every client of this process
_LOADERS: dict[Any, Any] = {}
_LOADERS_LOCK = threading.Lock()


def _new_lock_after_fork() -> None:
    global _LOADERS_LOCK
    _LOADERS_LOCK = threading.Lock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_new_lock_after_fork)


def _session(credentials_file: str | None, profile: str | None) -> Any:
    """A boto3 session over a botocore session whose data loader is the shared one."""
    import boto3
    import botocore.session

    core = botocore.session.Session()
    if credentials_file:
        core.set_config_variable("credentials_file", credentials_file)
    if profile:
        core.set_config_variable("profile", profile)  # data_path may be the profile's
    with _LOADERS_LOCK:
        data_path = core.get_config_variable("data_path")
        loader = _LOADERS.get(data_path)
        if loader is None:
            loader = _LOADERS[data_path] = core.get_component("data_loader")
        else:
            core.register_component("data_loader", loader)
        try:
            return boto3.session.Session(botocore_session=core, profile_name=profile)
        finally:
            # each boto3 Session appends its own data folder to the shared loader's paths
            loader.search_paths[:] = list(dict.fromkeys(loader.search_paths))


def new_s3_client(
    *,
    endpoint: str | None,
    region: str,
    anonymous: bool,
    profile: str | None,
    credentials_file: str | None,
    requester_pays: bool,
    verify_ssl: bool,
    addressing_style: str,
) -> Any:
    """A new boto3 S3 client with these settings (5 standard retries, 64 pooled connections).

    Raises:
        ConfigError: the profile does not exist.
    """
    import botocore
    from botocore.config import Config

    extra: dict[str, Any] = {}
    if anonymous:
        extra["signature_version"] = botocore.UNSIGNED
    if addressing_style != "auto":
        extra["s3"] = {"addressing_style": addressing_style}
    try:
        session = _session(credentials_file, profile)
        client = session.client(
            "s3",
            endpoint_url=endpoint,
            region_name=region,
            verify=False if not verify_ssl else None,
            config=Config(retries={"max_attempts": 5, "mode": "standard"}, max_pool_connections=64, **extra),
        )
    except botocore.exceptions.ProfileNotFound as exc:
        raise ConfigError(
            f"profile {profile!r} is not in the AWS config or credentials files: {exc}"
        ) from exc
    if requester_pays:
        # On every request, those of download_file's transfer manager included.
        client.meta.events.register("before-sign.s3", _request_payer)
    return client


def _request_payer(request: Any, **kwargs: Any) -> None:
    request.headers["x-amz-request-payer"] = "requester"
