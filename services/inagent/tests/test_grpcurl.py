"""The agent works with a stock gRPC tool: reflection, health, and an Exec with JSON input."""

from __future__ import annotations

import base64
import json
import subprocess
from typing import Any

import pytest


@pytest.fixture(scope="module")
def grpcurl(procs: Any, agent: Any) -> Any:
    binary = procs.grpcurl()
    if binary is None:
        pytest.fail(
            "grpcurl not found beside the interpreter or on PATH (`make setup` installs it)"
        )
    socket = agent.address.removeprefix("unix:")

    def call(*args: str, data: str | None = None) -> str:
        command = [binary, "-plaintext", "-unix"]
        if data is not None:
            command += ["-d", data]
        command += [socket, *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout

    return call


def test_reflection_lists_the_services(grpcurl: Any) -> None:
    services = grpcurl("list").split()
    assert "orchard.inagent.v1.AgentService" in services
    assert "grpc.health.v1.Health" in services
    methods = grpcurl("list", "orchard.inagent.v1.AgentService").split()
    assert "orchard.inagent.v1.AgentService.ExecStream" in methods


def test_health_is_serving(grpcurl: Any) -> None:
    assert json.loads(grpcurl("grpc.health.v1.Health/Check")) == {"status": "SERVING"}


def test_exec_with_json_input(grpcurl: Any) -> None:
    request = json.dumps({"command": {"argv": ["printf", "hello \\377"]}})
    reply = json.loads(grpcurl("orchard.inagent.v1.AgentService/Exec", data=request))
    assert base64.b64decode(reply["result"]["stdout"]) == b"hello \xff"
    assert reply["result"]["status"]["exit_code"] == 0  # a set oneof member shows even at 0
