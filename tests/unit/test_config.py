"""The options objects (fast tier: no server): StagingOptions and Access are checked once,
with messages that say what to change; the renamed sampler keywords; the daemon's flags.

Private modules (``s5loader._index``, ``s5loader._s3api``, ``s5loader._daemon``, ``s5loader._s5cmd``)
are imported on purpose: their own behaviour is what these tests check."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from s5loader import Access, S5Dataset, S5Sampler, StagingOptions
from s5loader._daemon import PrefetchOptions, build_parser, options_from_args
from s5loader._index.sample import Field, Sample
from s5loader._s3api.client import s3_client
from s5loader._s5cmd import S5cmd
from s5loader.exceptions import ConfigError


def _dataset() -> S5Dataset:
    return S5Dataset(
        [Sample(f"k{i}", (Field("data", f"s3://b/k{i}", 10, ""),)) for i in range(4)],
        endpoint_url="http://127.0.0.1:9",
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"budget": "lots"}, "is not a size"),
        ({"calls_in_flight": 0}, "calls_in_flight must be a positive int"),
        ({"s5cmd_workers": -1}, "s5cmd_workers must be a positive int"),
        ({"block_size": True}, "block_size must be"),
        ({"retries": -1}, "retries must be an int >= 0"),
        ({"stall_timeout": 0}, "stall_timeout must be a positive"),
        ({"on_error": "ignore"}, "on_error must be one of raise, skip"),
    ],
)
def test_staging_options_say_what_to_change(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StagingOptions(**change)


def test_staging_options_take_sizes() -> None:
    assert StagingOptions(budget="2MiB").budget == 2 * 1024 * 1024


def test_renamed_sampler_keywords_warn_and_still_work(staging_root: str) -> None:
    ds = _dataset()
    with pytest.warns(DeprecationWarning, match="use calls_in_flight="):
        s = S5Sampler(ds, staging_dir=staging_root, budget=1000, buffers=3)
    assert s._options.calls_in_flight == 3
    with pytest.warns(DeprecationWarning, match="use s5cmd_workers="):
        s = S5Sampler(ds, staging_dir=staging_root, budget=1000, numworkers=8)
    assert (s._options.s5cmd_workers, s._run.s5cmd.numworkers) == (8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = S5Sampler(ds, staging_dir=staging_root, budget=1000, calls_in_flight=4, s5cmd_workers=16)
    assert (s._options.calls_in_flight, s._run.s5cmd.numworkers) == (4, 16)
    with pytest.raises(ConfigError, match="buffers= is the former name of calls_in_flight="):
        S5Sampler(ds, staging_dir=staging_root, budget=1000, buffers=3, calls_in_flight=4)


def test_daemon_takes_the_samplers_staging_options(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "s3://b/p/",
            "--cache",
            str(tmp_path),
            "--budget",
            "1MiB",
            "--shuffle",
            "block",
            "--block-size",
            "8",
            "--calls-in-flight",
            "3",
            "--s5cmd-workers",
            "32",
            "--verify",
            "--retries",
            "1",
            "--stall-timeout",
            "9",
        ]
    )
    opts = options_from_args(args)
    engine = opts.staging
    assert (opts.shuffle, engine.block_size, engine.calls_in_flight, engine.s5cmd_workers) == (
        "block",
        8,
        3,
        32,
    )
    assert (engine.verify, engine.retries, engine.stall_timeout) == (True, 1, 9.0)
    assert (
        options_from_args(
            build_parser().parse_args(["s3://b/p/", "--cache", "c", "--budget", "1", "--shuffle"])
        ).shuffle
        is True
    )
    old = options_from_args(
        build_parser().parse_args(["s3://b/p/", "--cache", "c", "--budget", "1", "--buffers", "5"])
    )
    assert old.staging.calls_in_flight == 5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["s3://b/p/", "--cache", "c", "--budget", "1", "--shuffle", "random"])


def test_access_flags_reach_the_daemon_options(tmp_path: Path) -> None:
    creds = tmp_path / "credentials"
    creds.write_text("[x]\naws_access_key_id = A\naws_secret_access_key = B\n")
    args = build_parser().parse_args(
        [
            "s3://b/p/",
            "--cache",
            str(tmp_path),
            "--budget",
            "1MiB",
            "--endpoint-url",
            "http://127.0.0.1:9",
            "--profile",
            "x",
            "--credentials-file",
            str(creds),
            "--region",
            "eu-west-3",
            "--request-payer",
            "requester",
            "--no-verify-ssl",
            "--use-list-objects-v1",
            "--addressing-style",
            "path",
        ]
    )
    a = options_from_args(args).store
    assert a == Access(
        "http://127.0.0.1:9",
        profile="x",
        credentials_file=str(creds),
        region="eu-west-3",
        requester_pays=True,
        verify_ssl=False,
        list_objects_v1=True,
        addressing_style="path",
    )


def test_access_maps_onto_s5cmd_flags(tmp_path: Path) -> None:
    creds = tmp_path / "credentials"
    creds.write_text("[default]\n")
    s5 = S5cmd(
        access=Access(
            "http://127.0.0.1:9",
            profile="p",
            credentials_file=str(creds),
            requester_pays=True,
            verify_ssl=False,
            list_objects_v1=True,
            region="eu-west-3",
        ),
        binary="s5cmd",
    )
    argv = s5._argv("ls")
    assert argv[argv.index("--endpoint-url") + 1] == "http://127.0.0.1:9"
    assert argv[argv.index("--profile") + 1] == "p"
    assert argv[argv.index("--credentials-file") + 1] == str(creds)
    assert argv[argv.index("--request-payer") + 1] == "requester"
    assert {"--no-verify-ssl", "--use-list-objects-v1"} <= set(argv)
    assert s5.env()["AWS_REGION"] == "eu-west-3"
    assert "--no-sign-request" in S5cmd(access=Access(anonymous=True), binary="s5cmd")._argv("ls")


def test_access_maps_onto_boto3() -> None:
    import botocore

    c = s3_client(Access("http://127.0.0.1:9", anonymous=True, region="eu-west-3", addressing_style="path"))
    assert c.meta.config.signature_version is botocore.UNSIGNED
    assert c.meta.config.s3["addressing_style"] == "path"
    assert c.meta.region_name == "eu-west-3"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"anonymous": True, "profile": "p"}, "anonymous=True sends unsigned requests"),
        ({"credentials_file": "/nonexistent/credentials"}, "is not a file"),
        ({"addressing_style": "dns"}, "addressing_style must be one of auto, path, virtual"),
        (
            {"addressing_style": "virtual", "endpoint_url": "http://127.0.0.1:9"},
            "s5cmd 2.3 always uses path addressing",
        ),
        ({"anonymous": "yes"}, "anonymous must be True or False"),
    ],
)
def test_access_refuses_what_one_client_cannot_do(
    kw: dict, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match=message):
        Access(**kw)


def test_path_style_without_endpoint_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="always uses virtual-host addressing on AWS"):
        Access(addressing_style="path")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # the standard environment counts
    assert Access(addressing_style="path").endpoint() == "http://127.0.0.1:9"


def test_endpoint_given_twice_must_agree() -> None:
    assert Access.coerce(Access(region="r"), "http://h:1") == Access("http://h:1", region="r")
    with pytest.raises(ConfigError, match="differs from access.endpoint_url"):
        S5Dataset.from_prefix("s3://bkt/p/", endpoint_url="http://a:1", access=Access("http://b:2"))


def test_missing_profile_is_a_config_error(tmp_path: Path) -> None:
    creds = tmp_path / "credentials"
    creds.write_text("[other]\naws_access_key_id = A\naws_secret_access_key = B\n")
    with pytest.raises(ConfigError, match="profile 'nope'"):
        s3_client(Access("http://127.0.0.1:9", profile="nope", credentials_file=str(creds)))


def test_clients_share_one_parsed_service_model(tmp_path: Path) -> None:
    from s5loader._util import botoclient as config

    creds = tmp_path / "credentials"
    creds.write_text("[p]\naws_access_key_id = a\naws_secret_access_key = b\n")
    Access("http://127.0.0.1:9").boto3_client()
    paths = [list(found.search_paths) for found in config._LOADERS.values()]
    for _ in range(3):
        Access("http://127.0.0.1:9", profile="p", credentials_file=str(creds)).boto3_client()
    # one loader per data path, its search paths not growing with each client
    assert paths and [list(found.search_paths) for found in config._LOADERS.values()] == paths
    # a missing profile is still named once the model is cached (botocore finds it later then)
    with pytest.raises(ConfigError, match="profile 'nope'"):
        Access("http://127.0.0.1:9", profile="nope", credentials_file=str(creds)).boto3_client()


def test_the_given_profile_wins_over_a_missing_one_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    creds = tmp_path / "credentials"
    creds.write_text("[p]\naws_access_key_id = a\naws_secret_access_key = b\n")
    monkeypatch.setenv("AWS_PROFILE", "ghost")
    client = Access("http://127.0.0.1:9", profile="p", credentials_file=str(creds)).boto3_client()
    assert client.meta.region_name


def test_access_to_args_round_trips_and_reaches_the_prefetcher(tmp_path: Path) -> None:
    from s5loader import Prefetcher

    creds = tmp_path / "credentials"
    creds.write_text("[p]\naws_access_key_id = a\naws_secret_access_key = b\n")
    access = Access(
        endpoint_url="http://127.0.0.1:9",
        profile="p",
        credentials_file=str(creds),
        region="eu-west-1",
        requester_pays=True,
        verify_ssl=False,
        list_objects_v1=True,
        addressing_style="path",
    )
    parser = build_parser()
    args = parser.parse_args(["s3://b/p/", "--cache", "c", "--budget", "1", *access.to_args()])
    assert Access.from_args(args) == access
    assert Access.from_args(
        parser.parse_args(["s3://b/p/", "--cache", "c", "--budget", "1", *Access(anonymous=True).to_args()])
    ) == Access(anonymous=True)
    p = Prefetcher(
        "s3://b/p/",
        cache=tmp_path / "c",
        budget=1000,
        access=access,
        shuffle="block",
        block_size=8,
        calls_in_flight=3,
        s5cmd_workers=16,
    )
    opts = options_from_args(parser.parse_args(p.argv))
    assert (opts.store, opts.shuffle) == (access, "block")
    assert (
        opts.staging.block_size,
        opts.staging.calls_in_flight,
        opts.staging.s5cmd_workers,
        opts.budget,
    ) == (8, 3, 16, 1000)
    # one StagingOptions for every front end: the prefetcher takes it too
    q = Prefetcher(
        "s3://b/p/", StagingOptions(budget=1000, retries=7, retry_backoff=0.25), cache=tmp_path / "c"
    )
    assert options_from_args(parser.parse_args(q.argv)).staging == StagingOptions(
        budget=1000, retries=7, retry_backoff=0.25
    )
    with pytest.raises(ConfigError, match="did you mean retries"):
        Prefetcher("s3://b/p/", cache=tmp_path / "c", budget=1000, retires=2)
    with pytest.raises(ConfigError, match="shuffle"):
        Prefetcher("s3://b/p/", cache=tmp_path / "c", budget=1000, shuffle="blocks")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"retries": -1}, "retries must be an int >= 0"),
        ({"stall_timeout": 0}, "stall_timeout must be a positive"),
        ({"calls_in_flight": 0}, "calls_in_flight must be a positive int"),
        ({"on_error": "ignore"}, "on_error must be one of"),
    ],
)
def test_staging_options_checked_as_the_samplers(tmp_path: Path, change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PrefetchOptions.of("s3://b/p/", str(tmp_path), 10**6, **change)
