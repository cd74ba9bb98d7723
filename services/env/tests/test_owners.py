"""OwnerRegistry on a real etcd: request-id de-duplication, tenancy, renewal, deletion."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from orchard.core.errors import OrchardError
from orchard.core.etcd import EmbeddedEtcd, EtcdStore
from orchard.env.metrics import EnvMetrics
from orchard.env.owners import OwnerRegistry
from orchard.env.record_store import RecordStore
from orchard.env.records import SandboxRecord, sandbox_key
from orchard.env.v1 import env_pb2


class Unheard:
    """The record store's listener; these tests look at the store itself."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args: None


@pytest.fixture
async def parts(etcd: EmbeddedEtcd, prefix: str) -> AsyncIterator[tuple[EtcdStore, OwnerRegistry]]:
    async with EtcdStore(etcd.endpoint, namespace=prefix) as store:
        records = RecordStore(store, EnvMetrics(None), Unheard())
        await records.start()
        try:
            yield store, OwnerRegistry(store, records)
        finally:
            await records.close()
            await store.delete_prefix(b"")


async def test_a_retry_with_the_same_request_id_returns_the_same_owner(parts: Any) -> None:
    store, owners = parts
    first = await owners.create("alpha", {"job": "j"}, 30, "req-1")
    again = await owners.create("alpha", {"job": "j"}, 30, "req-1")
    assert again.owner.id == first.owner.id and again.lease == first.lease
    other = await owners.create("beta", {}, 30, "req-1")  # request ids are per tenant
    assert other.owner.id != first.owner.id
    assert first.owner.expire_time.seconds >= int(time.time()) + 28
    # One owner per request: the retry granted no lease that outlives it.
    listing = await store.get_prefix("owners/")
    assert len(listing.kvs) == 2


async def test_another_tenants_owner_is_not_found(parts: Any) -> None:
    _, owners = parts
    owner = await owners.create("alpha", {}, 30, "")
    assert (await owners.get("alpha", owner.owner.id)).owner.id == owner.owner.id
    for call in (owners.get, owners.heartbeat, owners.lease):
        with pytest.raises(OrchardError) as caught:
            await call("beta", owner.owner.id)
        assert caught.value.reason.name == "OWNER_NOT_FOUND"
    assert await owners.delete("beta", owner.owner.id) == 0
    assert (await owners.get("alpha", owner.owner.id)).owner.id == owner.owner.id


async def test_heartbeat_renews_and_delete_drops_every_sandbox_under_it(parts: Any) -> None:
    store, owners = parts
    owner = await owners.create("alpha", {}, 3, "")
    lease_id, left = await owners.lease("alpha", owner.owner.id)
    assert lease_id == owner.lease and 0 < left <= 3
    for n in range(3):
        sandbox = env_pb2.Sandbox(id=f"sbx-{n}", tenant="alpha", state=env_pb2.SANDBOX_STATE_READY)
        await store.put(
            sandbox_key("alpha", sandbox.id), SandboxRecord(sandbox).encode(), lease=lease_id
        )
    await asyncio.sleep(1.2)
    expiry = await owners.heartbeat("alpha", owner.owner.id)
    assert time.time() + 2 < expiry <= time.time() + 3.5
    assert await owners.delete("alpha", owner.owner.id) == 3
    assert (await store.get_prefix("sandboxes/")).kvs == []
    with pytest.raises(OrchardError):
        await owners.get("alpha", owner.owner.id)
