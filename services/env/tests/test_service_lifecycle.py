"""Create, wait, get, list, delete and heartbeat through a real server, real etcd, real agents."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from orchard.core.errors import error_info
from orchard.env.records import sandbox_key
from orchard.env.v1 import env_pb2
from orchard.env.v1 import env_service_pb2 as api

READY = env_pb2.SANDBOX_STATE_READY
PENDING = env_pb2.SANDBOX_STATE_PENDING
FAILED = env_pb2.SANDBOX_STATE_FAILED


async def test_create_returns_pending_then_wait_sees_ready(env: Any, runtime: Any) -> None:
    started = time.monotonic()
    sandbox = await env.create(labels={"task": "t1"})
    assert sandbox.state == PENDING
    assert sandbox.id.startswith("sbx-") and sandbox.tenant == "alpha"
    assert sandbox.runtime == "unisolated-test"
    assert sandbox.HasField("create_time") and sandbox.HasField("expire_time")
    assert time.monotonic() - started < 1.0

    ready = await env.wait(sandbox.id)
    assert ready.state == READY
    assert ready.agent_version and ready.HasField("ready_time")
    assert ready.spec.labels == {"task": "t1"}
    got = (
        await env.stub.GetSandbox(api.GetSandboxRequest(sandbox_id=sandbox.id), metadata=env.md())
    ).sandbox
    assert got.state == READY and got.expire_time.seconds > time.time()
    assert runtime.created == [sandbox.id]

    result = await env.shell(sandbox.id, "echo hi; exit 3")
    assert result.stdout == b"hi\n" and result.status.exit_code == 3


async def test_record_holds_agent_address_and_lease(env: Any) -> None:
    sandbox = await env.ready(timeout_s=7)
    store = env.app.store
    kv = await store.get(sandbox_key("alpha", sandbox.id))
    assert kv is not None and kv.lease
    info = await store.lease_time_to_live(kv.lease)
    assert info is not None and info.granted_ttl == 7
    from orchard.env.records import SandboxRecord

    record = SandboxRecord.from_kv(kv)
    assert record.agent_address.startswith("unix:") and record.state == READY


async def test_request_id_deduplicates_per_tenant(env: Any) -> None:
    spec = env_pb2.SandboxSpec(image="host")
    request = api.CreateSandboxRequest(spec=spec, request_id="req-1")
    first, second = await asyncio.gather(
        env.stub.CreateSandbox(request, metadata=env.md()),
        env.stub.CreateSandbox(request, metadata=env.md()),
    )
    assert first.sandbox.id == second.sandbox.id
    other = await env.stub.CreateSandbox(request, metadata=env.md("beta-token"))
    assert other.sandbox.id != first.sandbox.id
    await env.wait(first.sandbox.id)
    third = await env.stub.CreateSandbox(request, metadata=env.md())
    assert third.sandbox.id == first.sandbox.id and third.sandbox.state == READY


async def test_runtime_failure_makes_the_record_failed(env_factory: Any, runtime: Any) -> None:
    runtime.fail_images.add("rootfs:/nowhere")
    env = await env_factory()
    sandbox = await env.create(image="rootfs:/nowhere")
    failed = await env.wait(sandbox.id)
    assert failed.state == FAILED
    assert failed.failure.reason == "IMAGE_NOT_FOUND" and "nowhere" in failed.failure.message
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await env.shell(sandbox.id, "true")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "IMAGE_NOT_FOUND" in caught.value.details()
    assert await runtime.list_sandboxes() == []


async def test_wait_times_out_and_unknown_is_not_found(env: Any, runtime: Any) -> None:
    # A slow runtime: the agent is held back by a start that never serves in time.
    original = runtime.create

    async def slow(spec: Any) -> Any:
        await asyncio.sleep(3)
        return await original(spec)

    runtime.create = slow
    sandbox = await env.create()
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await env.wait(sandbox.id, timeout_s=0.3)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0.25 < time.monotonic() - started < 2
    # The call's own deadline bounds the wait too.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await env.stub.WaitSandbox(
            api.WaitSandboxRequest(sandbox_id=sandbox.id), metadata=env.md(), timeout=0.3
        )
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    ready = await env.wait(sandbox.id)
    assert ready.state == READY
    for call in ("GetSandbox", "WaitSandbox", "HeartbeatSandbox"):
        request = getattr(api, call.replace("Sandbox", "") + "SandboxRequest")(
            sandbox_id="sbx-000000000000"
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await getattr(env.stub, call)(request, metadata=env.md())
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND, call


async def test_delete_is_idempotent_and_releases_the_runtime(env: Any, runtime: Any) -> None:
    sandbox = await env.ready()
    assert await runtime.list_sandboxes() == [sandbox.id]
    for _ in range(2):
        await env.stub.DeleteSandbox(
            api.DeleteSandboxRequest(sandbox_id=sandbox.id), metadata=env.md()
        )
    assert await runtime.list_sandboxes() == []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await env.stub.GetSandbox(api.GetSandboxRequest(sandbox_id=sandbox.id), metadata=env.md())
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(caught.value).reason == "SANDBOX_NOT_FOUND"
    # Deleting while PENDING cancels the creation; nothing is left behind.
    pending = await env.create()
    await env.stub.DeleteSandbox(api.DeleteSandboxRequest(sandbox_id=pending.id), metadata=env.md())
    await asyncio.sleep(0.5)
    assert await runtime.list_sandboxes() == []


async def test_heartbeat_keeps_it_and_expiry_reaps_within_timeout(env: Any, runtime: Any) -> None:
    # The agent's start takes about a second on a busy machine: leave room for it.
    kept, dropped = await asyncio.gather(env.ready(timeout_s=4), env.ready(timeout_s=4))
    dropped_at = time.monotonic()
    for _ in range(8):
        reply = await env.stub.HeartbeatSandbox(
            api.HeartbeatSandboxRequest(sandbox_id=kept.id), metadata=env.md()
        )
        expire = reply.expire_time.seconds + reply.expire_time.nanos / 1e9
        assert time.time() + 2.5 < expire <= time.time() + 4.5
    # The dropped one: record gone and runtime reaped within timeout + 2 s; the kept one,
    # still heartbeating, stays.
    while await runtime.list_sandboxes() != [kept.id]:
        assert time.monotonic() - dropped_at < 4 + 2, await runtime.list_sandboxes()
        await env.stub.HeartbeatSandbox(
            api.HeartbeatSandboxRequest(sandbox_id=kept.id), metadata=env.md()
        )
        await asyncio.sleep(0.05)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await env.stub.HeartbeatSandbox(
            api.HeartbeatSandboxRequest(sandbox_id=dropped.id), metadata=env.md()
        )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert (await env.shell(kept.id, "echo alive")).stdout == b"alive\n"
    assert env.app.controller.metrics.reaped._value.get() == 1
