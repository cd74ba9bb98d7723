"""The direct route (EnvService.OpenAgentRoute) over the real ``local`` runtime and real agents:
a credential opens its own sandbox's agent and no other, expires, cannot be altered; another
tenant gets no route; the SDK's direct exec works and falls back to the service when the route
is not usable."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import grpc
import pytest

from orchard.core.errors import OrchardError, error_info
from orchard.env.agent_routes import issue_credential
from orchard.env.config import AgentRouteConfig
from orchard.env.v1 import env_service_pb2 as api
from orchard.inagent.v1 import inagent_service_pb2 as agent_pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as agent_grpc
from orchard.sdk import AsyncSandboxClient
from orchard.sdk.errors import FileNotFound, SandboxNotFound
from orchard.types.v1 import exec_pb2

ALPHA_TOKEN = "alpha-token"
BETA_TOKEN = "beta-token"
TRUE = exec_pb2.Command(argv=["true"])


def _bearer(credential: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {credential}"),)


async def _open(env: Any, sandbox_id: str, token: str = ALPHA_TOKEN) -> Any:
    return await env.stub.OpenAgentRoute(
        api.OpenAgentRouteRequest(sandbox_id=sandbox_id), metadata=env.md(token)
    )


async def _agent_exec(address: str, credential: str, command: Any = TRUE) -> Any:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = agent_grpc.AgentServiceStub(channel)
        return await stub.Exec(
            agent_pb.ExecRequest(command=command), metadata=_bearer(credential), timeout=10
        )


async def _refused(address: str, credential: str) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _agent_exec(address, credential)
    info = error_info(caught.value)
    return caught.value.code(), caught.value.details() or "", info.reason if info else ""


@pytest.mark.root
async def test_a_route_opens_its_own_sandbox_and_no_other(
    env_factory: Any, local_runtime: Any
) -> None:
    env = await env_factory(runtime=local_runtime)
    x = await env.ready()
    y = await env.ready()
    z_reply = await env.stub.CreateSandbox(
        api.CreateSandboxRequest(spec={"image": "host"}), metadata=env.md(BETA_TOKEN)
    )
    z_id = z_reply.sandbox.id

    route = await _open(env, x.id)
    assert route.address.startswith("unix:")
    ttl = route.expire_time.ToSeconds() - time.time()
    assert 280 < ttl <= 300, ttl  # the default credential_ttl_s
    reply = await _agent_exec(
        route.address, route.credential, exec_pb2.Command(shell="hostname; echo $$")
    )
    assert reply.result.status.exit_code == 0
    assert reply.result.stdout.split()[0] == x.id.encode()

    # X's credential opens neither Y (same tenant) nor Z (another tenant).
    y_route = await _open(env, y.id)
    code, details, _ = await _refused(y_route.address, route.credential)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "signature" in details
    wait = api.WaitSandboxRequest(sandbox_id=z_id)
    wait.timeout.FromSeconds(30)
    z = (await env.stub.WaitSandbox(wait, metadata=env.md(BETA_TOKEN))).sandbox
    z_route = await _open(env, z.id, BETA_TOKEN)
    code, _, _ = await _refused(z_route.address, route.credential)
    assert code == grpc.StatusCode.UNAUTHENTICATED

    # Another tenant cannot obtain a route to X: X does not exist for it.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _open(env, x.id, BETA_TOKEN)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await env.stub.OpenAgentRoute(api.OpenAgentRouteRequest(sandbox_id=x.id))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED

    # Signed with Y's own key but naming X: Y's agent refuses it by name.
    y_key = await local_runtime.agent_key(y.id)
    named_x = issue_credential(y_key, x.id, "alpha", int(time.time()) + 60)
    code, details, reason = await _refused(y_route.address, named_x)
    assert code == grpc.StatusCode.PERMISSION_DENIED and reason == "CREDENTIAL_WRONG_SANDBOX"
    assert x.id in details

    # Expired.
    x_key = await local_runtime.agent_key(x.id)
    expired = issue_credential(x_key, x.id, "alpha", int(time.time()) - 1)
    code, details, _ = await _refused(route.address, expired)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "expired" in details

    # Tampered: the tenant or the expiry changed under the service's signature.
    parts = route.credential.split(".")
    for index, value in ((2, "YmV0YQ"), (3, str(int(parts[3]) + 86400))):
        forged = ".".join([*parts[:index], value, *parts[index + 1 :]])
        code, details, _ = await _refused(route.address, forged)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "signature" in details

    # The key reaches no command: not in the environment, not readable from PID 1.
    result = await env.shell(x.id, "env; cat /proc/1/environ 2>&1; true")
    assert x_key not in result.stdout and b"ORCHARD_AGENT" not in result.stdout


@pytest.mark.root
async def test_a_sandbox_that_is_not_ready_has_no_route(
    env_factory: Any, local_runtime: Any
) -> None:
    env = await env_factory(runtime=local_runtime)
    sandbox = await env.ready()
    await env.stub.DeleteSandbox(api.DeleteSandboxRequest(sandbox_id=sandbox.id), metadata=env.md())
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _open(env, sandbox.id)
    assert caught.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


async def test_a_failed_sandbox_has_no_route_and_keyless_agents_none(
    env: Any, runtime: Any
) -> None:
    # The runtime double: real agents without keys, and images that fail on purpose.
    runtime.fail_images.add("rootfs:/broken")
    failed = await env.wait((await env.create(image="rootfs:/broken")).id)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _open(env, failed.id)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    ready = await env.ready()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _open(env, ready.id)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "no key" in (caught.value.details() or "")


@pytest.mark.root
async def test_sdk_exec_over_the_direct_route(env_factory: Any, local_runtime: Any) -> None:
    env = await env_factory(runtime=local_runtime)
    async with (
        AsyncSandboxClient(env.address, token=ALPHA_TOKEN, direct_agent=True) as client,
        client.create(image="host") as sandbox,
    ):
        await sandbox.wait()
        assert client.routes is not None
        for _ in range(3):
            result = await sandbox.exec(["sh", "-c", "echo direct; exit 3"])
            assert result.exit_code == 3 and result.stdout == b"direct\n"
        assert client.routes.opened == 1 and client.routes.fallbacks == 0
        # File reads too, with the agent's errors as the service gives them.
        payload = os.urandom(300_000)
        await sandbox.write_file("/tmp/blob", payload)
        assert await sandbox.read_file("/tmp/blob") == payload
        assert await sandbox.read_file("/tmp/blob", offset=10, limit=5) == payload[10:15]
        with pytest.raises(FileNotFound):
            await sandbox.read_file("/tmp/missing")
        assert client.routes.fallbacks == 0
        # A bad command fails as on the service's route.
        with pytest.raises(FileNotFound):
            await sandbox.exec(["/no/such/program"])
        # A route near its expiry is renewed before use.
        route = client.routes._routes[sandbox.id]
        route.expire_unix_s = time.time() + 5
        assert (await sandbox.exec(["true"])).exit_code == 0
        assert client.routes.opened == 1  # same address: the credential renewed in place
        assert client.routes._routes[sandbox.id].expire_unix_s > time.time() + 200


@pytest.mark.root
async def test_sdk_falls_back_when_the_route_is_unusable(
    env_factory: Any, local_runtime: Any, tmp_path: Any
) -> None:
    env = await env_factory(runtime=local_runtime)
    async with AsyncSandboxClient(env.address, token=ALPHA_TOKEN, direct_agent=True) as client:
        assert client.routes is not None
        client.routes.probe_timeout_s = 0.3
        opened = client._open_route

        async def unreachable(sandbox_id: str) -> Any:
            # What a client on another host sees: an address it cannot connect to.
            reply = await opened(sandbox_id)
            reply.address = f"unix:{tmp_path / 'nothing-listens-here.sock'}"
            return reply

        client.routes._open_route = unreachable
        async with client.create(image="host") as sandbox:
            await sandbox.wait()
            assert (await sandbox.exec(["echo", "via service"])).stdout == b"via service\n"
            assert client.routes.fallbacks == 1 and not client.routes._routes
            # Within retry_after_s the route is not tried again.
            assert (await sandbox.exec(["true"])).exit_code == 0
            assert client.routes.fallbacks == 2 and client.routes.opened == 0

        # A credential the agent refuses (here: forged): the call runs through the service.
        client.routes._open_route = opened
        async with client.create(image="host") as sandbox:
            await sandbox.wait()

            async def forged(sandbox_id: str) -> Any:
                reply = await opened(sandbox_id)
                reply.credential = reply.credential[:-4] + "AAAA"
                return reply

            client.routes._open_route = forged
            marker = os.urandom(4).hex()
            result = await sandbox.exec(["sh", "-c", f"echo {marker} >> /tmp/ran; cat /tmp/ran"])
            assert result.stdout == f"{marker}\n".encode()  # ran once, not on both routes
            assert client.routes.opened == 1 and client.routes.fallbacks == 3
            # A read refused on the direct route is read through the service.
            client.routes._down_until.clear()
            assert await sandbox.read_file("/tmp/ran") == f"{marker}\n".encode()
            assert client.routes.opened == 2 and client.routes.fallbacks == 4


async def test_the_route_can_be_turned_off(env_factory: Any) -> None:
    env = await env_factory(agent_route=AgentRouteConfig(enabled=False))
    sandbox = await env.ready()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _open(env, sandbox.id)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    async with AsyncSandboxClient(env.address, token=ALPHA_TOKEN, direct_agent=True) as client:
        handle = await client.get(sandbox.id)
        assert (await handle.exec(["echo", "ok"])).stdout == b"ok\n"
        assert client.routes is not None and client.routes.fallbacks == 1


@pytest.mark.root
async def test_an_executed_agent_gets_its_key_and_keeps_it_from_commands(
    local_runtime: Any,
) -> None:
    # The exec launch (the bundle as PID 1), beside the zygote launch of the tests above: the
    # key is in PID 1's start environment, which the agent makes unreadable to commands.
    from orchard.env.runtime.base import RuntimeSandboxSpec
    from orchard.env.runtime.local import LocalRuntime

    # Its own cgroup parent (the fixture's runtime may keep pooled sandboxes in its own); the
    # same state directory, so the same host secret and keys.
    own = {"agent_launch": "exec", "cgroup_parent": f"{local_runtime.config.cgroup_parent}-exec"}
    runtime = LocalRuntime(local_runtime.config.model_copy(update=own))
    await runtime.start()
    try:
        started = await runtime.create(RuntimeSandboxSpec("exec-key", "host"))
        key = await runtime.agent_key("exec-key")
        assert key is not None and key == await local_runtime.agent_key("exec-key")
        credential = issue_credential(key, "exec-key", "alpha", int(time.time()) + 60)
        script = "env; cat /proc/1/environ 2>&1; tr '\\0' '\\n' < /proc/1/environ 2>&1; true"
        reply = await _agent_exec(started.agent_address, credential, exec_pb2.Command(shell=script))
        assert reply.result.status.exit_code == 0
        assert key not in reply.result.stdout and b"ORCHARD_AGENT" not in reply.result.stdout
        assert b"Permission denied" in reply.result.stdout  # /proc/1/environ is out of reach
        await runtime.delete("exec-key")
    finally:
        await runtime.close()
        assert runtime.remove_cgroup_parents() == []


@pytest.mark.root
async def test_sdk_reports_a_deleted_sandbox_as_the_service_does(
    env_factory: Any, local_runtime: Any
) -> None:
    env = await env_factory(runtime=local_runtime)
    async with AsyncSandboxClient(env.address, token=ALPHA_TOKEN, direct_agent=True) as client:
        sandbox = await client.create(image="host", keep_alive=False)
        assert (await sandbox.exec(["true"])).exit_code == 0
        assert client.routes is not None and client.routes.opened == 1
        # Deleted by someone else: the cached route's agent is gone.
        await env.stub.DeleteSandbox(
            api.DeleteSandboxRequest(sandbox_id=sandbox.id), metadata=env.md()
        )
        for _ in range(50):  # the agent's connection drops a moment after its process
            route = client.routes._routes.get(sandbox.id)
            if route is None or not route.ready():
                break
            await asyncio.sleep(0.02)
        with pytest.raises(SandboxNotFound):
            await sandbox.exec(["true"])


def test_orchard_envs_own_credential_is_minted_once_and_renewed_before_it_expires() -> None:
    from orchard.env.agents import CREDENTIAL_RENEW_S, CREDENTIAL_TTL_S, ServiceCredential
    from orchard.inagent.credentials import CredentialCheck

    key, now = os.urandom(32), [1000.0]
    credential = ServiceCredential(key, "sb-1", clock=lambda: now[0])
    agent = CredentialCheck(key, "sb-1", clock=lambda: now[0])
    first = credential.metadata()
    assert credential.metadata() is first  # no HMAC per call
    assert isinstance(first, grpc.aio.Metadata)  # not converted from a tuple on every call
    ((name, value),) = tuple(first)
    assert name == "authorization" and agent.check(value.removeprefix("Bearer ")) is True
    now[0] += CREDENTIAL_TTL_S - CREDENTIAL_RENEW_S - 1
    assert credential.metadata() is first
    now[0] += 1
    ((_, renewed),) = tuple(credential.metadata())
    assert renewed != value and agent.check(renewed.removeprefix("Bearer ")) is True
    now[0] = 1000.0 + CREDENTIAL_TTL_S  # the first one has expired; the renewed one has not
    with pytest.raises(OrchardError, match="expired"):
        agent.check(value.removeprefix("Bearer "))
    assert agent.check(renewed.removeprefix("Bearer ")) is True
