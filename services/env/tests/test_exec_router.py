"""ExecRouter: links to READY sandboxes' agents from the view, clear errors otherwise, and the
alive check. Real etcd, a real agent (started by the unisolated runtime double)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from orchard.core.errors import OrchardError
from orchard.core.etcd import EmbeddedEtcd, EtcdStore
from orchard.env.exec_router import ExecRouter
from orchard.env.metrics import EnvMetrics
from orchard.env.record_store import RecordStore
from orchard.env.records import SandboxRecord, sandbox_key
from orchard.env.runtime.base import RuntimeSandboxSpec
from orchard.env.v1 import env_pb2
from orchard.inagent.v1 import inagent_service_pb2

READY = env_pb2.SANDBOX_STATE_READY
FAILED = env_pb2.SANDBOX_STATE_FAILED
PENDING = env_pb2.SANDBOX_STATE_PENDING


class Unheard:
    def __getattr__(self, name: str) -> Any:
        return lambda *args: None


@pytest.fixture
async def parts(
    etcd: EmbeddedEtcd, prefix: str, runtime: Any
) -> AsyncIterator[tuple[EtcdStore, RecordStore, ExecRouter]]:
    async with EtcdStore(etcd.endpoint, namespace=prefix) as store:
        records = RecordStore(store, EnvMetrics(None), Unheard())
        await records.start()
        router = ExecRouter(records, runtime)
        try:
            yield store, records, router
        finally:
            await router.close()
            await records.close()
            await store.delete_prefix(b"")


async def put(store: EtcdStore, sandbox_id: str, state: int, **fields: Any) -> SandboxRecord:
    record = SandboxRecord(env_pb2.Sandbox(id=sandbox_id, tenant="alpha", state=state), **fields)
    record.mod_revision = await store.put(sandbox_key("alpha", sandbox_id), record.encode())
    return record


async def test_a_ready_sandbox_routes_to_its_agent(parts: Any, runtime: Any) -> None:
    store, _, router = parts
    made = await runtime.create(RuntimeSandboxSpec(sandbox_id="sbx-routed", image="host"))
    await put(store, "sbx-routed", READY, agent_address=made.agent_address)
    link = await router.agent("alpha", "sbx-routed")  # read from etcd or the view: both work
    info = await (await link.grpc(5)).GetAgentInfo(
        inagent_service_pb2.GetAgentInfoRequest(), timeout=5
    )
    assert info.version
    assert await router.dead_reason("sbx-routed") is None
    # Another tenant's id, a missing one: NOT_FOUND, never the link.
    for tenant, sandbox_id in (("beta", "sbx-routed"), ("alpha", "sbx-nope")):
        with pytest.raises(OrchardError) as caught:
            await router.agent(tenant, sandbox_id)
        assert caught.value.reason.name == "SANDBOX_NOT_FOUND"
    await runtime.delete("sbx-routed")
    assert await router.dead_reason("sbx-routed") == (
        "RUNTIME_DIED",
        "the runtime no longer has this sandbox",
    )


async def test_a_sandbox_not_ready_is_refused_with_its_state(parts: Any) -> None:
    store, _, router = parts
    await put(store, "sbx-pending", PENDING)
    failed = SandboxRecord(env_pb2.Sandbox(id="sbx-failed", tenant="alpha", state=FAILED))
    failed.sandbox.failure.reason = "IMAGE_NOT_FOUND"
    failed.sandbox.failure.message = "no image"
    await store.put(sandbox_key("alpha", "sbx-failed"), failed.encode())
    with pytest.raises(OrchardError) as caught:
        await router.agent("alpha", "sbx-pending")
    assert caught.value.reason.name == "SANDBOX_NOT_READY" and "PENDING" in str(caught.value)
    with pytest.raises(OrchardError) as caught:
        await router.agent("alpha", "sbx-failed")
    assert "IMAGE_NOT_FOUND: no image" in str(caught.value)
