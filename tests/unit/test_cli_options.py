"""The command line names a mistyped option with the closest known one, for each command."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "argv, wrong, right",
    [
        (["prefetch", "s3://b/p/", "--cache", "/tmp/x", "--budjet", "1GiB"], "--budjet", "--budget"),
        (["ls", "s3://b/p/", "--limt", "3"], "--limt", "--limit"),
        (["fetch", "s3://b/k", "/tmp/x", "--verfy"], "--verfy", "--verify"),
    ],
)
def test_the_cli_names_a_mistyped_option(
    argv: list[str], wrong: str, right: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from s5loader.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized option: {wrong} (did you mean {right}?)" in err
    assert "are required" not in err


def test_the_command_is_listed_and_names_a_mistyped_option(capsys: pytest.CaptureFixture[str]) -> None:
    from s5loader.cli import main

    assert main(["--help"]) == 0
    assert "  pack " in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["pack", "s3://b/raw/", "s3://b/shards/", "--shard-sise", "1MB"])
    assert exit_.value.code == 2
    assert "unrecognized option: --shard-sise (did you mean --shard-size?)" in capsys.readouterr().err
