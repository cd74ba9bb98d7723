"""Sandbox lifecycle over etcd records and a runtime: create, wait, delete, heartbeat, reap,
reconcile. Every replica runs one :class:`SandboxController` on the same store.

The controller is the service's one entry point and holds the parts together; each part is a
module of its own:

- :mod:`~orchard.env.record_store` — the records: typed etcd reads and writes, the view the
  process's one watch keeps (:mod:`~orchard.env.record_watch`), state counts, lease expiry,
  request-id de-duplication. Get, Wait, Heartbeat and exec routing read the view: no etcd.
- :mod:`~orchard.env.creation` — creations and forks from the record's insert to READY or
  FAILED, take-over of a dead replica's creations, admission, this replica's lease.
- :mod:`~orchard.env.reconciler` — the runtime and the records agree again: leftovers,
  dead sandboxes, orphaned creations, exits, reaping of expired records.
- :mod:`~orchard.env.owners` — owners and their leases.
- :mod:`~orchard.env.exec_router` — links to READY sandboxes' agents and the alive check.

Callbacks run one way: the watcher tells the record store of each change, the store tells this
controller (its listener), and the controller hands the change to the parts; no part calls
back into the controller.

Here too: **Wait** registers with the watcher and looks at the view again on each change of
its key (no polling); **Delete** marks the record DELETING, cancels a creation this replica
runs, calls ``runtime.delete`` and removes the record, creating key and request key in one
transaction. A replica running the creation of a record that turns DELETING cancels it; one
that finishes a creation and finds the record no longer PENDING deletes what it made.
**Reaping**: when a record disappears and it was not DELETING (its lease expired), every
replica calls ``runtime.delete``; the one that still found resources counts the reap.

Replicas must see one runtime (the same host for ``local``, the same cluster for
``kubernetes``): any replica may delete, status or reconcile any sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable

from orchard.core.errors import OrchardError, Reason
from orchard.core.etcd import DeleteOp, EtcdError, EtcdStore, Lease, LeaseNotFound
from orchard.env.agents import AgentLink
from orchard.env.config import EnvConfig
from orchard.env.creation import CreationWorker, egress_rules, new_sandbox_id
from orchard.env.exec_router import ExecRouter
from orchard.env.metrics import EnvMetrics
from orchard.env.owners import OwnerRegistry
from orchard.env.peers import resolve_peer_rules
from orchard.env.reasons import EnvReason
from orchard.env.reconciler import Reconciler
from orchard.env.record_store import RecordStore, not_found, store_unavailable
from orchard.env.records import SANDBOXES, OwnerRecord, SandboxRecord, creating_key, sandbox_key
from orchard.env.runtime.base import Runtime, RuntimeFailure, RuntimeNotSupported
from orchard.env.sealing import SpecSealer
from orchard.env.v1 import env_pb2
from orchard.env.validation import ImagePolicy, invalid

__all__ = ["SandboxController", "egress_rules", "new_sandbox_id"]

log = logging.getLogger(__name__)

PENDING = env_pb2.SANDBOX_STATE_PENDING
READY = env_pb2.SANDBOX_STATE_READY
FAILED = env_pb2.SANDBOX_STATE_FAILED
DELETING = env_pb2.SANDBOX_STATE_DELETING
_SETTLED = (READY, FAILED)


class SandboxController:
    """Records, leases and the runtime for one replica."""

    def __init__(
        self,
        store: EtcdStore,
        runtime: Runtime,
        config: EnvConfig,
        metrics: EnvMetrics,
        *,
        replica_id: str | None = None,
    ) -> None:
        self.store = store
        self.runtime = runtime
        self.config = config
        self.metrics = metrics
        self.replica_id = replica_id or "rep-" + secrets.token_hex(6)
        self.images = ImagePolicy(
            config.images, runtime.private_paths(), service_paths=(config.secrets.key_file,)
        )
        # spec.env values stay sealed in every record; opened for the runtime and the tenant.
        self.sealer = SpecSealer.from_config(config.secrets)
        # The watcher feeds the record store; the store tells this controller of each change.
        self.records = RecordStore(store, metrics, self)
        self.watcher = self.records.view
        self.router = ExecRouter(self.records, runtime, use_lanes=config.exec_lane)
        self.agents = self.router.links
        self.owners = OwnerRegistry(store, self.records)
        self.creation = CreationWorker(
            store,
            self.records,
            runtime,
            config,
            metrics,
            router=self.router,
            owners=self.owners,
            images=self.images,
            sealer=self.sealer,
            replica_id=self.replica_id,
        )
        self.admission = self.creation.admission
        self.reconciler = Reconciler(
            store,
            self.records,
            runtime,
            config,
            metrics,
            creation=self.creation,
            replica_id=self.replica_id,
        )
        self._closing = False

    @property
    def _replica_lease(self) -> Lease | None:
        return self.creation.replica_lease

    # -- lifecycle of the controller ----------------------------------------------------------

    async def start(self) -> None:
        await self.sealer.claim(self.store)
        await self.creation.start()
        await self.records.start()
        await self.reconcile()
        self.creation.start_admission()
        self.reconciler.start()
        log.info("controller started", extra={"replica": self.replica_id})

    async def close(self) -> None:
        """Stop background work. Creations in flight are cancelled (the runtime releases what
        they made); their records stay PENDING and another replica, or this one after a
        restart, takes them over once this replica's lease is gone."""
        self._closing = True
        await self.reconciler.close()
        await self.creation.close()
        await self.records.close()
        await self.router.close()

    # -- reads ---------------------------------------------------------------------------------

    async def get(self, tenant: str, sandbox_id: str, *, expire_time: bool = True) -> SandboxRecord:
        """A copy of the record, from the view (etcd only when the view has not heard of it)."""
        try:
            record = await self.records.read(tenant, sandbox_id)
        except EtcdError as exc:
            raise store_unavailable(exc) from exc
        if record is None:
            raise not_found(sandbox_id)
        if expire_time:
            await self.fill_expire_time(record)
        return record

    async def fill_expire_time(self, record: SandboxRecord) -> None:
        await self.records.fill_expire_time(record)

    async def list_records(
        self, tenant: str, start_after_id: str, want: int, keep: Callable[[SandboxRecord], bool]
    ) -> tuple[list[SandboxRecord], bool]:
        """Up to ``want`` records of ``tenant`` after ``start_after_id`` that ``keep`` accepts,
        by id; and whether more may follow."""
        prefix = f"{SANDBOXES}{tenant}/"
        start_after: str | bytes | None = prefix + start_after_id if start_after_id else None
        found: list[SandboxRecord] = []
        chunk = min(max(want * 2, 64), 2000)
        try:
            while True:
                page = await self.store.get_prefix(prefix, limit=chunk, start_after=start_after)
                for kv in page.kvs:
                    record = SandboxRecord.from_kv(kv)
                    if keep(record):
                        found.append(record)
                        if len(found) > want:
                            return found[:want], True
                if not page.more or not page.kvs:
                    return found, False
                start_after = page.kvs[-1].key
        except EtcdError as exc:
            raise store_unavailable(exc) from exc

    # -- create, fork, fail (the creation worker) --------------------------------------------

    async def create(
        self, tenant: str, spec: env_pb2.SandboxSpec, ttl_s: int, request_id: str
    ) -> SandboxRecord:
        """Write a new PENDING record and start it, or queue it when admission is full.

        With ``spec.owner_id`` the record lives under the owner's lease (NOT_FOUND when the
        owner is unknown, another tenant's or expired). Egress rules naming another sandbox
        are checked now (NOT_FOUND, FAILED_PRECONDITION) and resolved again at the start."""
        # The new sandbox has no id yet: "" names none, so only its targets are checked.
        await resolve_peer_rules(
            self.records,
            tenant,
            "",
            egress_rules(spec.network_policy),
            field="spec.network_policy",
            strict=True,
        )
        return await self.creation.create(tenant, spec, ttl_s, request_id)

    async def fork(
        self,
        tenant: str,
        source_id: str,
        count: int,
        labels: dict[str, str],
        request_id: str,
    ) -> list[SandboxRecord]:
        """``count`` new records copying a READY sandbox's spec (see ``CreationWorker.fork``)."""
        return await self.creation.fork(tenant, source_id, count, labels, request_id)

    def check_privileges(self, tenant: str, spec: env_pb2.SandboxSpec, field: str) -> None:
        self.creation.check_privileges(tenant, spec, field)

    async def fail(self, tenant: str, sandbox_id: str, reason: str, message: str) -> bool:
        """PENDING/READY → FAILED with a reason, then release the runtime's resources."""
        return await self.creation.fail(tenant, sandbox_id, reason, message)

    async def _update(
        self, key: str, mutate: Callable[[SandboxRecord], bool]
    ) -> SandboxRecord | None:
        return await self.records.update(key, mutate)

    # -- wait, heartbeat, delete ------------------------------------------------------------

    async def wait(self, tenant: str, sandbox_id: str, timeout_s: float | None) -> SandboxRecord:
        key = sandbox_key(tenant, sandbox_id)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            changed = self.watcher.changed(key)
            try:
                try:
                    record = await self.get(tenant, sandbox_id, expire_time=False)
                except OrchardError as exc:
                    # etcd away: the record will settle once it is back, so keep waiting.
                    if exc.reason is not EnvReason.STATE_STORE_UNAVAILABLE:
                        raise
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed, min(1.0, remaining or 1.0))
                    continue
                if record.state in _SETTLED:
                    await self.fill_expire_time(record)
                    return record
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise self._wait_timeout(sandbox_id)
                try:
                    await asyncio.wait_for(changed, remaining)
                except TimeoutError:
                    raise self._wait_timeout(sandbox_id) from None
            finally:
                self.watcher.forget(key, changed)

    @staticmethod
    def _wait_timeout(sandbox_id: str) -> OrchardError:
        return OrchardError(
            Reason.DEADLINE_EXCEEDED,
            f"sandbox {sandbox_id!r} was neither READY nor FAILED within the timeout",
            metadata={"sandbox_id": sandbox_id},
        )

    async def heartbeat(self, tenant: str, sandbox_id: str) -> float:
        """Renew the lease once; returns the new expiry as Unix seconds."""
        record = await self.get(tenant, sandbox_id, expire_time=False)
        try:
            ttl = await self.store.refresh_lease(record.lease)
        except LeaseNotFound:
            raise not_found(sandbox_id) from None
        except EtcdError as exc:
            raise store_unavailable(exc) from exc
        self.records.leases.note(record.lease, ttl)
        return time.time() + ttl

    # -- owners ------------------------------------------------------------------------------

    async def create_owner(
        self, tenant: str, labels: dict[str, str], ttl_s: int, request_id: str
    ) -> OwnerRecord:
        return await self.owners.create(tenant, labels, ttl_s, request_id)

    async def get_owner(self, tenant: str, owner_id: str) -> OwnerRecord:
        return await self.owners.get(tenant, owner_id)

    async def heartbeat_owner(self, tenant: str, owner_id: str) -> float:
        return await self.owners.heartbeat(tenant, owner_id)

    async def delete_owner(self, tenant: str, owner_id: str) -> int:
        return await self.owners.delete(tenant, owner_id)

    # -- delete --------------------------------------------------------------------------------

    async def delete(self, tenant: str, sandbox_id: str) -> None:
        started = time.monotonic()
        key = sandbox_key(tenant, sandbox_id)

        def to_deleting(r: SandboxRecord) -> bool:
            if r.state == DELETING:
                return False
            r.sandbox.state = DELETING
            return True

        try:
            found = await self.records.read(tenant, sandbox_id)
            if found is None:
                return
            record = found
            await self._update(key, to_deleting)
        except EtcdError as exc:
            raise store_unavailable(exc) from exc
        creation = self.creation.cancel(sandbox_id)
        if creation is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await creation
        self.router.drop(sandbox_id)
        await self.runtime.delete(sandbox_id)
        ops = [DeleteOp.of(key), DeleteOp.of(creating_key(tenant, sandbox_id))]
        if record.request_key:
            ops.append(DeleteOp.of(record.request_key))
        try:
            result = await self.store.txn([], ops)
        except EtcdError as exc:
            raise store_unavailable(exc) from exc
        self.records.offer_deletion(tenant, sandbox_id, result.revision)
        await self.admission.release(sandbox_id, record.slots)
        self.metrics.delete_seconds.observe(time.monotonic() - started)

    # -- network policy ----------------------------------------------------------------------

    async def update_network_policy(
        self, tenant: str, sandbox_id: str, policy: env_pb2.NetworkPolicy
    ) -> SandboxRecord:
        """Apply ``policy`` in the runtime (it holds when this returns), then record it.

        NOT_FOUND; FAILED_PRECONDITION unless READY (a PENDING sandbox starts with the policy
        of its spec); UNIMPLEMENTED when the runtime cannot enforce it; UNAVAILABLE when it
        failed to apply it (e.g. a host name did not resolve), the record unchanged.
        """
        record = await self.get(tenant, sandbox_id, expire_time=False)
        self._require_ready_for_policy(record)
        accepted = record.sandbox.spec.network_policy.ingress_ports
        if policy.ingress_ports and list(policy.ingress_ports) != list(accepted):
            raise invalid(
                "network_policy.ingress_ports",
                f"are fixed at create ({', '.join(map(str, accepted)) or 'none'}); leave them "
                "empty or repeat them",
            )
        policy = env_pb2.NetworkPolicy(egress=policy.egress, ingress_ports=accepted)
        egress = await resolve_peer_rules(
            self.records,
            tenant,
            sandbox_id,
            egress_rules(policy),
            field="network_policy",
            strict=True,
        )
        try:
            await self.runtime.update_egress(sandbox_id, egress)
        except RuntimeNotSupported as exc:
            raise OrchardError(Reason.UNIMPLEMENTED, str(exc)) from None
        except RuntimeFailure as exc:
            raise OrchardError(
                Reason.UNAVAILABLE,
                f"sandbox {sandbox_id!r}: the network policy was not applied: {exc.message}",
                metadata={"sandbox_id": sandbox_id},
            ) from None
        refused: list[SandboxRecord] = []

        def set_policy(r: SandboxRecord) -> bool:
            if r.state != READY:
                refused.append(r)
                return False
            r.sandbox.spec.network_policy.CopyFrom(policy)
            return True

        try:
            updated = await self._update(record.key, set_policy)
        except EtcdError as exc:
            raise store_unavailable(exc) from exc
        if updated is None:
            if refused:
                self._require_ready_for_policy(refused[0])
            raise not_found(sandbox_id)
        await self.fill_expire_time(updated)
        return updated

    @staticmethod
    def _require_ready_for_policy(record: SandboxRecord) -> None:
        if record.state != READY:
            state = env_pb2.SandboxState.Name(record.state).removeprefix("SANDBOX_STATE_")
            raise OrchardError(
                EnvReason.SANDBOX_NOT_READY,
                f"sandbox {record.id!r} is {state}: its network policy can change only while "
                "it is READY",
                metadata={"sandbox_id": record.id, "state": state},
            )

    # -- the agent ---------------------------------------------------------------------------

    async def agent(self, tenant: str, sandbox_id: str) -> AgentLink:
        """The link to a READY sandbox's agent; NOT_FOUND or FAILED_PRECONDITION otherwise."""
        return await self.router.agent(tenant, sandbox_id)

    def check_alive(self, tenant: str, sandbox_id: str) -> None:
        """After an agent did not answer: ask the runtime, and fail the record if it died."""
        self.creation.check_alive(tenant, sandbox_id)

    # -- reconcile -----------------------------------------------------------------------------

    async def reconcile(self) -> dict[str, int]:
        """Compare the runtime with the records once; returns what it did, by kind."""
        return await self.reconciler.reconcile()

    # -- told by the record store (RecordListener): hand each change to the parts ------------

    def record_changed(self, record: SandboxRecord, previous: SandboxRecord | None) -> None:
        if record.queued and (previous is None or not previous.queued):
            self.admission.wake()
        if record.state == READY and (previous is None or previous.state != READY):
            # Whichever replica made it, this one hears of its exit too (it may outlive that one).
            self.reconciler.spawn_adopt(record.id)
        if record.state in (FAILED, DELETING):
            self.router.drop(record.id)
            if record.state == DELETING:
                self.creation.cancel(record.id)

    def record_deleted(self, previous: SandboxRecord | None, tenant: str, sandbox_id: str) -> None:
        self.router.drop(sandbox_id)
        self.creation.cancel(sandbox_id)
        if previous is None or previous.state != DELETING:
            self.reconciler.spawn_reap(sandbox_id)
        if previous is not None and previous.queued:
            self.admission.wake()  # the positions behind it move up

    def slot_released(self) -> None:
        self.admission.wake()

    def creating_deleted(self, tenant: str, sandbox_id: str, replica: str) -> None:
        if replica == self.replica_id or self._closing:
            return
        record = self.records.cached(tenant, sandbox_id)
        if record is not None and record.state == PENDING and not record.queued:
            self.creation.spawn_take_over(tenant, sandbox_id)

    def resynced(self) -> None:
        self.admission.wake()
        for record in self.records.view.records.values():
            if record.state == READY:
                self.reconciler.spawn_adopt(record.id)
