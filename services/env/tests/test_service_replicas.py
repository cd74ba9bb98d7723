"""Several replicas on one etcd, reconciliation, runtime exits, metrics."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from typing import Any

from orchard.core.config import ServerConfig
from orchard.env.runtime.base import RuntimeSandboxSpec
from orchard.env.v1 import env_pb2
from orchard.env.v1 import env_service_pb2 as api

READY = env_pb2.SANDBOX_STATE_READY
FAILED = env_pb2.SANDBOX_STATE_FAILED


async def get(env: Any, sandbox_id: str) -> env_pb2.Sandbox:
    return (
        await env.stub.GetSandbox(api.GetSandboxRequest(sandbox_id=sandbox_id), metadata=env.md())
    ).sandbox


async def until_state(env: Any, sandbox_id: str, state: int, within: float = 10) -> env_pb2.Sandbox:
    deadline = time.monotonic() + within
    while True:
        sandbox = await get(env, sandbox_id)
        if sandbox.state == state:
            return sandbox
        assert time.monotonic() < deadline, sandbox
        await asyncio.sleep(0.05)


async def test_two_replicas_serve_every_sandbox(env_factory: Any, runtime: Any) -> None:
    a = await env_factory()
    b = await env_factory()
    sandbox = await a.create()
    ready = await b.wait(sandbox.id)  # woken by b's own watch of a's write
    assert ready.state == READY
    assert (await b.shell(sandbox.id, "echo via-b")).stdout == b"via-b\n"
    # Replica A goes away; B still serves the sandbox, and sees new ones.
    await a.server.stop(0)
    assert (await b.shell(sandbox.id, "echo still")).stdout == b"still\n"
    other = await b.ready()
    assert sorted(await runtime.list_sandboxes()) == sorted([sandbox.id, other.id])


async def test_a_creation_whose_replica_died_is_taken_over(env_factory: Any, runtime: Any) -> None:
    gate = asyncio.Event()
    original = runtime.create

    async def held(spec: RuntimeSandboxSpec) -> Any:
        if not gate.is_set():
            await asyncio.sleep(3600)  # replica A's creation never finishes
        return await original(spec)

    runtime.create = held
    a = await env_factory(replica_ttl_s=2)
    b = await env_factory(replica_ttl_s=2)
    sandbox = await a.create()
    await asyncio.sleep(0.2)
    gate.set()
    await a.server.stop(0)  # its lease goes; B claims the creation
    ready = await b.wait(sandbox.id, timeout_s=10)
    assert ready.state == READY
    assert (await b.shell(sandbox.id, "echo adopted")).stdout == b"adopted\n"
    assert await runtime.list_sandboxes() == [sandbox.id]


async def test_reconcile_deletes_leftovers_and_fails_dead_sandboxes(env: Any, runtime: Any) -> None:
    leftover = await runtime.create(RuntimeSandboxSpec(sandbox_id="sbx-leftover0001", image="host"))
    vanished, exited, alive = await asyncio.gather(env.ready(), env.ready(), env.ready())
    # One disappears from the runtime behind the service's back; one's agent dies without an
    # exit event (as after a service restart, when the runtime is no longer its parent).
    await runtime.delete(vanished.id)
    runtime._deleting.add(exited.id)
    os.killpg(runtime._pid(exited.id), signal.SIGKILL)
    await asyncio.sleep(0.2)
    done = await env.app.controller.reconcile()
    assert done == {"leftovers": 1, "failed": 2, "taken_over": 0, "repaired": 0}
    assert (await get(env, vanished.id)).failure.reason == "RUNTIME_DIED"
    assert (await get(env, exited.id)).failure.reason == "AGENT_EXITED"
    assert (await get(env, alive.id)).state == READY
    assert await runtime.list_sandboxes() == [alive.id]
    del leftover


async def test_runtime_exit_events_fail_the_record(env: Any, runtime: Any) -> None:
    sandbox = await env.ready()
    os.killpg(runtime._pid(sandbox.id), signal.SIGKILL)
    failed = await until_state(env, sandbox.id, FAILED)
    assert failed.failure.reason == "AGENT_EXITED" and "status" in failed.failure.message


async def test_metrics_are_scraped_over_http(env_factory: Any, runtime: Any) -> None:
    runtime.fail_images.add("rootfs:/broken")
    env = await env_factory(
        server=ServerConfig(listen=["127.0.0.1:0"], metrics_address="127.0.0.1:0")
    )
    sandbox = await env.ready()
    await env.shell(sandbox.id, "true")
    broken = await env.create(image="rootfs:/broken")
    await env.wait(broken.id)
    await env.stub.DeleteSandbox(api.DeleteSandboxRequest(sandbox_id=sandbox.id), metadata=env.md())
    await asyncio.sleep(0.2)
    url = f"http://{env.server.metrics_address}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    for line in [
        'orchard_env_sandboxes{state="FAILED"} 1.0',
        'orchard_env_sandboxes{state="READY"} 0.0',
        "orchard_env_create_seconds_count 2.0",
        "orchard_env_ready_seconds_count 1.0",
        'orchard_env_exec_seconds_count{code="OK"} 1.0',
        "orchard_env_delete_seconds_count 1.0",
        "orchard_env_sandboxes_reaped_total 0.0",
        'orchard_env_sandboxes_failed_total{reason="IMAGE_NOT_FOUND"} 1.0',
        "orchard_env_execs_in_flight 0.0",
    ]:
        assert line in text, line
