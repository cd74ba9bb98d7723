"""Flag values the command line refuses before any call, and the order of ``exec`` options,
through ``main(argv)`` against the test double (see conftest)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.sdk.cli import main


@pytest.fixture
def cli_env(double: Any, isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("ORCHARD_ENDPOINT", double.address)
    monkeypatch.setenv("ORCHARD_TOKEN", double.token)
    return dict(os.environ)


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--memory", "99999999999999999999999999", "from 1 byte to 8 EiB"),
        ("--memory", "1e400", "from 1 byte to 8 EiB"),
        ("--memory", "0", "from 1 byte to 8 EiB"),
        ("--disk", "lots", "from 1 byte to 8 EiB"),
        ("--cpus", "inf", "from 0.001 to 1,000,000"),
        ("--cpus", "nan", "from 0.001 to 1,000,000"),
        ("--cpus", "-1", "from 0.001 to 1,000,000"),
        ("--pids", "99999999999999999999999", "from 1 to 2**63-1"),
        ("--pids", "0", "from 1 to 2**63-1"),
        ("--timeout", "inf", "from 1ms to 10 years"),
        ("--timeout", "1e300s", "from 1ms to 10 years"),
    ],
)
def test_out_of_range_create_flags_are_one_line_usage_errors(  # noqa: PLR0917 - parametrized
    cli_env: dict[str, str], double: Any, capsys: Any, flag: str, value: str, words: str
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["sandbox", "create", flag, value])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert f"argument {flag}:" in last and words in last, err
    assert double.servicer.sandboxes == {}  # refused before any call


def test_exec_timeout_out_of_range_is_a_usage_error(cli_env: dict[str, str], capsys: Any) -> None:
    for argv in (["--timeout", "inf", "sbx-x"], ["sbx-x", "--timeout", "inf"]):
        with pytest.raises(SystemExit) as caught:
            main(["sandbox", "exec", *argv, "--", "true"])
        assert caught.value.code == 2
        assert "argument --timeout:" in capsys.readouterr().err


def test_a_refused_spec_field_is_reported_by_its_flag(
    cli_env: dict[str, str], double: Any, capsys: Any
) -> None:
    double.fail(
        "CreateSandbox",
        grpc.StatusCode.INVALID_ARGUMENT,
        "spec.resources.memory_bytes: 1024 is below the 33554432 a sandbox needs to start",
        reason="INVALID_ARGUMENT",
        metadata={"field": "spec.resources.memory_bytes"},
    )
    with pytest.raises(SystemExit) as caught:
        main(["sandbox", "create", "--memory", "1K"])
    assert caught.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        "orchard: error: argument --memory: 1024 is below the 33554432 a sandbox needs to start"
    )


def test_exec_options_after_the_id_are_options(
    cli_env: dict[str, str], double: Any, capsys: Any
) -> None:
    assert main(["sandbox", "create"]) == 0
    sandbox_id = capsys.readouterr().out.strip()
    argv = ["sandbox", "exec", sandbox_id, "--timeout", "5s", "--env", "X=1", "--json"]
    assert main([*argv, "--", "sh", "-c", "echo $X"]) == 0
    out = capsys.readouterr().out
    assert '"stdout": "1\\n"' in out and '"exit_code": 0' in out, out
    # Before the id and after it mix: --env appends, --timeout set once.
    argv = ["sandbox", "exec", "--env", "A=a", sandbox_id, "--env", "B=b", "--"]
    assert main([*argv, "sh", "-c", "echo $A$B"]) == 0
    assert capsys.readouterr().out == "ab\n"
    # The command's own options after `--` stay the command's.
    assert main(["sandbox", "exec", sandbox_id, "--", "sh", "-c", "echo --timeout"]) == 0
    assert capsys.readouterr().out == "--timeout\n"
    # An option after the id without `--` is refused with the fix, not run as a command.
    with pytest.raises(SystemExit) as caught:
        main(["sandbox", "exec", sandbox_id, "--timeout", "5s", "ls"])
    assert caught.value.code == 2
    assert "put the command after `--`" in capsys.readouterr().err
