"""The service over the real ``local`` runtime: isolated sandboxes end to end (needs root and
the agent bundle)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from orchard.env.v1 import env_pb2
from orchard.env.v1 import env_service_pb2 as api

pytestmark = [pytest.mark.root]


async def test_local_sandbox_through_the_service(env_factory: Any, local_runtime: Any) -> None:
    env = await env_factory(runtime=local_runtime)
    started = time.monotonic()
    sandbox = await env.ready(timeout_s=30)
    ready_s = time.monotonic() - started
    assert sandbox.runtime == "local"
    # Isolated: its own pid namespace (the agent is PID 1) and host name.
    result = await env.shell(sandbox.id, "echo $$; cat /proc/1/cmdline | tr '\\0' ' '")
    assert result.status.exit_code == 0, result
    # PID 1 is the agent: the bundle's executable, or a fork of the agent zygote.
    assert b"orchard-inagent" in result.stdout or b"orchard.inagent.zygote" in result.stdout

    async def chunks() -> Any:
        yield api.WriteFileRequest(
            header=api.WriteFileHeader(sandbox_id=sandbox.id, path="/tmp/hello.txt")
        )
        yield api.WriteFileRequest(data=b"hello from the service\n")

    await env.stub.WriteFile(chunks(), metadata=env.md())
    assert (await env.shell(sandbox.id, "cat /tmp/hello.txt")).stdout == b"hello from the service\n"

    await env.stub.DeleteSandbox(api.DeleteSandboxRequest(sandbox_id=sandbox.id), metadata=env.md())
    assert await local_runtime.list_sandboxes() == []
    assert ready_s < 30


async def test_local_sandbox_is_reaped_when_its_lease_expires(
    env_factory: Any, local_runtime: Any
) -> None:
    env = await env_factory(runtime=local_runtime)
    created = time.monotonic()
    sandbox = await env.create(timeout_s=3)
    sandbox = await env.wait(sandbox.id)
    assert sandbox.state == env_pb2.SANDBOX_STATE_READY
    deadline = created + 3 + 2
    while await local_runtime.list_sandboxes():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
