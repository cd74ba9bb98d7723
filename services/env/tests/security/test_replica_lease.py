"""A replica whose own lease is lost (etcd away, or the process too busy to refresh it in
time) takes a new one and keeps creating sandboxes; its creations in flight keep their claim."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from orchard.env.v1 import env_pb2


async def _renewed(controller: Any, old_id: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while controller._replica_lease.id == old_id:
        assert time.monotonic() < deadline, "the replica never took a new lease"
        await asyncio.sleep(0.02)


async def test_a_replica_that_lost_its_lease_takes_a_new_one_and_keeps_creating(
    env: Any, runtime: Any
) -> None:
    controller = env.app.controller
    lost = controller._replica_lease
    await controller.store.revoke_lease(lost)  # what an expiry does: every key under it goes
    await _renewed(controller, lost.id)

    # Creations after the loss work (before, every one failed on the vanished lease).
    sandboxes = [await env.create() for _ in range(5)]
    for sandbox in sandboxes:
        assert (await env.wait(sandbox.id)).state == env_pb2.SANDBOX_STATE_READY
    assert sorted(await runtime.list_sandboxes()) == sorted(s.id for s in sandboxes)
    replicas = await controller.store.list_prefix("replicas/")
    assert [kv.lease for kv in replicas.kvs] == [controller._replica_lease.id]


async def test_creations_in_flight_keep_their_claim_across_a_lost_lease(
    env: Any, runtime: Any
) -> None:
    controller = env.app.controller
    runtime.start_delay_s = 1.0  # creations still running when the lease goes
    sandboxes = [await env.create() for _ in range(3)]
    lost = controller._replica_lease
    await controller.store.revoke_lease(lost)
    await _renewed(controller, lost.id)
    runtime.start_delay_s = 0.0
    for sandbox in sandboxes:
        assert (await env.wait(sandbox.id)).state == env_pb2.SANDBOX_STATE_READY
    assert sorted(await runtime.list_sandboxes()) == sorted(s.id for s in sandboxes)
    # Nothing was created twice: no take-over deleted and remade a sandbox under way.
    assert runtime.deleted == []
