"""ForkSandbox: arguments, preconditions, request ids and admission over the test double; file
system semantics over the real ``local`` runtime (root)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from orchard.env.config import AdmissionConfig
from orchard.env.v1 import env_pb2
from orchard.env.v1 import env_service_pb2 as api

READY = env_pb2.SANDBOX_STATE_READY
PENDING = env_pb2.SANDBOX_STATE_PENDING


async def fork(env: Any, sandbox_id: str, count: int, **request: Any) -> list[env_pb2.Sandbox]:
    message = api.ForkSandboxRequest(sandbox_id=sandbox_id, count=count, **request)
    return list((await env.stub.ForkSandbox(message, metadata=env.md())).sandboxes)


async def test_fork_arguments_preconditions_and_request_ids(env_factory: Any, runtime: Any) -> None:
    runtime.fail_images.add("rootfs:/broken")
    env = await env_factory()
    source = await env.ready(labels={"task": "t1"}, timeout_s=60)
    for count in (0, 65):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await fork(env, source.id, count)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    failed = await env.create(image="rootfs:/broken")
    await env.wait(failed.id)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await fork(env, failed.id, 1)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    forks = await fork(env, source.id, 3, labels={"branch": "b"}, request_id="f-1")
    again = await fork(env, source.id, 3, labels={"branch": "b"}, request_id="f-1")
    assert [f.id for f in again] == [f.id for f in forks] and len(set(f.id for f in forks)) == 3
    for sandbox in forks:
        assert sandbox.forked_from == source.id
        assert sandbox.spec.labels == {"task": "t1", "branch": "b"}
        assert sandbox.spec.heartbeat_timeout.seconds == 60
        assert (await env.wait(sandbox.id)).state == READY
    assert sorted(runtime.forked) == sorted((source.id, f.id) for f in forks)


async def test_forks_go_through_admission(env_factory: Any) -> None:
    env = await env_factory(admission=AdmissionConfig(max_sandboxes=2, max_queued=2))
    source = await env.ready()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await fork(env, source.id, 3)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    forks = await fork(env, source.id, 2)
    assert [f.queue_position for f in forks] == [1, 2]
    assert (await env.wait(forks[0].id)).state == READY
    request = api.GetSandboxRequest(sandbox_id=forks[1].id)
    await asyncio.sleep(0.3)
    assert (await env.stub.GetSandbox(request, metadata=env.md())).sandbox.state == PENDING


@pytest.mark.root
async def test_forks_start_from_the_source_files_and_diverge(
    env_factory: Any, local_runtime: Any
) -> None:
    env = await env_factory(runtime=local_runtime)
    source = await env.ready(timeout_s=60)
    setup = "mkdir -p /data && echo before > /data/a.txt && rm -f /etc/hostname"
    assert (await env.shell(source.id, setup)).status.exit_code == 0
    forks = await fork(env, source.id, 3)
    for sandbox in forks:
        waited = await env.wait(sandbox.id)
        assert waited.state == READY, waited.failure
        seen = await env.shell(sandbox.id, "cat /data/a.txt; test -e /etc/hostname; echo $?")
        assert seen.stdout == b"before\n1\n"  # files and deletions (whiteouts) both arrive
    first, second, third = (f.id for f in forks)
    await env.shell(first, "echo mine > /data/b.txt && echo changed > /data/a.txt")
    await env.shell(second, "rm /data/a.txt")
    for sandbox_id in (source.id, second, third):
        assert (await env.shell(sandbox_id, "test -e /data/b.txt; echo $?")).stdout == b"1\n"
    assert (await env.shell(source.id, "cat /data/a.txt")).stdout == b"before\n"
    assert (await env.shell(third, "cat /data/a.txt")).stdout == b"before\n"
    assert (await env.shell(first, "cat /data/a.txt")).stdout == b"changed\n"
    # The source keeps writing after the fork: the forks do not see it.
    await env.shell(source.id, "echo later > /data/c.txt")
    assert (await env.shell(third, "test -e /data/c.txt; echo $?")).stdout == b"1\n"
