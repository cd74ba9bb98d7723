"""Create, status, exec through the agent, delete (twice), and what a restart keeps."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from orchard.env.runtime.base import FailureReason, RuntimeFailure, SandboxStatus

pytestmark = [pytest.mark.root, pytest.mark.slow]


async def test_create_exec_delete(sandboxes: Any, agent_for: Any) -> None:
    runtime = sandboxes.runtime
    sandbox = await sandboxes.create()
    assert await runtime.status(sandbox.sandbox_id) is SandboxStatus.RUNNING
    assert sandbox.sandbox_id in await runtime.list_sandboxes()
    result = await agent_for(sandbox).sh("echo hello; pwd")
    assert result.status.exit_code == 0
    assert result.stdout == b"hello\n/\n"
    await runtime.delete(sandbox.sandbox_id)
    await runtime.delete(sandbox.sandbox_id)  # idempotent
    assert await runtime.status(sandbox.sandbox_id) is SandboxStatus.ABSENT
    assert sandbox.sandbox_id not in await runtime.list_sandboxes()


async def test_env_and_working_dir_reach_commands(sandboxes: Any, agent_for: Any) -> None:
    env = {"GREETING": "hi", "LITERAL": "$(ORCHARD_POD_IP) a=b", "ORCHARD_TRACE": "on"}
    sandbox = await sandboxes.create(env=env, working_dir="/srv/task")
    result = await agent_for(sandbox).sh('echo "$GREETING|$LITERAL|$ORCHARD_TRACE"; pwd')
    # Values arrive as given (no $(VAR) expansion), ORCHARD_* ones too (they pass through the
    # agent's own settings).
    assert result.stdout == b"hi|$(ORCHARD_POD_IP) a=b|on\n/srv/task\n"


async def test_host_image(sandboxes: Any, agent_for: Any) -> None:
    sandboxes.harness.require("host-image")
    sandbox = await sandboxes.create("host")
    agent = agent_for(sandbox)
    result = await agent.sh("test -x /bin/sh && echo $(hostname)")
    assert result.stdout.decode().strip() == sandbox.sandbox_id
    # The root is a private copy-on-write layer: writes do not reach the host.
    marker = f"/orchard-conformance-{sandbox.sandbox_id}"
    assert (await agent.sh(f"echo x > {marker} && cat {marker}")).stdout == b"x\n"
    import os

    assert not os.path.exists(marker)


async def test_missing_image_fails_cleanly(sandboxes: Any) -> None:
    spec = sandboxes.spec()
    spec = type(spec)(sandbox_id=spec.sandbox_id, image=sandboxes.harness.missing_image)
    with pytest.raises(RuntimeFailure) as caught:
        await sandboxes.runtime.create(spec)
    assert caught.value.reason is FailureReason.IMAGE_NOT_FOUND
    assert await sandboxes.runtime.status(spec.sandbox_id) is SandboxStatus.ABSENT


async def test_agent_death_is_reported(sandboxes: Any, harness: Any) -> None:
    runtime = sandboxes.runtime
    sandbox = await sandboxes.create()
    exits = runtime.exits()
    harness.kill_agent(sandbox.sandbox_id)
    event = await asyncio.wait_for(anext(exits), 10)
    assert event.sandbox_id == sandbox.sandbox_id
    assert event.reason is FailureReason.AGENT_EXITED
    assert await runtime.status(sandbox.sandbox_id) is SandboxStatus.EXITED
    assert sandbox.sandbox_id in await runtime.list_sandboxes()


async def test_a_new_runtime_adopts_running_sandboxes(
    sandboxes: Any, harness: Any, agent_for: Any
) -> None:
    first = await sandboxes.create()
    second = await sandboxes.create()
    await sandboxes.runtime.close()  # the service stops; sandboxes keep running
    restarted = harness.new_runtime()
    await restarted.start()
    sandboxes.runtime = restarted
    assert await restarted.status(first.sandbox_id) is SandboxStatus.RUNNING
    assert set(await restarted.list_sandboxes()) >= {first.sandbox_id, second.sandbox_id}
    assert (await agent_for(first).sh("echo still here")).stdout == b"still here\n"
    exits = restarted.exits()
    harness.kill_agent(second.sandbox_id)
    event = await asyncio.wait_for(anext(exits), 10)
    assert (event.sandbox_id, event.reason) == (second.sandbox_id, FailureReason.AGENT_EXITED)


async def test_concurrent_creates(sandboxes: Any, agent_for: Any) -> None:
    made = await asyncio.gather(*(sandboxes.create() for _ in range(4)))
    outputs = await asyncio.gather(*(agent_for(s).sh("hostname") for s in made))
    assert [o.stdout.decode().strip() for o in outputs] == [s.sandbox_id for s in made]
