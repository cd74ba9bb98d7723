"""``--ready-fd N``: the agent reports its addresses on an inherited pipe once SERVING."""

from __future__ import annotations

import os
import select
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchard.inagent.v1 import inagent_service_pb2, inagent_service_pb2_grpc
from orchard.types.v1 import exec_pb2

TIMEOUT_S = 15.0


def read_to_eof(fd: int, timeout: float) -> bytes:
    """Everything written to ``fd`` until every writer closed it, waiting by poll, not sleep."""
    chunks = []
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        if not poller.poll(timeout * 1000):
            raise TimeoutError("no end of file on the ready pipe")
        chunk = os.read(fd, 4096)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def start(procs: Any, tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], int]:
    read_end, write_end = os.pipe()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_")}
    try:
        process = subprocess.Popen(
            [*procs.agent_command(), "--grace-period-s", "1", "--ready-fd", str(write_end), *args],
            pass_fds=(write_end,),
            stdin=subprocess.DEVNULL,
            stderr=(tmp_path / "agent.log").open("wb"),
            env=env,
        )
    finally:
        os.close(write_end)
    return process, read_end


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_ready_fd_reports_the_addresses_once_serving(procs: Any, tmp_path: Path) -> None:
    socket = tmp_path / "a.sock"
    process, ready = start(
        procs, tmp_path, "--listen", f"unix:{socket}", "--working-dir", str(tmp_path)
    )
    try:
        lines = read_to_eof(ready, TIMEOUT_S).decode().splitlines()
        assert lines == [f"unix:{socket}"]
        with grpc.insecure_channel(lines[0]) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            # Commands do not inherit the pipe: the agent closed it before they could.
            reply = inagent_service_pb2_grpc.AgentServiceStub(channel).Exec(
                inagent_service_pb2.ExecRequest(
                    command=exec_pb2.Command(shell="ls /proc/self/fd | wc -l")
                ),
                timeout=10,
            )
            assert reply.result.stdout.strip() == b"4"  # 0, 1, 2 and ls's own directory handle
    finally:
        os.close(ready)
        stop(process)


def test_ready_fd_with_tcp_port_zero_gives_the_bound_port(procs: Any, tmp_path: Path) -> None:
    process, ready = start(procs, tmp_path, "--listen", "127.0.0.1:0")
    try:
        (line,) = read_to_eof(ready, TIMEOUT_S).decode().splitlines()
        host, _, port = line.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
    finally:
        os.close(ready)
        stop(process)


def test_a_failed_start_closes_the_pipe_with_nothing_written(procs: Any, tmp_path: Path) -> None:
    occupied = tmp_path / "not-a-dir"
    occupied.write_text("x")
    process, ready = start(procs, tmp_path, "--listen", f"unix:{occupied}/a.sock")
    try:
        assert read_to_eof(ready, TIMEOUT_S) == b""
        assert process.wait(TIMEOUT_S) != 0
    finally:
        os.close(ready)
        stop(process)


@pytest.mark.parametrize("value", ["-1", "x"])
def test_a_bad_ready_fd_is_a_configuration_error(procs: Any, value: str) -> None:
    result = subprocess.run(
        [*procs.agent_command(), "--ready-fd", value], capture_output=True, timeout=60, check=False
    )
    assert result.returncode == 2
    assert b"ready_fd" in result.stderr


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--ready-fd", "3"], {}),
        (["--set", "ready_fd=7"], {}),
        ([], {"ORCHARD_INAGENT_READY_FD": "5"}),
        (["--ready-fd", "03"], {}),  # a spelling only pydantic reads
    ],
)
def test_both_configuration_paths_read_ready_fd(argv: list[str], env: dict[str, str]) -> None:
    import argparse

    from orchard.core.config import add_config_arguments, config_from_args
    from orchard.inagent.config import AGENT_FLAGS, load_agent_config
    from orchard.inagent.config_model import AgentConfigModel

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, AGENT_FLAGS)
    args = parser.parse_args(argv)
    quick = load_agent_config(args, env, "ORCHARD_INAGENT_")
    full = config_from_args(AgentConfigModel, args, env=env, env_prefix="ORCHARD_INAGENT_")
    assert quick == full.to_config()
    assert quick.ready_fd is not None and quick.ready_fd in (3, 5, 7)
