"""A client no one here wrote drives the environment service: grpcurl, a Go binary, reads the
API from server reflection and creates a sandbox, runs a command in it and deletes it.

This proves the contract holds without our Python code on the client side: reflection serves
every message, JSON mapping works for each request, and errors come back as status codes.
The service and etcd are the real processes `orchard up` starts.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _grpcurl() -> str | None:
    return shutil.which("grpcurl", path=f"{Path(sys.executable).parent}{os.pathsep}") or (
        shutil.which("grpcurl")
    )


class Grpcurl:
    """Runs grpcurl against one service with one bearer token."""

    def __init__(self, binary: str, address: str, token: str) -> None:
        self.binary = binary
        self.address = address
        self.token = token

    def run(
        self, method: str, data: dict[str, Any] | None = None
    ) -> subprocess.CompletedProcess[str]:
        command = [self.binary, "-plaintext", "-H", f"authorization: Bearer {self.token}"]
        if data is not None:
            command += ["-d", json.dumps(data)]
        command += [self.address, method]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

    def call(self, method: str, data: dict[str, Any] | None = None) -> Any:
        done = self.run(method, data)
        assert done.returncode == 0, f"grpcurl {method} failed: {done.stderr}"
        return json.loads(done.stdout) if done.stdout.strip() else {}


@pytest.fixture(scope="module")
def grpcurl(env_stack: Any) -> Grpcurl:
    binary = _grpcurl()
    if binary is None:
        pytest.fail("grpcurl not found beside the interpreter or on PATH (make setup installs it)")
    return Grpcurl(binary, env_stack.endpoint, env_stack.token)


def test_reflection_lists_the_env_service(grpcurl: Grpcurl) -> None:
    done = grpcurl.run("list")
    assert done.returncode == 0, done.stderr
    assert "orchard.env.v1.EnvService" in done.stdout.split()


def test_create_exec_delete_through_grpcurl(grpcurl: Grpcurl) -> None:
    created = grpcurl.call(
        "orchard.env.v1.EnvService/CreateSandbox",
        {
            "spec": {"image": "host", "labels": {"client": "grpcurl"}},
            "requestId": str(uuid.uuid4()),
        },
    )
    sandbox_id = created["sandbox"]["id"]
    try:
        ready = grpcurl.call(
            "orchard.env.v1.EnvService/WaitSandbox", {"sandboxId": sandbox_id, "timeout": "60s"}
        )
        assert ready["sandbox"]["state"] == "SANDBOX_STATE_READY", ready

        reply = grpcurl.call(
            "orchard.env.v1.EnvService/Exec",
            {"sandboxId": sandbox_id, "command": {"shell": "echo hello from $(hostname); exit 3"}},
        )
        result = reply["result"]
        assert base64.b64decode(result["stdout"]).decode().startswith("hello from ")
        assert result["status"]["exit_code"] == 3  # grpcurl prints proto field names
    finally:
        grpcurl.call("orchard.env.v1.EnvService/DeleteSandbox", {"sandboxId": sandbox_id})

    gone = grpcurl.run("orchard.env.v1.EnvService/GetSandbox", {"sandboxId": sandbox_id})
    assert gone.returncode != 0
    assert "NotFound" in gone.stderr, gone.stderr


def test_bad_input_is_invalid_argument_for_grpcurl_too(grpcurl: Grpcurl) -> None:
    done = grpcurl.run(
        "orchard.env.v1.EnvService/CreateSandbox",
        {"spec": {"image": "host", "labels": {"Bad Key": "x"}}},
    )
    assert done.returncode != 0
    assert "InvalidArgument" in done.stderr, done.stderr
