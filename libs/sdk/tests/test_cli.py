"""The ``orchard`` command line through ``main(argv)`` and as a subprocess, against the
fault-injecting test double (see conftest) with exec and files on a real agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_explains_every_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "orchard.sdk.cli", "--help"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0
    for command in ("orchard up", "sandbox create", "sandbox exec", "sandbox cp", "sandbox ls"):
        assert command in result.stdout
    for command in ("create", "exec", "cp", "ls", "rm", "get"):
        with pytest.raises(SystemExit) as caught:
            main(["sandbox", command, "--help"])
        assert caught.value.code == 0


def test_create_ls_get_rm(cli_env: dict[str, str], double: Any, capsys: Any) -> None:
    code, out, _ = run(
        capsys,
        "sandbox",
        "create",
        "--label",
        "task=cli",
        "--memory",
        "512M",
        "--cpus",
        "0.5",
        "--timeout",
        "90s",
    )
    assert code == 0
    sandbox_id = out.strip()
    spec = double.servicer.sandboxes[sandbox_id].spec
    assert spec.resources.memory_bytes == 512 << 20 and spec.resources.cpu_millis == 500
    assert spec.heartbeat_timeout.seconds == 90 and dict(spec.labels) == {"task": "cli"}
    code, out, _ = run(capsys, "sandbox", "ls", "--label", "task=cli", "--json")
    listed = json.loads(out)
    assert code == 0 and [item["id"] for item in listed] == [sandbox_id]
    assert listed[0]["state"] == "READY" and listed[0]["labels"] == {"task": "cli"}
    code, out, _ = run(capsys, "sandbox", "ls")
    assert sandbox_id in out and "READY" in out and out.startswith("ID")
    code, out, _ = run(capsys, "sandbox", "get", sandbox_id, "--json")
    assert json.loads(out)["resources"]["memory_bytes"] == 512 << 20
    code, out, _ = run(capsys, "sandbox", "rm", sandbox_id, "sbx-already-gone", "--json")
    assert code == 0 and json.loads(out) == {"deleted": [sandbox_id, "sbx-already-gone"]}
    assert double.servicer.sandboxes == {}


def test_usage_errors_exit_2(cli_env: dict[str, str], capsys: Any) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["sandbox", "create", "--memory", "lots"])
    assert caught.value.code == 2
    assert "not a size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as caught:
        main(["sandbox", "cp", "a", "b"])
    assert caught.value.code == 2


def test_service_errors_are_one_line(cli_env: dict[str, str], double: Any, capsys: Any) -> None:
    code, _, err = run(capsys, "sandbox", "get", "sbx-missing")
    assert code == 1
    assert err.count("\n") == 1 and "sbx-missing" in err and "reaped" in err
    double.fail(
        "CreateSandbox",
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "admission queue full",
        reason="RESOURCE_EXHAUSTED",
    )
    code, _, err = run(capsys, "sandbox", "create")
    assert code == 1 and err == "orchard: admission queue full [RESOURCE_EXHAUSTED]\n"


def test_unreachable_says_run_orchard_up(isolated_env: Path, capsys: Any) -> None:
    from orchard.sdk.connection import Profile, write_profile

    path = write_profile(Profile(endpoint="127.0.0.1:1", token="t"))
    assert (path.stat().st_mode & 0o777) == 0o600
    code, _, err = run(capsys, "sandbox", "ls")
    assert code == 1
    assert err == (
        "orchard: cannot reach the environment service at 127.0.0.1:1: run `orchard up` first "
        "(or set $ORCHARD_ENDPOINT)\n"
    )


def test_nothing_configured(isolated_env: Path, capsys: Any) -> None:
    code, _, err = run(capsys, "sandbox", "ls")
    assert code == 1 and "run `orchard up`" in err and "--endpoint" in err


def test_exec_streams_and_exits_with_the_status(cli_env: dict[str, str], double: Any) -> None:
    sandbox_id = main_out(["sandbox", "create"], cli_env)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchard.sdk.cli",
            "sandbox",
            "exec",
            sandbox_id,
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 7",
        ],
        check=False,
        capture_output=True,
        env=cli_env,
        timeout=60,
    )
    assert (result.returncode, result.stdout, result.stderr) == (7, b"out\n", b"err\n")
    result = subprocess.run(
        [sys.executable, "-m", "orchard.sdk.cli", "sandbox", "exec", "-i", sandbox_id, "--", "cat"],
        input=b"piped",
        check=False,
        capture_output=True,
        env=cli_env,
        timeout=60,
    )
    assert (result.returncode, result.stdout) == (0, b"piped")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchard.sdk.cli",
            "sandbox",
            "exec",
            "--json",
            "--timeout",
            "0.3",
            sandbox_id,
            "--",
            "sleep",
            "5",
        ],
        check=False,
        capture_output=True,
        env=cli_env,
        timeout=60,
    )
    assert result.returncode == 124
    assert json.loads(result.stdout)["timed_out"] is True
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchard.sdk.cli",
            "sandbox",
            "exec",
            sandbox_id,
            "--",
            "/no/such/thing",
        ],
        check=False,
        capture_output=True,
        env=cli_env,
        timeout=60,
    )
    assert result.returncode == 127 and result.stderr.count(b"\n") == 1


def test_cp_both_ways(cli_env: dict[str, str], tmp_path: Path, capsys: Any) -> None:
    code, out, _ = run(capsys, "sandbox", "create")
    sandbox_id = out.strip()
    source = tmp_path / "tree"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "a.txt").write_text("a")
    remote_root = tmp_path / "remote"
    remote_root.mkdir()
    # Into an existing directory: lands as remote/tree, like cp -r.
    code, out, _ = run(
        capsys, "sandbox", "cp", str(source), f"{sandbox_id}:{remote_root}", "--json"
    )
    assert code == 0 and json.loads(out) == {
        "destination": f"{sandbox_id}:{remote_root}/tree",
        "bytes": 1,
    }
    assert (remote_root / "tree" / "sub" / "a.txt").read_text() == "a"
    back = tmp_path / "back"
    back.mkdir()
    code, _, _ = run(capsys, "sandbox", "cp", f"{sandbox_id}:{remote_root}/tree", str(back))
    assert code == 0 and (back / "tree" / "sub" / "a.txt").read_text() == "a"
    code, _, err = run(capsys, "sandbox", "cp", f"{sandbox_id}:{remote_root}/nope", str(back))
    assert code == 1 and "nope" in err


def main_out(argv: list[str], env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "orchard.sdk.cli", *argv],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()
