"""A fork meets the operator's privilege settings of the day, not those its source met."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from orchard.env.config import PrivilegesConfig
from orchard.env.v1 import env_pb2
from orchard.env.v1 import env_service_pb2 as api


async def test_a_fork_is_refused_a_privilege_the_operator_took_back(
    env_factory: Any, runtime: Any, attack: Any
) -> None:
    granted = await env_factory(privileges=PrivilegesConfig(raw_sockets=["alpha"]))
    revoked = await env_factory()  # a replica whose settings no longer grant raw sockets
    source = await granted.ready(privileges=env_pb2.SandboxPrivileges(raw_sockets=True))

    attack.tried("fork a sandbox to keep a privilege the operator took back")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await revoked.stub.ForkSandbox(
            api.ForkSandboxRequest(sandbox_id=source.id, count=2), metadata=revoked.md()
        )
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "raw_sockets" in (caught.value.details() or "")
    assert runtime.forked == []
    listed = await revoked.stub.ListSandboxes(api.ListSandboxesRequest(), metadata=revoked.md())
    assert [sandbox.id for sandbox in listed.sandboxes] == [source.id]
    attack.held("fork a sandbox to keep a privilege the operator took back")

    # Where the settings still grant it, the fork goes through and keeps the privilege.
    forked = await granted.stub.ForkSandbox(
        api.ForkSandboxRequest(sandbox_id=source.id, count=1), metadata=granted.md()
    )
    fork = await granted.wait(forked.sandboxes[0].id)
    assert fork.state == env_pb2.SANDBOX_STATE_READY
    assert fork.spec.privileges.raw_sockets
