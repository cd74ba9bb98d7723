"""Owners: one lease for many sandboxes (CreateOwner, HeartbeatOwner, DeleteOwner,
``spec.owner_id``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from orchard.env.v1 import env_pb2
from orchard.env.v1 import env_service_pb2 as api

READY = env_pb2.SANDBOX_STATE_READY


async def create_owner(env: Any, timeout_s: float, **request: Any) -> env_pb2.Owner:
    message = api.CreateOwnerRequest(**request)
    message.heartbeat_timeout.FromNanoseconds(int(timeout_s * 1e9))
    return (await env.stub.CreateOwner(message, metadata=env.md())).owner


async def heartbeat_owner(env: Any, owner_id: str) -> None:
    await env.stub.HeartbeatOwner(api.HeartbeatOwnerRequest(owner_id=owner_id), metadata=env.md())


async def exists(env: Any, sandbox_id: str) -> bool:
    try:
        await env.stub.GetSandbox(api.GetSandboxRequest(sandbox_id=sandbox_id), metadata=env.md())
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND
        return False
    return True


async def test_one_owner_heartbeat_keeps_all_alive_and_expiry_reaps_them_together(
    env: Any, runtime: Any
) -> None:
    owner = await create_owner(env, 3, labels={"job": "j1"})
    assert owner.id.startswith("own-") and owner.tenant == "alpha"
    assert owner.labels == {"job": "j1"} and owner.expire_time.seconds > time.time()
    alone_id: list[str] = []

    async def heartbeats() -> None:
        while True:
            await heartbeat_owner(env, owner.id)
            if alone_id:
                await env.stub.HeartbeatSandbox(
                    api.HeartbeatSandboxRequest(sandbox_id=alone_id[0]), metadata=env.md()
                )
            await asyncio.sleep(0.5)

    beating = asyncio.create_task(heartbeats())
    try:
        owned = [await env.create(owner_id=owner.id) for _ in range(3)]
        # Its own lease, heartbeated on its own: unaffected by the owner.
        alone = await env.create(timeout_s=3)
        alone_id.append(alone.id)
        for sandbox in [*owned, alone]:
            assert (await env.wait(sandbox.id)).state == READY
        await asyncio.sleep(4)  # past the 3 s timeout
    finally:
        beating.cancel()
    for sandbox in [*owned, alone]:
        assert (await env.wait(sandbox.id)).state == READY

    # HeartbeatSandbox on an owned sandbox renews the owner's lease.
    reply = await env.stub.HeartbeatSandbox(
        api.HeartbeatSandboxRequest(sandbox_id=owned[0].id), metadata=env.md()
    )
    assert reply.expire_time.seconds >= int(time.time()) + 2

    stopped = time.monotonic()
    while any([await exists(env, s.id) for s in owned]):
        await env.stub.HeartbeatSandbox(
            api.HeartbeatSandboxRequest(sandbox_id=alone.id), metadata=env.md()
        )
        assert time.monotonic() - stopped < 3 + 2
        await asyncio.sleep(0.1)
    while set(await runtime.list_sandboxes()) & {s.id for s in owned}:
        assert time.monotonic() - stopped < 3 + 2
        await asyncio.sleep(0.05)
    assert await exists(env, alone.id)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await heartbeat_owner(env, owner.id)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_delete_owner_reaps_all_at_once_and_is_idempotent(env: Any, runtime: Any) -> None:
    owner = await create_owner(env, 60)
    owned = [await env.ready(owner_id=owner.id) for _ in range(3)]
    other = await env.ready()
    started = time.monotonic()
    reply = await env.stub.DeleteOwner(api.DeleteOwnerRequest(owner_id=owner.id), metadata=env.md())
    assert reply.sandboxes_deleted == 3
    for sandbox in owned:
        assert not await exists(env, sandbox.id)
    while set(await runtime.list_sandboxes()) & {s.id for s in owned}:
        assert time.monotonic() - started < 2
        await asyncio.sleep(0.05)
    assert await runtime.list_sandboxes() == [other.id]
    again = await env.stub.DeleteOwner(api.DeleteOwnerRequest(owner_id=owner.id), metadata=env.md())
    assert again.sandboxes_deleted == 0
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await env.create(owner_id=owner.id)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_owners_are_per_tenant_and_deduplicated(env: Any) -> None:
    first = await create_owner(env, 30, request_id="job-7")
    second = await create_owner(env, 30, request_id="job-7")
    assert first.id == second.id
    beta = env.md("beta-token")
    request = api.CreateSandboxRequest(spec=env_pb2.SandboxSpec(image="host", owner_id=first.id))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await env.stub.CreateSandbox(request, metadata=beta)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await env.stub.HeartbeatOwner(api.HeartbeatOwnerRequest(owner_id=first.id), metadata=beta)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    deleted = await env.stub.DeleteOwner(api.DeleteOwnerRequest(owner_id=first.id), metadata=beta)
    assert deleted.sandboxes_deleted == 0
    await heartbeat_owner(env, first.id)  # untouched by the other tenant
    bad = api.CreateOwnerRequest()
    bad.heartbeat_timeout.FromSeconds(10**9)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await env.stub.CreateOwner(bad, metadata=env.md())
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
