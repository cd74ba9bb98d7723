"""Creations: writing new records, starting them in the runtime, and recording the outcome.

- **Create** writes, in one transaction, the record (PENDING, under a lease of the heartbeat
  timeout, or its owner's), the request-id key (same lease), the admission slots it takes and
  ``creating/<tenant>/<id>`` under this replica's own short lease; a task calls
  ``runtime.create`` and moves the record to READY (deleting the creating key in the same
  transaction) or FAILED. With admission full it is written ``queued`` instead, and the
  :class:`~orchard.env.admission.AdmissionQueue` starts it when a slot frees.
- **Fork**: records like any other, with ``forked_from`` set, written up to 48 to a
  transaction; their creation calls ``runtime.fork``.
- **Take-over**: a PENDING record whose creating replica is gone is claimed in a transaction
  and created again (after clearing what the dead one left); **repair** finishes or restarts a
  creation of this replica whose task ended.
- **etcd faults**: a creation whose runtime start is done retries recording READY (or FAILED)
  while etcd does not answer, and rolls back (deletes the runtime sandbox) only past a bound;
  an insert etcd did not answer is looked up once etcd is back and, if it was applied, its
  creation starts. A creation task that ends in an error is logged and repaired.
- **The replica lease**: creating keys live under it; a lost one is replaced and the creating
  keys of running creations are put back under the new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import random
import secrets
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import timestamp_pb2

from orchard.core.errors import OrchardError
from orchard.core.etcd import (
    Compare,
    CompareOp,
    DeleteOp,
    EtcdError,
    EtcdStore,
    EtcdUnavailable,
    GetOp,
    Lease,
    LeaseKeepAlive,
    LeaseNotFound,
    PutOp,
    RangeResult,
)
from orchard.env.admission import AdmissionQueue, next_rounds
from orchard.env.config import EnvConfig
from orchard.env.exec_lane import LaneClient
from orchard.env.exec_router import ExecRouter
from orchard.env.metrics import EnvMetrics
from orchard.env.owners import OwnerRegistry, owner_not_found
from orchard.env.peers import peer_of, resolve_peer_rules
from orchard.env.reasons import EnvReason
from orchard.env.record_store import RecordStore, not_found, store_unavailable
from orchard.env.records import (
    REPLICAS,
    SandboxRecord,
    creating_key,
    request_key,
    sandbox_key,
)
from orchard.env.runtime.base import (
    AgentUnreachable,
    EgressRule,
    FailureReason,
    Runtime,
    RuntimeFailure,
    RuntimeNotSupported,
    RuntimeResources,
    RuntimeSandbox,
    RuntimeSandboxSpec,
    SandboxStatus,
)
from orchard.env.sealing import SealedValueUnreadable, SpecSealer
from orchard.env.tasks import BackgroundTasks
from orchard.env.v1 import env_pb2
from orchard.env.validation import ImagePolicy, heartbeat_timeout_s
from orchard.inagent.v1 import inagent_service_pb2, inagent_service_pb2_grpc

__all__ = ["CreationWorker", "egress_rules", "new_sandbox_id", "retrying"]

log = logging.getLogger(__name__)

PENDING = env_pb2.SANDBOX_STATE_PENDING
READY = env_pb2.SANDBOX_STATE_READY
FAILED = env_pb2.SANDBOX_STATE_FAILED
_FORKS_PER_TXN = 48  # two operations each (record, creating key), under etcd's 128
# How long a finished creation keeps retrying to record its outcome while etcd is away before
# it rolls back (etcd renews every lease when it comes back, so records outlive an outage).
_SETTLE_RETRY_S = 120.0
_RETRY_DELAYS_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
_AGENT_PROBE_S = 2.0


def new_sandbox_id() -> str:
    return "sbx-" + secrets.token_hex(6)


def _now() -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.GetCurrentTime()
    return stamp


class CreationWorker:
    """The creations of one replica, from the record's insert to READY or FAILED."""

    def __init__(
        self,
        store: EtcdStore,
        records: RecordStore,
        runtime: Runtime,
        config: EnvConfig,
        metrics: EnvMetrics,
        *,
        router: ExecRouter,
        owners: OwnerRegistry,
        images: ImagePolicy,
        sealer: SpecSealer,
        replica_id: str,
    ) -> None:
        self.store = store
        self.records = records
        self.runtime = runtime
        self.config = config
        self.metrics = metrics
        self.router = router
        self.owners = owners
        self.images = images
        self.sealer = sealer
        self.replica_id = replica_id
        self._replica_lease: Lease | None = None
        self._keepalive: LeaseKeepAlive | None = None
        self._creations: dict[str, asyncio.Task[None]] = {}  # sandbox id → creation task
        # Records written (or maybe written: etcd did not answer) whose creation is not started.
        self._inserting: set[str] = set()
        # What runtime.create returned, until the record says READY (or is rolled back).
        self._made: dict[str, RuntimeSandbox] = {}
        self._tasks = BackgroundTasks()
        self._create_slots = asyncio.Semaphore(config.max_concurrent_creates)
        self._closing = False
        self.admission = AdmissionQueue(
            store,
            config.admission,
            queued=self._queued,
            start_creation=lambda record: self.start_creation(record, time.monotonic()),
            replica_lease=self._replica_lease_id,
            replica_id=replica_id,
        )

    async def start(self) -> None:
        """Take this replica's lease (creating keys go under it)."""
        self._replica_lease = await self.store.grant_lease(self.config.replica_ttl_s)
        self._keepalive = self.store.keep_alive(self._replica_lease)
        await self.store.put(
            f"{REPLICAS}{self.replica_id}",
            json.dumps({"started": time.time(), "runtime": self.runtime.name}),
            lease=self._replica_lease,
        )
        self._tasks.start(self._watch_replica_lease(), "replica-lease")

    def start_admission(self) -> None:
        self.admission.start()

    async def close(self) -> None:
        """Cancel the creations in flight (the runtime releases what they made; their records
        stay PENDING for a take-over) and give up the replica lease."""
        self._closing = True
        await self.admission.close()
        creations = list(self._creations.values())
        for task in creations:
            task.cancel()
        await asyncio.gather(*creations, return_exceptions=True)
        await self._tasks.close()
        if self._replica_lease is not None:
            with contextlib.suppress(EtcdError):
                await self.store.revoke_lease(self._replica_lease)

    @property
    def running(self) -> dict[str, asyncio.Task[None]]:
        """The creation tasks running here, by sandbox id."""
        return self._creations

    @property
    def replica_lease(self) -> Lease | None:
        return self._replica_lease

    def cancel(self, sandbox_id: str) -> asyncio.Task[None] | None:
        """Cancel the creation of ``sandbox_id`` running here (if any); returns its task."""
        creation = self._creations.get(sandbox_id)
        if creation is not None:
            creation.cancel()
        return creation

    def _spawn(self, coro: Any, name: str) -> None:
        self._tasks.spawn(coro, name)

    def spawn_take_over(self, tenant: str, sandbox_id: str) -> None:
        self._spawn(self.take_over(tenant, sandbox_id), f"take-over-{sandbox_id}")

    def check_alive(self, tenant: str, sandbox_id: str) -> None:
        """After an agent did not answer: ask the runtime, and fail the record if it died."""
        self._spawn(self._check_alive(tenant, sandbox_id), f"check-{sandbox_id}")

    async def _check_alive(self, tenant: str, sandbox_id: str) -> None:
        reason = await self.router.dead_reason(sandbox_id)
        if reason is not None:
            await self.fail(tenant, sandbox_id, *reason)

    def _replica_lease_id(self) -> int:
        assert self._replica_lease is not None
        return self._replica_lease.id

    def _queued(self) -> list[SandboxRecord]:
        return list(self.records.view.queued.values())

    async def _watch_replica_lease(self) -> None:
        """While this replica runs it holds a lease: one lost (etcd away, or this process too
        busy to refresh it within ``replica_ttl_s``) is replaced, or every later creation
        would fail on a lease that no longer exists."""
        while True:
            assert self._keepalive is not None
            with contextlib.suppress(EtcdError):
                await self._keepalive.wait()
            if self._closing:
                return
            log.error("this replica's lease was lost; taking a new one")
            await self._renew_replica_lease()

    async def _renew_replica_lease(self) -> None:
        delays = iter(_RETRY_DELAYS_S)
        while not self._closing:
            try:
                lease = await self.store.grant_lease(self.config.replica_ttl_s)
                await self.store.put(
                    f"{REPLICAS}{self.replica_id}",
                    json.dumps({"started": time.time(), "runtime": self.runtime.name}),
                    lease=lease,
                )
                self._replica_lease, self._keepalive = lease, self.store.keep_alive(lease)
                kept, lost = await self._reclaim_creations(lease)
            except (EtcdError, LeaseNotFound) as exc:
                log.warning("could not renew this replica's lease yet: %s", exc)
                await asyncio.sleep(next(delays, _RETRY_DELAYS_S[-1]))
                continue
            log.info("replica lease renewed", extra={"creations_kept": kept, "lost": lost})
            return

    async def _reclaim_creations(self, lease: Lease) -> tuple[int, int]:
        """Put the creating keys of this replica's running creations back under ``lease``; a
        creation another replica claimed meanwhile is cancelled here (that one makes it)."""
        kept = lost = 0
        for sandbox_id, task in list(self._creations.items()):
            record = self.records.cached_by_id(sandbox_id)
            if record is None or task.done():
                continue
            ckey = creating_key(record.tenant, sandbox_id)
            result = await self.store.txn(
                [Compare.create_revision(ckey, CompareOp.EQUAL, 0)],
                [PutOp.of(ckey, self.replica_id, lease.id)],
                [GetOp.of(ckey)],
            )
            found = result.results[0] if result.results else None
            holder = self.replica_id if result.succeeded else ""
            if isinstance(found, RangeResult) and found.kvs:
                holder = found.kvs[0].value.decode()
            if holder == self.replica_id:
                kept += 1
            else:
                lost += 1
                task.cancel()
        return kept, lost

    async def _sandbox_by_id(self, tenant: str, sandbox_id: str) -> SandboxRecord | None:
        """The record with its expiry, or None (gone, or etcd did not answer)."""
        with contextlib.suppress(EtcdError):
            record = await self.records.read(tenant, sandbox_id)
            if record is not None:
                await self.records.fill_expire_time(record)
            return record
        return None

    async def create(
        self, tenant: str, spec: env_pb2.SandboxSpec, ttl_s: int, request_id: str
    ) -> SandboxRecord:
        """Write a new PENDING record and start it, or queue it when admission is full.

        With ``spec.owner_id`` the record lives under the owner's lease (NOT_FOUND when the
        owner is unknown, another tenant's or expired)."""
        assert self._replica_lease is not None
        started = time.monotonic()
        rkey = request_key(tenant, request_id) if request_id else ""
        by_request = functools.partial(self._sandbox_by_id, tenant)
        try:
            existing = await self.records.requests.seen(rkey, by_request)
            if existing is not None:
                return existing
            lease_id, lease_ttl, own_lease = await self._new_lease(tenant, spec, ttl_s)
            sandbox = env_pb2.Sandbox(
                id=new_sandbox_id(),
                tenant=tenant,
                spec=spec,
                state=PENDING,
                runtime=self.runtime.name,
                create_time=_now(),
            )
            self.sealer.seal_env(sandbox.spec)
            record = SandboxRecord(sandbox, request_key=rkey)
            slots: list[str] | None = []
            if self.admission.enabled:
                slots = await self.admission.reserve(sandbox)
            for _ in range(2):
                if slots is None:
                    self._check_queue_room(1, [lease_id] if own_lease else [])
                    waiting = self._queued()
                    record.queued = True
                    record.queue_round = next_rounds(waiting, tenant, 1)[0]
                    sandbox.queue_position = len(waiting) + 1
                result = await self._insert([(record, lease_id)], rkey, slots or [])
                if result.succeeded:
                    break
                existing = await self.records.requests.holder(rkey, by_request)
                if existing is not None or slots is None:
                    # A concurrent retry with the same request id won.
                    if own_lease:
                        await self._revoke_quietly(lease_id)
                    return self.records.requests.raced(existing)
                slots = None  # another creation took the free slot first: queue
        except LeaseNotFound:
            raise owner_not_found(spec.owner_id) from None
        except EtcdError as exc:
            raise store_unavailable(exc) from exc
        record.mod_revision = result.revision
        record.lease = lease_id
        self.records.leases.note(lease_id, lease_ttl)
        self.records.offer(record)
        record.sandbox.expire_time.FromSeconds(int(time.time()) + lease_ttl)
        if record.queued:
            self.admission.wake()
        else:
            self.start_creation(record, started)
        self.metrics.create_seconds.observe(time.monotonic() - started)
        return record

    async def _new_lease(
        self, tenant: str, spec: env_pb2.SandboxSpec, ttl_s: int
    ) -> tuple[int, int, bool]:
        """The lease a new record goes under: ``(id, ttl, whether it is the record's own)``;
        the owner's when ``spec.owner_id`` is set."""
        if spec.owner_id:
            lease_id, ttl = await self.owners.lease(tenant, spec.owner_id)
            return lease_id, ttl, False
        lease = await self.store.grant_lease(ttl_s)
        return lease.id, lease.ttl, True

    def _check_queue_room(self, count: int, own_leases: list[int]) -> None:
        waiting = len(self._queued())
        if waiting + count <= self.config.admission.max_queued:
            return
        for lease_id in own_leases:
            # Nothing is attached yet; the lease would expire anyway.
            self._spawn(self._revoke_quietly(lease_id), f"revoke-{lease_id:x}")
        retry = self.config.admission.retry_after_s
        raise OrchardError(
            EnvReason.ADMISSION_QUEUE_FULL,
            f"the admission queue is full ({waiting} waiting, at most "
            f"{self.config.admission.max_queued}); nothing was created, retry in {retry:g} s",
            metadata={"retry_after_s": f"{retry:g}", "queued": str(waiting)},
        )

    async def _revoke_quietly(self, lease_id: int) -> None:
        with contextlib.suppress(EtcdError):
            await self.store.revoke_lease(lease_id)

    async def _insert(
        self,
        records: list[tuple[SandboxRecord, int]],
        rkey: str,
        slots: list[str],
        *,
        rvalue: str = "",
    ) -> Any:
        """Write new records (each under its lease) in one transaction, guarded by the request
        key being absent; ``slots`` (compared absent) go to the first record. Records not
        queued get a creating key of this replica."""
        assert self._replica_lease is not None
        compare: list[Compare] = []
        ops: list[Any] = []
        for record, lease_id in records:
            first = record is records[0][0]
            record.slots = tuple(slots) if first and not record.queued else ()
            if not record.queued:
                ops.append(
                    PutOp.of(
                        creating_key(record.tenant, record.id),
                        self.replica_id,
                        self._replica_lease.id,
                    )
                )
            ops.append(PutOp.of(record.key, record.encode(), lease_id))
        if slots and not records[0][0].queued:
            slot_compare, slot_puts = self.admission.slot_ops(
                records[0][0].id, slots, records[0][1]
            )
            compare += slot_compare
            ops += slot_puts
        guard, request_put = self.records.requests.guard(
            rkey, rvalue or records[0][0].id, records[0][1]
        )
        compare += guard
        ops += request_put
        ids = [record.id for record, _ in records if not record.queued]
        self._inserting.update(ids)
        try:
            result = await self.store.txn(compare, ops)
        except EtcdUnavailable:
            # Applied or not, nobody knows: find out once etcd answers, and create what was.
            self._inserting.difference_update(ids)
            unsettled = [record for record, _ in records if not record.queued]
            if unsettled:
                self._spawn(self._recover_unanswered(unsettled), f"recover-{ids[0]}")
            raise
        except BaseException:
            self._inserting.difference_update(ids)
            raise
        if not result.succeeded:
            self._inserting.difference_update(ids)
        return result

    async def _recover_unanswered(self, records: list[SandboxRecord]) -> None:
        """Records whose insert got no answer: start the creation of each that exists."""
        deadline = time.monotonic() + _SETTLE_RETRY_S
        for record in records:
            kv = await retrying(functools.partial(self.store.get, record.key), deadline)
            if kv is not None:
                await self.repair(SandboxRecord.from_kv(kv))

    def start_creation(
        self,
        record: SandboxRecord,
        started: float,
        *,
        replace: bool = False,
        made: RuntimeSandbox | None = None,
    ) -> None:
        self._inserting.discard(record.id)
        task = asyncio.create_task(
            self._create_in_runtime(record, started, replace, made), name=f"create-{record.id}"
        )
        self._creations[record.id] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._creations.get(record.id) is t:
                del self._creations[record.id]
            if t.cancelled() or t.exception() is None or self._closing:
                return
            # A creation must never end silently: say so, and repair the record at once.
            log.error(
                "a creation task died; repairing its record",
                exc_info=t.exception(),
                extra={"sandbox_id": record.id},
            )
            self._spawn(self._repair_by_key(record.key), f"repair-{record.id}")

        task.add_done_callback(done)

    def runtime_spec(self, sandbox: env_pb2.Sandbox) -> RuntimeSandboxSpec:
        spec, limits = sandbox.spec, self.config.limits
        resources = RuntimeResources(
            cpu_millis=spec.resources.cpu_millis or limits.default_cpu_millis,
            memory_bytes=spec.resources.memory_bytes or limits.default_memory_bytes,
            pids=spec.resources.pids or limits.default_pids,
            disk_bytes=spec.resources.disk_bytes or limits.default_disk_bytes,
        )
        try:
            env = self.sealer.open_env(spec.env)
        except SealedValueUnreadable as exc:
            raise RuntimeFailure(FailureReason.INTERNAL, str(exc)) from None
        return RuntimeSandboxSpec(
            sandbox_id=sandbox.id,
            image=spec.image,
            resources=resources,
            env=env,
            working_dir=spec.working_dir or "/",
            egress=egress_rules(spec.network_policy),
            ingress_ports=tuple(spec.network_policy.ingress_ports),
            labels=dict(spec.labels),
            owner=spec.owner_id,
            raw_sockets=spec.privileges.raw_sockets,
            user_namespaces=spec.privileges.user_namespaces,
            image_trust=self.images.trust(sandbox.tenant),
            # Over a lane, this service starts the agent's gRPC server when it first needs it.
            agent_grpc_on_demand=self.config.exec_lane,
        )

    async def _create_in_runtime(
        self, record: SandboxRecord, started: float, replace: bool, made: RuntimeSandbox | None
    ) -> None:
        sid, tenant = record.id, record.tenant
        ckey = creating_key(tenant, sid)
        failure: tuple[str, str] | None = None
        if made is None:
            async with self._create_slots:
                if replace:
                    # A replica died while creating it: clear whatever it left first.
                    await self.runtime.delete(sid)
                try:
                    spec = self.runtime_spec(record.sandbox)
                    if any(peer_of(rule.destination) for rule in spec.egress):
                        egress = await resolve_peer_rules(
                            self.records, tenant, sid, spec.egress, field="spec", strict=False
                        )
                        spec = dataclasses.replace(spec, egress=egress)
                    source = record.sandbox.forked_from
                    made = await (
                        self.runtime.fork(source, spec) if source else self.runtime.create(spec)
                    )
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None and not task.cancelling():
                        # A gRPC call inside the runtime cut off under it, not our cancel.
                        log.warning("runtime.create was cut off", extra={"sandbox_id": sid})
                        failure = FailureReason.INTERNAL.value, "the runtime start was cut off"
                    else:
                        if not self._closing:
                            with contextlib.suppress(EtcdError):
                                await self.store.delete(ckey)
                        raise
                except RuntimeFailure as exc:
                    failure = exc.reason.value, exc.message
                except RuntimeNotSupported as exc:
                    failure = FailureReason.INTERNAL.value, str(exc)
                except Exception as exc:
                    log.exception("runtime.create failed", extra={"sandbox_id": sid})
                    failure = FailureReason.INTERNAL.value, f"runtime error: {exc}"
        if made is None:
            reason, message = failure or (FailureReason.INTERNAL.value, "no sandbox was made")
            await self.fail(
                tenant,
                sid,
                reason,
                message,
                extra_ops=[DeleteOp.of(ckey)],
                retry_s=_SETTLE_RETRY_S,
            )
            await self._drop_creating(ckey)
            return
        self._made[sid] = made
        try:
            await self._settle_ready(record, made, started)
        except asyncio.CancelledError:
            self._made.pop(sid, None)
            if not self._closing:
                await self.runtime.delete(sid)
            raise
        self._made.pop(sid, None)

    async def _settle_ready(
        self, record: SandboxRecord, made: RuntimeSandbox, started: float
    ) -> None:
        """Record READY for what the runtime made, retrying while etcd is away; roll back
        (delete the runtime sandbox, record FAILED) when the record is gone or no longer
        PENDING, or etcd stays away past the retry bound."""
        sid, key, ckey = record.id, record.key, creating_key(record.tenant, record.id)
        version = made.agent_version or await self._agent_version(sid, made)
        recorded: list[bool] = []

        def to_ready(r: SandboxRecord) -> bool:
            if r.state == READY and r.agent_address == made.agent_address:
                recorded.append(True)  # an earlier attempt was applied; its answer was lost
                return False
            if r.state != PENDING:
                return False
            r.sandbox.state = READY
            r.sandbox.ready_time.CopyFrom(_now())
            r.sandbox.agent_version = version
            r.sandbox.network_address = made.network_address
            r.agent_address = made.agent_address
            r.lane_address = made.lane_address
            return True

        deadline = time.monotonic() + _SETTLE_RETRY_S
        try:
            updated = await retrying(
                lambda: self._update(key, to_ready, extra_ops=[DeleteOp.of(ckey)]), deadline
            )
        except EtcdError:
            log.exception("could not record READY; rolling back", extra={"sandbox_id": sid})
            await self.runtime.delete(sid)
            await self.fail(
                record.tenant,
                sid,
                FailureReason.INTERNAL.value,
                "the state store did not answer when the sandbox became ready",
                extra_ops=[DeleteOp.of(ckey)],
            )
            return
        if updated is None and not recorded:
            # Deleted, reaped or failed meanwhile: what we made must not outlive it.
            await self.runtime.delete(sid)
            await self._drop_creating(ckey)
            return
        self.metrics.ready_seconds.observe(time.monotonic() - started)

    async def _agent_version(self, sandbox_id: str, made: RuntimeSandbox) -> str:
        """The version the sandbox's agent reports ("" when it does not answer)."""
        info = await self._agent_info(sandbox_id, made)
        return str(info.version) if info is not None else ""

    async def _agent_info(self, sandbox_id: str, made: RuntimeSandbox) -> Any:
        """The agent's GetAgentInfo answer; None when it does not answer in time or what
        serves at its addresses is not the agent the runtime started. An agent with a lane is
        first asked over it to start its gRPC server (it may have started without)."""
        address, lane_address = made.agent_address, made.lane_address
        try:
            if lane_address and self.config.exec_lane:
                if not await self.runtime.verify_agent(sandbox_id, lane_address):
                    return None
                lane = LaneClient(lane_address)
                try:
                    await lane.open_grpc(_AGENT_PROBE_S)
                finally:
                    lane.close()
            if not await self.runtime.verify_agent(sandbox_id, address):
                return None
            async with grpc.aio.insecure_channel(address) as channel:
                stub = inagent_service_pb2_grpc.AgentServiceStub(channel)
                return await stub.GetAgentInfo(
                    inagent_service_pb2.GetAgentInfoRequest(), timeout=_AGENT_PROBE_S
                )
        except (grpc.aio.AioRpcError, AgentUnreachable):
            return None

    async def _repair_by_key(self, key: str) -> None:
        await asyncio.sleep(0.1)  # let a failing path settle before looking again
        kv = await retrying(lambda: self.store.get(key), time.monotonic() + _SETTLE_RETRY_S)
        if kv is not None:
            await self.repair(SandboxRecord.from_kv(kv))

    async def repair(self, record: SandboxRecord) -> bool:
        """A PENDING record this replica is creating, with no creation running here (its task
        died, or its insert went unanswered): finish it to READY when what the runtime made is
        alive and its agent answers, else create it again. Returns whether it acted."""
        sid = record.id
        if (
            record.state != PENDING
            or record.queued
            or sid in self._creations
            or sid in self._inserting
            or self._closing
        ):
            return False
        owner = await self.store.get(creating_key(record.tenant, sid))
        if owner is None or owner.value_str != self.replica_id:
            return False
        made = self._made.pop(sid, None)
        if (
            made is not None
            and await self.runtime.status(sid) is SandboxStatus.RUNNING
            and await self._agent_info(sid, made) is not None
        ):
            log.info("finishing a creation whose task ended", extra={"sandbox_id": sid})
            self.start_creation(record, time.monotonic(), made=made)
        else:
            log.info("creating again a sandbox whose creation ended", extra={"sandbox_id": sid})
            self.start_creation(record, time.monotonic(), replace=True)
        return True

    async def _drop_creating(self, ckey: str) -> None:
        with contextlib.suppress(EtcdError):
            await self.store.delete(ckey)

    async def _update(
        self,
        key: str,
        mutate: Callable[[SandboxRecord], bool],
        *,
        extra_ops: list[Any] | None = None,
    ) -> SandboxRecord | None:
        """Compare-and-swap a record, keeping its lease; None when it is gone or ``mutate``
        declines (returns False)."""
        return await self.records.update(key, mutate, extra_ops=extra_ops)

    async def fail(
        self,
        tenant: str,
        sandbox_id: str,
        reason: str,
        message: str,
        *,
        extra_ops: list[Any] | None = None,
        retry_s: float = 0.0,
    ) -> bool:
        """PENDING/READY → FAILED with a reason, then release the runtime's resources.

        ``retry_s`` > 0: keep trying that long while etcd does not answer."""

        held: list[str] = []

        def to_failed(r: SandboxRecord) -> bool:
            if r.state not in (PENDING, READY):
                return False
            r.sandbox.state = FAILED
            r.sandbox.failure.reason = reason
            r.sandbox.failure.message = message
            r.sandbox.queue_position = 0
            r.queued = False
            held[:] = r.slots
            r.slots = ()
            return True

        key = sandbox_key(tenant, sandbox_id)
        try:
            updated = await retrying(
                lambda: self._update(key, to_failed, extra_ops=extra_ops),
                time.monotonic() + retry_s,
            )
        except EtcdError:
            log.exception("could not record FAILED", extra={"sandbox_id": sandbox_id})
            return False
        if updated is not None:
            self.metrics.failed.labels(reason=reason).inc()
            log.info("sandbox failed", extra={"sandbox_id": sandbox_id, "reason": reason})
            if held:
                await self.admission.release(sandbox_id, held)
        self.router.drop(sandbox_id)
        await self.runtime.delete(sandbox_id)
        return updated is not None

    def check_privileges(self, tenant: str, spec: env_pb2.SandboxSpec, field: str) -> None:
        """PERMISSION_DENIED (PRIVILEGE_NOT_ALLOWED) when ``spec`` asks for a privilege the
        operator's ``privileges`` settings do not give ``tenant``."""
        refused = self.config.privileges.refused(
            tenant, spec.privileges.raw_sockets, spec.privileges.user_namespaces
        )
        if refused:
            raise OrchardError(
                EnvReason.PRIVILEGE_NOT_ALLOWED,
                f"{field}: {', '.join(refused)} not allowed to tenant {tenant!r}; the "
                "operator allows them in orchard-env's `privileges` settings",
            )

    async def fork(
        self,
        tenant: str,
        source_id: str,
        count: int,
        labels: dict[str, str],
        request_id: str,
    ) -> list[SandboxRecord]:
        """``count`` new records copying a READY sandbox's spec (labels merged), each with
        ``forked_from`` set and a lease of its own (or the source's owner's); they go through
        admission like creations."""
        assert self._replica_lease is not None
        started = time.monotonic()
        # Its own hash input: a fork's request id never meets a create's.
        rkey = request_key(tenant, "\0fork\0" + request_id) if request_id else ""
        by_request = functools.partial(self._forks_by_ids, tenant)
        try:
            existing = await self.records.requests.seen(rkey, by_request)
            if existing is not None:
                return existing
            source = await self.records.read(tenant, source_id)
            if source is None:
                raise not_found(source_id)
            if source.state != READY:
                state = env_pb2.SandboxState.Name(source.state).removeprefix("SANDBOX_STATE_")
                raise OrchardError(
                    EnvReason.SANDBOX_NOT_READY,
                    f"sandbox {source_id!r} is {state}: only a READY sandbox can be forked",
                    metadata={"sandbox_id": source_id, "state": state},
                )
            spec = env_pb2.SandboxSpec()
            spec.CopyFrom(source.sandbox.spec)
            spec.labels.update(labels)
            # The settings may have changed since the source was made: forks meet today's.
            self.check_privileges(tenant, spec, f"sandbox {source_id!r}: spec.privileges")
            queued = self.admission.enabled
            if queued:
                self._check_queue_room(count, [])
            ttl_s = heartbeat_timeout_s(spec, self.config.limits)
            records: list[tuple[SandboxRecord, int]] = []
            own: list[int] = []
            waiting = self._queued()
            rounds = next_rounds(waiting, tenant, count)
            try:
                for i in range(count):
                    if spec.owner_id:
                        lease_id = source.lease
                    else:
                        lease = await self.store.grant_lease(ttl_s)
                        lease_id = lease.id
                        own.append(lease_id)
                        self.records.leases.note(lease_id, lease.ttl)
                    sandbox = env_pb2.Sandbox(
                        id=new_sandbox_id(),
                        tenant=tenant,
                        spec=spec,
                        state=PENDING,
                        runtime=self.runtime.name,
                        create_time=_now(),
                        forked_from=source_id,
                        queue_position=len(waiting) + i + 1 if queued else 0,
                    )
                    record = SandboxRecord(
                        sandbox,
                        request_key=rkey if i == 0 else "",
                        queued=queued,
                        queue_round=rounds[i],
                    )
                    records.append((record, lease_id))
                ids = json.dumps([record.id for record, _ in records])
                # etcd caps operations per transaction (128 by default): the first chunk carries
                # the request key, so a retry sees all or none of the forks of that chunk.
                for offset in range(0, count, _FORKS_PER_TXN):
                    chunk = records[offset : offset + _FORKS_PER_TXN]
                    result = await self._insert(chunk, rkey if offset == 0 else "", [], rvalue=ids)
                    if not result.succeeded:
                        for lease_id in own:
                            await self._revoke_quietly(lease_id)
                        found = await self.records.requests.holder(rkey, by_request)
                        return self.records.requests.raced(found)
                    for record, _ in chunk:
                        record.mod_revision = result.revision
            except BaseException:
                if not records or records[0][0].mod_revision == 0:
                    for lease_id in own:
                        await self._revoke_quietly(lease_id)
                raise
            finally:
                # Chunks written before a failure are repaired by reconcile, not left behind.
                self._inserting.difference_update(record.id for record, _ in records)
        except LeaseNotFound:
            raise not_found(source_id) from None
        except EtcdError as exc:
            raise store_unavailable(exc) from exc
        now = int(time.time())
        for record, lease_id in records:
            record.lease = lease_id
            self.records.offer(record)
            record.sandbox.expire_time.FromSeconds(now + ttl_s)
            if not queued:
                self.start_creation(record, started)
        if queued:
            self.admission.wake()
        return [record for record, _ in records]

    async def _forks_by_ids(self, tenant: str, ids: str) -> list[SandboxRecord]:
        """The forks a request made (``ids``: their ids as a JSON list) that still exist."""
        found = []
        for sandbox_id in json.loads(ids):
            record = await self._sandbox_by_id(tenant, sandbox_id)
            if record is not None:
                found.append(record)
        return found

    async def take_over(self, tenant: str, sandbox_id: str) -> bool:
        """Claim a PENDING sandbox whose creating replica is gone, and create it again."""
        assert self._replica_lease is not None
        key, ckey = sandbox_key(tenant, sandbox_id), creating_key(tenant, sandbox_id)
        try:
            kv = await self.store.get(key)
            if kv is None:
                return False
            record = SandboxRecord.from_kv(kv)
            if record.state != PENDING or record.queued:
                return False
            record.adopted_by = self.replica_id
            result = await self.store.txn(
                [
                    Compare.create_revision(ckey, CompareOp.EQUAL, 0),
                    Compare.mod_revision(key, CompareOp.EQUAL, kv.mod_revision),
                ],
                [
                    PutOp.of(key, record.encode(), kv.lease),
                    PutOp.of(ckey, self.replica_id, self._replica_lease.id),
                ],
            )
        except (EtcdError, LeaseNotFound):
            return False
        if not result.succeeded:
            return False
        log.info("taking over a creation", extra={"sandbox_id": sandbox_id})
        record.mod_revision = result.revision
        self.start_creation(record, time.monotonic(), replace=True)
        return True


async def retrying(call: Callable[[], Any], deadline: float) -> Any:
    """Await ``call()`` again, with growing delays, while etcd is unavailable and the deadline
    has not passed; raises the last error then (a mutation retried must be a compare-and-swap)."""
    attempt = 0
    while True:
        try:
            return await call()
        except EtcdUnavailable as exc:
            delay = _RETRY_DELAYS_S[min(attempt, len(_RETRY_DELAYS_S) - 1)]
            if time.monotonic() + delay > deadline:
                raise
            if attempt == 0:
                log.warning("the state store did not answer; retrying: %s", exc)
            attempt += 1
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))


def egress_rules(policy: env_pb2.NetworkPolicy) -> tuple[EgressRule, ...]:
    protocols = {env_pb2.PROTOCOL_TCP: "tcp", env_pb2.PROTOCOL_UDP: "udp"}
    return tuple(
        EgressRule(
            destination=rule.destination,
            ports=tuple(rule.ports),
            protocol=protocols.get(rule.protocol, ""),
            expire_unix_s=rule.expire_time.ToNanoseconds() / 1e9
            if rule.HasField("expire_time")
            else None,
        )
        for rule in policy.egress
    )
