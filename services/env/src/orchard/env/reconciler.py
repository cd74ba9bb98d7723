"""Reconciliation: the runtime and the records agree again after a restart, and on a timer.

Runtime sandboxes without a record are deleted; READY records whose runtime sandbox is gone or
exited become FAILED; PENDING records without a creating key are taken over, and those behind
this replica's own creating key with no creation running here are finished or created again
(repaired). It reads the record store's view; etcd is listed only when the runtime has a
sandbox the view does not know (the view may only lag a creation by another replica).
``runtime.exits()`` events make records FAILED as they happen; every replica asks the runtime
to ``adopt`` each READY sandbox, so the exit is seen even when the replica that made it is
gone. A record whose lease expired is reaped: its runtime resources are released.
"""

from __future__ import annotations

import asyncio
import logging

from orchard.core.etcd import EtcdStore, EtcdUnavailable
from orchard.env.config import EnvConfig
from orchard.env.creation import CreationWorker
from orchard.env.exec_router import dead_reason
from orchard.env.metrics import EnvMetrics
from orchard.env.record_store import RecordStore
from orchard.env.records import CREATING, SANDBOXES, SYNC, SandboxRecord
from orchard.env.runtime.base import Runtime, SandboxStatus
from orchard.env.tasks import BackgroundTasks
from orchard.env.v1 import env_pb2

__all__ = ["Reconciler"]

log = logging.getLogger(__name__)

PENDING = env_pb2.SANDBOX_STATE_PENDING
READY = env_pb2.SANDBOX_STATE_READY
DELETING = env_pb2.SANDBOX_STATE_DELETING
_CATCH_UP_S = 5.0


class Reconciler:
    """Keeps one replica's runtime and the records in agreement."""

    def __init__(
        self,
        store: EtcdStore,
        records: RecordStore,
        runtime: Runtime,
        config: EnvConfig,
        metrics: EnvMetrics,
        *,
        creation: CreationWorker,
        replica_id: str,
    ) -> None:
        self.store = store
        self.records = records
        self.runtime = runtime
        self.config = config
        self.metrics = metrics
        self.creation = creation
        self.replica_id = replica_id
        self._tasks = BackgroundTasks()

    def start(self) -> None:
        """The timer and the runtime's exit events (after a first :meth:`reconcile`)."""
        self._tasks.start(self._loop(), "reconcile")
        self._tasks.start(self._follow_exits(), "runtime-exits")

    async def close(self) -> None:
        await self._tasks.close()

    def spawn_adopt(self, sandbox_id: str) -> None:
        self._tasks.spawn(self.adopt(sandbox_id), f"adopt-{sandbox_id}")

    def spawn_reap(self, sandbox_id: str) -> None:
        self._tasks.spawn(self.reap(sandbox_id), f"reap-{sandbox_id}")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.reconcile_interval_s)
            self.creation.admission.wake()
            try:
                await self.reconcile()
            except EtcdUnavailable as exc:
                log.warning("reconcile skipped: %s", exc)
            except Exception:
                log.exception("reconcile failed")

    async def reconcile(self) -> dict[str, int]:
        """Compare the runtime with the records once; returns what it did, by kind."""
        done = {"leftovers": 0, "failed": 0, "taken_over": 0, "repaired": 0}
        # The runtime first: a sandbox created after this has its record in the records below.
        in_runtime = set(await self.runtime.list_sandboxes())
        # The view, once it caught up with etcd; etcd itself when it did not in time, or when
        # the runtime has a sandbox the view does not know (a creation a moment ago).
        view = self.records.view
        lease = self.creation.replica_lease
        current = lease is not None and await self.records.catch_up(
            f"{SYNC}{self.replica_id}", lease.id, _CATCH_UP_S
        )
        records = {r.id: r for r in view.records.values()}
        creating = {key.rsplit("/", 1)[-1]: rep for key, rep in view.creating.items()}
        if not current or in_runtime - records.keys() - self.creation.running.keys():
            records, creating = {}, {}
            listing = await self.store.list_prefix("")
            for kv in listing.kvs:
                key = kv.key_str
                if key.startswith(SANDBOXES):
                    record = SandboxRecord.from_kv(kv)
                    records[record.id] = record
                elif key.startswith(CREATING):
                    creating[key.rsplit("/", 1)[-1]] = kv.value_str
        for sandbox_id in sorted(in_runtime - records.keys()):
            if sandbox_id in self.creation.running:
                continue
            log.info("deleting a leftover runtime sandbox", extra={"sandbox_id": sandbox_id})
            await self.runtime.delete(sandbox_id)
            self.metrics.leftovers.inc()
            done["leftovers"] += 1
        for record in records.values():
            if record.state == READY:
                status = await self.runtime.status(record.id)
                if status is not SandboxStatus.RUNNING and await self.creation.fail(
                    record.tenant, record.id, *dead_reason(status)
                ):
                    done["failed"] += 1
                elif status is SandboxStatus.RUNNING:
                    await self.adopt(record.id)
            elif record.state != PENDING or record.queued:
                continue
            elif record.id not in creating:
                if await self.creation.take_over(record.tenant, record.id):
                    done["taken_over"] += 1
            elif creating[record.id] == self.replica_id and await self.creation.repair(record):
                done["repaired"] += 1
        if any(done.values()):
            log.info("reconciled", extra=done)
        return done

    async def _follow_exits(self) -> None:
        while True:
            try:
                async for event in self.runtime.exits():
                    record = self._find(event.sandbox_id)
                    if record is not None and record.state == DELETING:
                        continue  # its deleting replica releases it (every replica may watch it)
                    if record is not None:
                        await self.creation.fail(
                            record.tenant, record.id, event.reason.value, event.message
                        )
                    else:
                        await self.runtime.delete(event.sandbox_id)
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("runtime exit events failed; following again")
                await asyncio.sleep(1)

    def _find(self, sandbox_id: str) -> SandboxRecord | None:
        return self.records.cached_by_id(sandbox_id)

    async def adopt(self, sandbox_id: str) -> None:
        """Have the runtime report this sandbox's exit, whichever replica started it."""
        try:
            await self.runtime.adopt(sandbox_id)
        except Exception:
            log.exception("could not watch a sandbox's exit", extra={"sandbox_id": sandbox_id})

    async def reap(self, sandbox_id: str) -> None:
        """The record's lease expired: release the runtime's resources, if any remain."""
        try:
            status = await self.runtime.status(sandbox_id)
            await self.runtime.delete(sandbox_id)
        except Exception:
            log.exception("reaping failed; reconcile will retry", extra={"sandbox_id": sandbox_id})
            return
        if status is not SandboxStatus.ABSENT:
            self.metrics.reaped.inc()
            log.info("sandbox reaped", extra={"sandbox_id": sandbox_id})
