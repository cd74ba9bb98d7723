"""Admission control: a capacity of running and starting sandboxes, a fair queue behind it,
a bounded queue, and a count that holds across replicas."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from orchard.core.errors import error_info
from orchard.env.config import AdmissionConfig
from orchard.env.v1 import env_pb2
from orchard.env.v1 import env_service_pb2 as api

READY = env_pb2.SANDBOX_STATE_READY
PENDING = env_pb2.SANDBOX_STATE_PENDING


async def get(env: Any, sandbox_id: str, token: str | None = None) -> env_pb2.Sandbox:
    request = api.GetSandboxRequest(sandbox_id=sandbox_id)
    return (await env.stub.GetSandbox(request, metadata=env.md(token))).sandbox


async def until(check: Callable[[], Any], timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def positions(env: Any, ids: list[str], token: str | None = None) -> list[int]:
    return [(await get(env, i, token)).queue_position for i in ids]


async def delete(env: Any, sandbox_id: str, token: str | None = None) -> None:
    request = api.DeleteSandboxRequest(sandbox_id=sandbox_id)
    await env.stub.DeleteSandbox(request, metadata=env.md(token))


async def test_capacity_queue_positions_fifo_and_a_full_queue(
    env_factory: Any, runtime: Any
) -> None:
    env = await env_factory(admission=AdmissionConfig(max_sandboxes=2, max_queued=3))
    made = [await env.create() for _ in range(5)]
    ids = [s.id for s in made]
    assert [s.queue_position for s in made[:2]] == [0, 0]
    for sandbox_id in ids[:2]:
        assert (await env.wait(sandbox_id)).state == READY

    async def queued_in_order() -> bool:
        return await positions(env, ids[2:]) == [1, 2, 3]

    await until(queued_in_order)
    assert [(await get(env, i)).state for i in ids[2:]] == [PENDING] * 3
    assert sorted(runtime.created) == sorted(ids[:2])

    # The queue holds 3: the next creation is refused, with a retry hint, and makes nothing.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await env.create()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = error_info(caught.value)
    assert info is not None and info.reason == "ADMISSION_QUEUE_FULL"
    assert float(info.metadata["retry_after_s"]) > 0
    listed = await env.stub.ListSandboxes(api.ListSandboxesRequest(), metadata=env.md())
    assert len(listed.sandboxes) == 5

    # Deleting a running one admits the head of the queue (FIFO) and moves the rest up.
    await delete(env, ids[0])
    assert (await env.wait(ids[2])).state == READY
    assert (await get(env, ids[2])).queue_position == 0

    async def moved_up() -> bool:
        return await positions(env, ids[3:]) == [1, 2]

    await until(moved_up)
    assert ids[3] not in runtime.created and ids[4] not in runtime.created
    await delete(env, ids[1])
    assert (await env.wait(ids[3])).state == READY
    await until(lambda: _position_is(env, ids[4], 1))


async def _position_is(env: Any, sandbox_id: str, position: int) -> bool:
    return (await get(env, sandbox_id)).queue_position == position


async def test_tenants_alternate_in_the_queue(env_factory: Any) -> None:
    env = await env_factory(admission=AdmissionConfig(max_sandboxes=1))
    beta = "beta-token"
    first = await env.create()
    assert (await env.wait(first.id)).state == READY
    a2, a3 = (await env.create()).id, (await env.create()).id
    b1 = (await env.stub.CreateSandbox(_request(), metadata=env.md(beta))).sandbox.id
    b2 = (await env.stub.CreateSandbox(_request(), metadata=env.md(beta))).sandbox.id

    async def fair() -> bool:
        return await positions(env, [a2, a3]) == [1, 3] and await positions(
            env, [b1, b2], beta
        ) == [2, 4]

    await until(fair)
    await delete(env, first.id)
    assert (await env.wait(a2)).state == READY
    await delete(env, a2)
    request = api.WaitSandboxRequest(sandbox_id=b1)
    request.timeout.FromSeconds(30)
    waited = await env.stub.WaitSandbox(request, metadata=env.md(beta))
    assert waited.sandbox.state == READY
    assert (await get(env, a3)).state == PENDING
    await delete(env, b1, beta)
    print(
        [
            (kv.key_str, kv.value_str)
            for kv in (await env.app.store.list_prefix("")).kvs
            if "slots" in kv.key_str or "creat" in kv.key_str
        ],
    )
    assert (await env.wait(a3)).state == READY


def _request() -> api.CreateSandboxRequest:
    return api.CreateSandboxRequest(spec=env_pb2.SandboxSpec(image="host"))


async def test_capacity_is_shared_by_replicas_and_per_tenant(env_factory: Any) -> None:
    config = AdmissionConfig(max_sandboxes=3, max_sandboxes_per_tenant=2)
    one = await env_factory(admission=config)
    two = await env_factory(admission=config)
    a1, a2 = await one.create(), await two.create()
    a3 = await two.create()  # alpha is at its own limit of 2
    b1 = (await one.stub.CreateSandbox(_request(), metadata=one.md("beta-token"))).sandbox
    assert b1.queue_position == 0  # beta still fits: 3 in all
    b2 = (await two.stub.CreateSandbox(_request(), metadata=two.md("beta-token"))).sandbox
    for sandbox in (a1, a2):
        assert (await one.wait(sandbox.id)).state == READY
    assert (await get(one, a3.id)).state == PENDING
    assert (await get(one, b2.id, "beta-token")).state == PENDING
    await delete(one, a1.id)
    # Alpha's slot is free and so is one in all: a3 is next (round-robin puts it first).
    assert (await two.wait(a3.id)).state == READY
    assert (await get(one, b2.id, "beta-token")).state == PENDING
