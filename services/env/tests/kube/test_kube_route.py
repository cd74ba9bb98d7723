"""The direct route on the kubernetes runtime (through the Kubernetes API test double, whose
Pods run real agents): OpenAgentRoute gives the Pod IP and a credential signed with the key in
the sandbox's Secret; the agent accepts it, and refuses it at another sandbox's Pod. The Pod's
agent requires a credential: it refuses a call without one, orchard-env's own calls carry one,
and a client's credential cannot be passed off as orchard-env's."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from kube_harness import BUSYBOX_IMAGE, NAMESPACE

from orchard.env.v1 import env_service_pb2 as api
from orchard.inagent.v1 import inagent_service_pb2 as agent_pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as agent_grpc
from orchard.sdk import AsyncSandboxClient
from orchard.types.v1 import exec_pb2

pytestmark = [pytest.mark.root, pytest.mark.slow]


async def _exec(address: str, credential: str | None) -> Any:
    metadata = () if credential is None else (("authorization", f"Bearer {credential}"),)
    async with grpc.aio.insecure_channel(address) as channel:
        return await agent_grpc.AgentServiceStub(channel).Exec(
            agent_pb.ExecRequest(command=exec_pb2.Command(argv=["hostname"])),
            metadata=metadata,
            timeout=10,
        )


async def _refused(address: str, credential: str | None) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _exec(address, credential)
    return caught.value.code()


async def test_a_route_reaches_the_pod_ip_with_the_secret_key(
    env_factory: Any, runtime_for: Any, double: Any
) -> None:
    env = await env_factory(runtime=await runtime_for())
    x = await env.ready(image=BUSYBOX_IMAGE)
    y = await env.ready(image=BUSYBOX_IMAGE)
    route = await env.stub.OpenAgentRoute(
        api.OpenAgentRouteRequest(sandbox_id=x.id), metadata=env.md()
    )
    assert not route.address.startswith("unix:")  # the Pod IP and the agent's port
    calls = len(double.requests)
    assert (await _exec(route.address, route.credential)).result.stdout == f"{x.id}\n".encode()
    assert len(double.requests) == calls  # neither the API server nor the service
    y_route = await env.stub.OpenAgentRoute(
        api.OpenAgentRouteRequest(sandbox_id=y.id), metadata=env.md()
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _exec(y_route.address, route.credential)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED

    async with AsyncSandboxClient(env.address, token=env.token, direct_agent=True) as client:
        handle = await client.get(x.id)
        assert (await handle.exec(["hostname"])).stdout == f"{x.id}\n".encode()
        assert client.routes is not None and client.routes.opened == 1


async def test_the_pod_agent_requires_a_credential_and_orchard_env_sends_its_own(
    env_factory: Any, runtime_for: Any, double: Any
) -> None:
    env = await env_factory(runtime=await runtime_for())
    x = await env.ready(image=BUSYBOX_IMAGE)
    pod = double.get("pods", NAMESPACE, x.id)
    args = pod["spec"]["containers"][0]["args"]
    assert args[-2:] == ["--set", "require_credential=true"]
    route = await env.stub.OpenAgentRoute(
        api.OpenAgentRouteRequest(sandbox_id=x.id), metadata=env.md()
    )
    # The agent refuses a call without a credential, so orchard-env's calls carry one.
    assert await _refused(route.address, None) == grpc.StatusCode.UNAUTHENTICATED
    for _ in range(2):
        assert (await env.shell(x.id, "hostname")).stdout == f"{x.id}\n".encode()
    # A client credential works over the route, but relabelled as orchard-env's it fails:
    # the scope is under the MAC.
    assert (await _exec(route.address, route.credential)).result.stdout == f"{x.id}\n".encode()
    version, rest = route.credential.split(".", 1)
    assert version == "v1"
    assert await _refused(route.address, f"v1-env.{rest}") == grpc.StatusCode.UNAUTHENTICATED
