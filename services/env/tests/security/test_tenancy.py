"""Tenant checks on every RPC of ``orchard.env.v1.EnvService``, enumerated from the service
descriptor: an RPC added without an entry here fails the suite. Tenant ``beta`` acting on
tenant ``alpha``'s sandbox or owner gets NOT_FOUND (the deletes, idempotent by contract,
succeed and delete nothing) and changes nothing; a call without a valid token is
UNAUTHENTICATED and changes nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from orchard.env.v1 import env_pb2, env_service_pb2
from orchard.env.v1 import env_service_pb2 as api
from orchard.types.v1 import exec_pb2

pytestmark = [pytest.mark.root, pytest.mark.slow]

SERVICE = env_service_pb2.DESCRIPTOR.services_by_name["EnvService"]
OK = grpc.StatusCode.OK
NOT_FOUND = grpc.StatusCode.NOT_FOUND
MARK = "/tmp/touched-by-another-tenant"
BETA_TOKEN = "beta-token"  # tenant beta of the tests' configuration (tests/conftest.py)


@dataclass
class Victim:
    """What tenant alpha owns while the others try."""

    sandbox: env_pb2.Sandbox
    owner_id: str
    request_id: str = "alpha-request"


def _touch() -> exec_pb2.Command:
    return exec_pb2.Command(shell=f"touch {MARK}")


async def _write_chunks(sandbox_id: str) -> AsyncIterator[api.WriteFileRequest]:
    yield api.WriteFileRequest(header=api.WriteFileHeader(sandbox_id=sandbox_id, path=MARK))
    yield api.WriteFileRequest(data=b"pwned")


# RPC name → (the request another tenant sends against the victim, the status it must get).
Attempt = Callable[[Victim], Any]
ATTEMPTS: dict[str, tuple[Attempt, grpc.StatusCode]] = {
    "CreateSandbox": (
        lambda v: api.CreateSandboxRequest(
            spec=env_pb2.SandboxSpec(image="host", owner_id=v.owner_id), request_id=v.request_id
        ),
        NOT_FOUND,
    ),
    "WaitSandbox": (lambda v: api.WaitSandboxRequest(sandbox_id=v.sandbox.id), NOT_FOUND),
    "GetSandbox": (lambda v: api.GetSandboxRequest(sandbox_id=v.sandbox.id), NOT_FOUND),
    "ListSandboxes": (lambda v: api.ListSandboxesRequest(), OK),
    "DeleteSandbox": (lambda v: api.DeleteSandboxRequest(sandbox_id=v.sandbox.id), OK),
    "HeartbeatSandbox": (
        lambda v: api.HeartbeatSandboxRequest(sandbox_id=v.sandbox.id),
        NOT_FOUND,
    ),
    "Exec": (lambda v: api.ExecRequest(sandbox_id=v.sandbox.id, command=_touch()), NOT_FOUND),
    "ExecStream": (
        lambda v: api.ExecStreamRequest(sandbox_id=v.sandbox.id, command=_touch()),
        NOT_FOUND,
    ),
    "WriteFile": (lambda v: _write_chunks(v.sandbox.id), NOT_FOUND),
    "ReadFile": (
        lambda v: api.ReadFileRequest(sandbox_id=v.sandbox.id, path="/etc/hostname"),
        NOT_FOUND,
    ),
    "ListFiles": (lambda v: api.ListFilesRequest(sandbox_id=v.sandbox.id, path="/"), NOT_FOUND),
    "StatFile": (lambda v: api.StatFileRequest(sandbox_id=v.sandbox.id, path="/"), NOT_FOUND),
    "ForkSandbox": (lambda v: api.ForkSandboxRequest(sandbox_id=v.sandbox.id, count=1), NOT_FOUND),
    "CreateOwner": (lambda v: api.CreateOwnerRequest(request_id=v.request_id), OK),
    "HeartbeatOwner": (lambda v: api.HeartbeatOwnerRequest(owner_id=v.owner_id), NOT_FOUND),
    "DeleteOwner": (lambda v: api.DeleteOwnerRequest(owner_id=v.owner_id), OK),
    "UpdateNetworkPolicy": (
        lambda v: api.UpdateNetworkPolicyRequest(
            sandbox_id=v.sandbox.id,
            network_policy=env_pb2.NetworkPolicy(
                egress=[env_pb2.EgressRule(destination="1.1.1.1")]
            ),
        ),
        NOT_FOUND,
    ),
    "OpenAgentRoute": (lambda v: api.OpenAgentRouteRequest(sandbox_id=v.sandbox.id), NOT_FOUND),
}


def test_every_rpc_has_a_tenant_check() -> None:
    methods = {method.name for method in SERVICE.methods}
    assert methods - ATTEMPTS.keys() == set(), "RPCs without a tenant test"
    assert ATTEMPTS.keys() - methods == set(), "tests of RPCs that no longer exist"


async def call(stub: Any, name: str, request: Any, metadata: Any) -> tuple[grpc.StatusCode, Any]:
    """Any RPC by name: its status and its reply (a list for a server stream)."""
    method = SERVICE.methods_by_name[name]
    try:
        if method.server_streaming:
            return OK, [reply async for reply in getattr(stub, name)(request, metadata=metadata)]
        return OK, await getattr(stub, name)(request, metadata=metadata, timeout=30)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), None


async def _victim(env: Any) -> Victim:
    owner = await env.stub.CreateOwner(
        api.CreateOwnerRequest(request_id="alpha-request"), metadata=env.md()
    )
    sandbox = await env.create(timeout_s=120, labels={"who": "alpha"})
    reply = await env.stub.CreateSandbox(
        api.CreateSandboxRequest(
            spec=env_pb2.SandboxSpec(image="host", labels={"who": "alpha"}),
            request_id="alpha-request",
        ),
        metadata=env.md(),
    )
    await env.wait(reply.sandbox.id)
    sandbox = await env.wait(sandbox.id)
    assert sandbox.state == env_pb2.SANDBOX_STATE_READY
    return Victim(sandbox, owner.owner.id)


async def _state(env: Any, victim: Victim) -> tuple[Any, ...]:
    """Everything alpha can observe of its own resources."""
    got = await env.stub.GetSandbox(
        api.GetSandboxRequest(sandbox_id=victim.sandbox.id), metadata=env.md()
    )
    listed = await env.stub.ListSandboxes(api.ListSandboxesRequest(), metadata=env.md())
    marker = await env.shell(victim.sandbox.id, f"test -e {MARK} && echo touched")
    owner = await env.stub.HeartbeatOwner(
        api.HeartbeatOwnerRequest(owner_id=victim.owner_id), metadata=env.md()
    )
    sandbox = got.sandbox
    return (
        sandbox.state,
        sandbox.spec.SerializeToString(deterministic=True),
        sorted(s.id for s in listed.sandboxes),
        marker.stdout,
        owner.expire_time.seconds > 0,
    )


async def test_another_tenant_reaches_nothing_through_any_rpc(
    env_factory: Any, local_runtime: Any, attack: Any
) -> None:
    alpha = await env_factory(runtime=local_runtime)
    victim = await _victim(alpha)
    before = await _state(alpha, victim)
    beta_md = alpha.md(BETA_TOKEN)
    for method in SERVICE.methods:
        make, expected = ATTEMPTS[method.name]
        attack.tried(f"tenant beta: {method.name} on alpha's sandbox or owner")
        code, reply = await call(alpha.stub, method.name, make(victim), beta_md)
        assert code == expected, (method.name, code)
        if method.name == "ListSandboxes":
            assert list(reply.sandboxes) == []
        if method.name == "DeleteOwner":
            assert reply.sandboxes_deleted == 0
        if method.name == "CreateOwner":
            assert reply.owner.id != victim.owner_id and reply.owner.tenant == "beta"
        attack.held(f"tenant beta: {method.name} on alpha's sandbox or owner")
    assert await _state(alpha, victim) == before

    attack.tried("tenant beta: CreateSandbox with alpha's request_id")
    mine = await alpha.stub.CreateSandbox(
        api.CreateSandboxRequest(
            spec=env_pb2.SandboxSpec(image="host"), request_id="alpha-request"
        ),
        metadata=beta_md,
    )
    assert mine.sandbox.tenant == "beta" and mine.sandbox.id not in before[2]
    await alpha.stub.DeleteSandbox(
        api.DeleteSandboxRequest(sandbox_id=mine.sandbox.id), metadata=beta_md
    )
    assert await _state(alpha, victim) == before
    attack.held("tenant beta: CreateSandbox with alpha's request_id")


BAD_CREDENTIALS: dict[str, tuple[tuple[str, str], ...]] = {
    "no token": (),
    "unknown token": (("authorization", "Bearer not-a-token"),),
    "another scheme": (("authorization", "Basic YWxwaGE6YWxwaGE="),),
    "empty bearer": (("authorization", "Bearer "),),
    "a tenant's name as token": (("authorization", "Bearer alpha"),),
    "a token's digest as token": (("authorization", "Bearer sha256:" + "0" * 64),),
}


async def test_calls_without_a_valid_token_are_unauthenticated(
    env_factory: Any, local_runtime: Any, attack: Any
) -> None:
    alpha = await env_factory(runtime=local_runtime)
    victim = await _victim(alpha)
    before = await _state(alpha, victim)
    for method in SERVICE.methods:
        make, _ = ATTEMPTS[method.name]
        for what, metadata in BAD_CREDENTIALS.items():
            attack.tried(f"{what}: {method.name}")
            code, _ = await call(alpha.stub, method.name, make(victim), metadata)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (method.name, what, code)
            attack.held(f"{what}: {method.name}")
    assert await _state(alpha, victim) == before
