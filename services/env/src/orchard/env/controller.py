"""Sandbox lifecycle over etcd records and a runtime: create, wait, delete, heartbeat, reap,
reconcile. Every replica runs one :class:`SandboxController` on the same store.

How the pieces fit:

- **Create** writes, in one transaction, the record (PENDING, under a lease of the heartbeat
  timeout), the request-id key (same lease) and ``creating/<tenant>/<id>`` under this replica's
  own short lease; a background task calls ``runtime.create`` and moves the record to READY
  (deleting the creating key in the same transaction) or FAILED.
- **Wait** registers with the process's one :class:`RecordWatcher` and re-reads the record on
  each change of its key: no polling.
- **Delete** marks the record DELETING, cancels a creation this replica runs, calls
  ``runtime.delete`` and removes the keys. A replica running the creation of a record that
  turns DELETING cancels it; one that finishes a creation and finds the record no longer
  PENDING deletes what it made.
- **Reaping**: when a record disappears and it was not DELETING (its lease expired), every
  replica calls ``runtime.delete``; the one that still found resources counts the reap.
- **Take-over**: a creating key vanishing while its record is still PENDING means its replica
  died (its lease expired); the first replica to claim the key in a transaction starts the
  creation again after clearing what the dead one left.
- **Owners**: an owner is a lease of its own with an ``owners/`` record; sandboxes created
  with ``spec.owner_id`` put their record, request key and slots under the owner's lease, so
  one keep-alive keeps them all and a revoke (DeleteOwner) or an expiry deletes every record
  at once; the usual reaping releases the runtime's resources.
- **Admission** (:mod:`orchard.env.admission`): with limits configured, a creation takes its
  slot keys in its creation transaction, or waits in the queue (``queued`` records) until a
  replica admits it.
- **Fork**: forks are records like any other, with ``forked_from`` set; their creation calls
  ``runtime.fork`` instead of ``runtime.create``.
- **Reconcile** (at start and every ``reconcile_interval_s``): runtime sandboxes without a
  record are deleted; READY records whose runtime sandbox is gone or exited become FAILED;
  PENDING records without a creating key are taken over, and those behind this replica's own
  creating key with no creation running here are finished or created again (repaired).
  ``runtime.exits()`` events make records FAILED as they happen; every replica asks the
  runtime to ``adopt`` each READY sandbox, so the exit is seen even when the replica that
  made it is gone.
- **etcd faults**: a creation whose runtime start is done retries recording READY (or
  FAILED) while etcd does not answer, and rolls back (deletes the runtime sandbox) only past
  a bound; an insert etcd did not answer is looked up once etcd is back and, if it was
  applied, its creation starts. A creation task that ends in an error is logged and repaired.

Replicas must see one runtime (the same host for ``local``, the same cluster for
``kubernetes``): any replica may delete, status or reconcile any sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from orchard.core.errors import OrchardError, Reason
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
from orchard.env.agents import AgentLink, AgentLinks
from orchard.env.config import EnvConfig
from orchard.env.metrics import EnvMetrics
from orchard.env.reasons import EnvReason
from orchard.env.record_watch import RecordWatcher
from orchard.env.records import (
    CREATING,
    REPLICAS,
    SANDBOXES,
    OwnerRecord,
    SandboxRecord,
    creating_key,
    owner_key,
    owner_request_key,
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
from orchard.env.v1 import env_pb2
from orchard.env.validation import ImagePolicy, heartbeat_timeout_s
from orchard.inagent.v1 import inagent_service_pb2, inagent_service_pb2_grpc

__all__ = ["SandboxController"]

log = logging.getLogger(__name__)

PENDING = env_pb2.SANDBOX_STATE_PENDING
READY = env_pb2.SANDBOX_STATE_READY
FAILED = env_pb2.SANDBOX_STATE_FAILED
DELETING = env_pb2.SANDBOX_STATE_DELETING
_SETTLED = (READY, FAILED)
_FORKS_PER_TXN = 48  # two operations each (record, creating key), under etcd's 128
# How long a finished creation keeps retrying to record its outcome while etcd is away before
# it rolls back (etcd renews every lease when it comes back, so records outlive an outage).
_SETTLE_RETRY_S = 120.0
_RETRY_DELAYS_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
_AGENT_PROBE_S = 2.0


def new_sandbox_id() -> str:
    return "sbx-" + secrets.token_hex(6)


def new_owner_id() -> str:
    return "own-" + secrets.token_hex(6)


def _now() -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.GetCurrentTime()
    return stamp


def _store_unavailable(exc: EtcdError) -> OrchardError:
    return OrchardError(EnvReason.STATE_STORE_UNAVAILABLE, f"state store unavailable: {exc}")


def owner_not_found(owner_id: str) -> OrchardError:
    return OrchardError(
        EnvReason.OWNER_NOT_FOUND,
        f"no owner {owner_id!r} (unknown, another tenant's, or its lease expired)",
        metadata={"owner_id": owner_id},
    )


def not_found(sandbox_id: str) -> OrchardError:
    return OrchardError(
        EnvReason.SANDBOX_NOT_FOUND,
        f"no sandbox {sandbox_id!r}",
        metadata={"sandbox_id": sandbox_id},
    )


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
        self.watcher = RecordWatcher(store, self)
        self.agents = AgentLinks(verify=runtime.verify_agent)
        self.images = ImagePolicy(
            config.images, runtime.private_paths(), service_paths=(config.secrets.key_file,)
        )
        # spec.env values stay sealed in every record; opened for the runtime and the tenant.
        self.sealer = SpecSealer.from_config(config.secrets)
        self._replica_lease: Lease | None = None
        self._keepalive: LeaseKeepAlive | None = None
        self._creations: dict[str, asyncio.Task[None]] = {}  # sandbox id → creation task
        # Records written (or maybe written: etcd did not answer) whose creation is not started.
        self._inserting: set[str] = set()
        # What runtime.create returned, until the record says READY (or is rolled back).
        self._made: dict[str, RuntimeSandbox] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._background: list[asyncio.Task[None]] = []
        self._create_slots = asyncio.Semaphore(config.max_concurrent_creates)
        self._closing = False
        self.admission = AdmissionQueue(
            store,
            config.admission,
            queued=self._queued,
            start_creation=lambda record: self._start_creation(record, time.monotonic()),
            replica_lease=self._replica_lease_id,
            replica_id=self.replica_id,
        )

    def _replica_lease_id(self) -> int:
        assert self._replica_lease is not None
        return self._replica_lease.id

    def _queued(self) -> list[SandboxRecord]:
        return [r for r in self.watcher.records.values() if r.queued and r.state == PENDING]

    # -- lifecycle of the controller ----------------------------------------------------------

    async def start(self) -> None:
        await self.sealer.claim(self.store)
        self._replica_lease = await self.store.grant_lease(self.config.replica_ttl_s)
        self._keepalive = self.store.keep_alive(self._replica_lease)
        await self.store.put(
            f"{REPLICAS}{self.replica_id}",
            json.dumps({"started": time.time(), "runtime": self.runtime.name}),
            lease=self._replica_lease,
        )
        await self.watcher.start()
        await self.reconcile()
        self.admission.start()
        self._background = [
            asyncio.create_task(self._reconcile_loop(), name="reconcile"),
            asyncio.create_task(self._follow_exits(), name="runtime-exits"),
            asyncio.create_task(self._watch_replica_lease(), name="replica-lease"),
        ]
        for task in self._background:
            task.add_done_callback(_log_failure)
        log.info("controller started", extra={"replica": self.replica_id})

    async def close(self) -> None:
        """Stop background work. Creations in flight are cancelled (the runtime releases what
        they made); their records stay PENDING and another replica, or this one after a
        restart, takes them over once this replica's lease is gone."""
        self._closing = True
        await self.admission.close()
        for task in self._background:
            task.cancel()
        creations = list(self._creations.values())
        for task in creations:
            task.cancel()
        await asyncio.gather(*self._background, *creations, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.watcher.close()
        await self.agents.close()
        if self._replica_lease is not None:
            with contextlib.suppress(EtcdError):
                await self.store.revoke_lease(self._replica_lease)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)
        return task

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
        by_id = {record.id: record for record in self.watcher.records.values()}
        kept = lost = 0
        for sandbox_id, task in list(self._creations.items()):
            record = by_id.get(sandbox_id)
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

    # -- reads ---------------------------------------------------------------------------------

    async def get(self, tenant: str, sandbox_id: str, *, expire_time: bool = True) -> SandboxRecord:
        try:
            kv = await self.store.get(sandbox_key(tenant, sandbox_id))
        except EtcdError as exc:
            raise _store_unavailable(exc) from exc
        if kv is None:
            raise not_found(sandbox_id)
        record = SandboxRecord.from_kv(kv)
        if expire_time:
            await self.fill_expire_time(record)
        return record

    async def fill_expire_time(self, record: SandboxRecord) -> None:
        if not record.lease:
            return
        try:
            info = await self.store.lease_time_to_live(record.lease)
        except EtcdError:
            return
        if info is not None:
            record.sandbox.expire_time.FromSeconds(int(time.time()) + max(info.ttl, 0))

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
            raise _store_unavailable(exc) from exc

    # -- create --------------------------------------------------------------------------------

    async def create(
        self, tenant: str, spec: env_pb2.SandboxSpec, ttl_s: int, request_id: str
    ) -> SandboxRecord:
        """Write a new PENDING record and start it, or queue it when admission is full.

        With ``spec.owner_id`` the record lives under the owner's lease (NOT_FOUND when the
        owner is unknown, another tenant's or expired)."""
        assert self._replica_lease is not None
        started = time.monotonic()
        rkey = request_key(tenant, request_id) if request_id else ""
        try:
            if rkey:
                existing = await self._by_request(tenant, rkey)
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
                existing = await self._by_request(tenant, rkey) if rkey else None
                if existing is not None or slots is None:
                    # A concurrent retry with the same request id won.
                    if own_lease:
                        with contextlib.suppress(EtcdError):
                            await self.store.revoke_lease(lease_id)
                    if existing is None:
                        raise OrchardError(
                            Reason.ABORTED, "a retry with this request_id raced; retry"
                        )
                    return existing
                slots = None  # another creation took the free slot first: queue
        except LeaseNotFound:
            raise owner_not_found(spec.owner_id) from None
        except EtcdError as exc:
            raise _store_unavailable(exc) from exc
        record.mod_revision = result.revision
        record.lease = lease_id
        record.sandbox.expire_time.FromSeconds(int(time.time()) + lease_ttl)
        if record.queued:
            self.admission.wake()
        else:
            self._start_creation(record, started)
        self.metrics.create_seconds.observe(time.monotonic() - started)
        return record

    async def _new_lease(
        self, tenant: str, spec: env_pb2.SandboxSpec, ttl_s: int
    ) -> tuple[int, int, bool]:
        """The lease a new record goes under: ``(id, ttl, whether it is the record's own)``;
        the owner's when ``spec.owner_id`` is set."""
        if spec.owner_id:
            owner = await self.get_owner(tenant, spec.owner_id)
            info = await self.store.lease_time_to_live(owner.lease)
            if info is None:
                raise owner_not_found(spec.owner_id)
            return owner.lease, info.ttl, False
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
        if rkey:
            ops.append(PutOp.of(rkey, rvalue or records[0][0].id, records[0][1]))
            compare.append(Compare.create_revision(rkey, CompareOp.EQUAL, 0))
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
            kv = await _retrying(functools.partial(self.store.get, record.key), deadline)
            if kv is not None:
                await self._repair(SandboxRecord.from_kv(kv))

    async def _by_request(self, tenant: str, rkey: str) -> SandboxRecord | None:
        kv = await self.store.get(rkey)
        if kv is None:
            return None
        record_kv = await self.store.get(sandbox_key(tenant, kv.value_str))
        if record_kv is None:
            return None
        record = SandboxRecord.from_kv(record_kv)
        await self.fill_expire_time(record)
        return record

    def _start_creation(
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
            labels=dict(spec.labels),
            owner=spec.owner_id,
            raw_sockets=spec.privileges.raw_sockets,
            user_namespaces=spec.privileges.user_namespaces,
            image_trust=self.images.trust(sandbox.tenant),
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
        version = made.agent_version or await self._agent_version(sid, made.agent_address)
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
            r.agent_address = made.agent_address
            return True

        deadline = time.monotonic() + _SETTLE_RETRY_S
        try:
            updated = await _retrying(
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

    async def _agent_version(self, sandbox_id: str, address: str) -> str:
        """The version the sandbox's agent reports ("" when it does not answer)."""
        info = await self._agent_info(sandbox_id, address)
        return str(info.version) if info is not None else ""

    async def _agent_info(self, sandbox_id: str, address: str) -> Any:
        """The agent's GetAgentInfo answer; None when it does not answer in time or what
        serves at ``address`` is not the agent the runtime started."""
        try:
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
        kv = await _retrying(lambda: self.store.get(key), time.monotonic() + _SETTLE_RETRY_S)
        if kv is not None:
            await self._repair(SandboxRecord.from_kv(kv))

    async def _repair(self, record: SandboxRecord) -> bool:
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
            and await self._agent_info(sid, made.agent_address) is not None
        ):
            log.info("finishing a creation whose task ended", extra={"sandbox_id": sid})
            self._start_creation(record, time.monotonic(), made=made)
        else:
            log.info("creating again a sandbox whose creation ended", extra={"sandbox_id": sid})
            self._start_creation(record, time.monotonic(), replace=True)
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
        while True:
            kv = await self.store.get(key)
            if kv is None:
                return None
            record = SandboxRecord.from_kv(kv)
            if not mutate(record):
                return None
            try:
                result = await self.store.txn(
                    [Compare.mod_revision(key, CompareOp.EQUAL, kv.mod_revision)],
                    [PutOp.of(key, record.encode(), kv.lease), *(extra_ops or [])],
                )
            except LeaseNotFound:
                return None
            if result.succeeded:
                record.mod_revision = result.revision
                return record

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
            updated = await _retrying(
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
        self.agents.drop(sandbox_id)
        await self.runtime.delete(sandbox_id)
        return updated is not None

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
            raise _store_unavailable(exc) from exc
        return time.time() + ttl

    # -- fork --------------------------------------------------------------------------------

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
        try:
            if rkey:
                existing = await self._forks_by_request(tenant, rkey)
                if existing is not None:
                    return existing
            source = await self.get(tenant, source_id, expire_time=False)
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
                        existing = await self._forks_by_request(tenant, rkey)
                        if existing is None:
                            raise OrchardError(
                                Reason.ABORTED, "a retry with this request_id raced; retry"
                            )
                        return existing
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
            raise _store_unavailable(exc) from exc
        now = int(time.time())
        for record, lease_id in records:
            record.lease = lease_id
            record.sandbox.expire_time.FromSeconds(now + ttl_s)
            if not queued:
                self._start_creation(record, started)
        if queued:
            self.admission.wake()
        return [record for record, _ in records]

    async def _forks_by_request(self, tenant: str, rkey: str) -> list[SandboxRecord] | None:
        kv = await self.store.get(rkey)
        if kv is None:
            return None
        found = []
        for sandbox_id in json.loads(kv.value_str):
            record_kv = await self.store.get(sandbox_key(tenant, sandbox_id))
            if record_kv is not None:
                record = SandboxRecord.from_kv(record_kv)
                await self.fill_expire_time(record)
                found.append(record)
        return found

    # -- owners ------------------------------------------------------------------------------

    async def create_owner(
        self, tenant: str, labels: dict[str, str], ttl_s: int, request_id: str
    ) -> OwnerRecord:
        """An owner record under a new lease of ``ttl_s``; a retry with the same request id
        returns the same owner."""
        rkey = owner_request_key(tenant, request_id) if request_id else ""
        try:
            if rkey:
                existing = await self._owner_by_request(tenant, rkey)
                if existing is not None:
                    return existing
            lease = await self.store.grant_lease(ttl_s)
            owner = env_pb2.Owner(id=new_owner_id(), tenant=tenant, labels=labels)
            owner.heartbeat_timeout.FromSeconds(ttl_s)
            record = OwnerRecord(owner, lease=lease.id)
            ops = [PutOp.of(record.key, record.encode(), lease.id)]
            compare = []
            if rkey:
                ops.append(PutOp.of(rkey, owner.id, lease.id))
                compare.append(Compare.create_revision(rkey, CompareOp.EQUAL, 0))
            result = await self.store.txn(compare, ops)
            if not result.succeeded:
                await self._revoke_quietly(lease.id)
                existing = await self._owner_by_request(tenant, rkey)
                if existing is None:
                    raise OrchardError(Reason.ABORTED, "a retry with this request_id raced; retry")
                return existing
        except EtcdError as exc:
            raise _store_unavailable(exc) from exc
        owner.expire_time.FromSeconds(int(time.time()) + lease.ttl)
        return record

    async def _owner_by_request(self, tenant: str, rkey: str) -> OwnerRecord | None:
        kv = await self.store.get(rkey)
        if kv is None:
            return None
        with contextlib.suppress(OrchardError):
            return await self.get_owner(tenant, kv.value_str)
        return None

    async def get_owner(self, tenant: str, owner_id: str) -> OwnerRecord:
        """An owner of ``tenant`` with its expiry; NOT_FOUND for another tenant's."""
        try:
            kv = await self.store.get(owner_key(tenant, owner_id))
            if kv is None:
                raise owner_not_found(owner_id)
            record = OwnerRecord.from_kv(kv)
            info = await self.store.lease_time_to_live(record.lease)
        except EtcdError as exc:
            raise _store_unavailable(exc) from exc
        if info is None:
            raise owner_not_found(owner_id)
        record.owner.expire_time.FromSeconds(int(time.time()) + max(info.ttl, 0))
        return record

    async def heartbeat_owner(self, tenant: str, owner_id: str) -> float:
        """Renew the owner's lease once (and with it every sandbox under it)."""
        try:
            kv = await self.store.get(owner_key(tenant, owner_id))
            if kv is None:
                raise owner_not_found(owner_id)
            ttl = await self.store.refresh_lease(kv.lease)
        except LeaseNotFound:
            raise owner_not_found(owner_id) from None
        except EtcdError as exc:
            raise _store_unavailable(exc) from exc
        return time.time() + ttl

    async def delete_owner(self, tenant: str, owner_id: str) -> int:
        """Revoke the owner's lease: its record and every sandbox record under it vanish in
        one step, and each replica's watch reaps them. Returns how many sandboxes it had."""
        try:
            kv = await self.store.get(owner_key(tenant, owner_id))
            if kv is None:
                return 0
            info = await self.store.lease_time_to_live(kv.lease, keys=True)
            if info is None:
                return 0
            count = sum(1 for key in info.keys if key.startswith(SANDBOXES.encode()))
            with contextlib.suppress(LeaseNotFound):
                await self.store.revoke_lease(kv.lease)
        except EtcdError as exc:
            raise _store_unavailable(exc) from exc
        log.info("owner deleted", extra={"owner_id": owner_id, "sandboxes": count})
        return count

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
            kv = await self.store.get(key)
            if kv is None:
                return
            record = SandboxRecord.from_kv(kv)
            await self._update(key, to_deleting)
        except EtcdError as exc:
            raise _store_unavailable(exc) from exc
        creation = self._creations.get(sandbox_id)
        if creation is not None:
            creation.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await creation
        self.agents.drop(sandbox_id)
        await self.runtime.delete(sandbox_id)
        ops = [DeleteOp.of(key), DeleteOp.of(creating_key(tenant, sandbox_id))]
        if record.request_key:
            ops.append(DeleteOp.of(record.request_key))
        try:
            await self.store.txn([], ops)
        except EtcdError as exc:
            raise _store_unavailable(exc) from exc
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
        try:
            await self.runtime.update_egress(sandbox_id, egress_rules(policy))
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
            raise _store_unavailable(exc) from exc
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
        """The link to a READY sandbox's agent; NOT_FOUND or FAILED_PRECONDITION otherwise.

        The watcher's mirror answers first; a miss (a sandbox this replica has not heard of
        yet) reads the store, so a sandbox READY anywhere is usable here at once.
        """
        record = self.watcher.records.get(sandbox_key(tenant, sandbox_id))
        if record is None or record.state != READY:
            record = await self.get(tenant, sandbox_id, expire_time=False)
        if record.state != READY:
            state = env_pb2.SandboxState.Name(record.state).removeprefix("SANDBOX_STATE_")
            message = f"sandbox {sandbox_id!r} is {state}, not READY"
            if record.state == FAILED:
                message += f" ({record.sandbox.failure.reason}: {record.sandbox.failure.message})"
            raise OrchardError(
                EnvReason.SANDBOX_NOT_READY,
                message,
                metadata={"sandbox_id": sandbox_id, "state": state},
            )
        return await self.agents.get(sandbox_id, record.agent_address)

    def check_alive(self, tenant: str, sandbox_id: str) -> None:
        """After an agent did not answer: ask the runtime, and fail the record if it died."""
        self._spawn(self._check_alive(tenant, sandbox_id), f"check-{sandbox_id}")

    async def _check_alive(self, tenant: str, sandbox_id: str) -> None:
        status = await self.runtime.status(sandbox_id)
        if status is not SandboxStatus.RUNNING:
            await self.fail(tenant, sandbox_id, *_dead_reason(status))

    # -- watcher events (RecordListener) -------------------------------------------------

    def record_changed(self, record: SandboxRecord, previous: SandboxRecord | None) -> None:
        if record.queued and (previous is None or not previous.queued):
            self.admission.wake()
        if record.state == READY and (previous is None or previous.state != READY):
            # Whichever replica made it, this one hears of its exit too (it may outlive that one).
            self._spawn(self._adopt(record.id), f"adopt-{record.id}")
        if record.state in (FAILED, DELETING):
            self.agents.drop(record.id)
            creation = self._creations.get(record.id)
            if creation is not None and record.state == DELETING:
                creation.cancel()
        self._count_states()

    def record_deleted(self, previous: SandboxRecord | None, tenant: str, sandbox_id: str) -> None:
        self.agents.drop(sandbox_id)
        creation = self._creations.get(sandbox_id)
        if creation is not None:
            creation.cancel()
        if previous is None or previous.state != DELETING:
            self._spawn(self._reap(sandbox_id), f"reap-{sandbox_id}")
        if previous is not None and previous.queued:
            self.admission.wake()  # the positions behind it move up
        self._count_states()

    def slot_released(self) -> None:
        self.admission.wake()

    def creating_deleted(self, tenant: str, sandbox_id: str, replica: str) -> None:
        if replica == self.replica_id or self._closing:
            return
        record = self.watcher.records.get(sandbox_key(tenant, sandbox_id))
        if record is not None and record.state == PENDING and not record.queued:
            self._spawn(self._take_over(tenant, sandbox_id), f"take-over-{sandbox_id}")

    def resynced(self) -> None:
        self.admission.wake()
        for record in self.watcher.records.values():
            if record.state == READY:
                self._spawn(self._adopt(record.id), f"adopt-{record.id}")
        self._count_states()

    async def _adopt(self, sandbox_id: str) -> None:
        """Have the runtime report this sandbox's exit, whichever replica started it."""
        try:
            await self.runtime.adopt(sandbox_id)
        except Exception:
            log.exception("could not watch a sandbox's exit", extra={"sandbox_id": sandbox_id})

    def _count_states(self) -> None:
        self.metrics.set_state_counts(r.state for r in self.watcher.records.values())

    async def _reap(self, sandbox_id: str) -> None:
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

    async def _take_over(self, tenant: str, sandbox_id: str) -> bool:
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
        self._start_creation(record, time.monotonic(), replace=True)
        return True

    # -- reconcile ---------------------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.reconcile_interval_s)
            self.admission.wake()
            try:
                await self.reconcile()
            except EtcdUnavailable as exc:
                log.warning("reconcile skipped: %s", exc)
            except Exception:
                log.exception("reconcile failed")

    async def reconcile(self) -> dict[str, int]:
        """Compare the runtime with the records once; returns what it did, by kind."""
        done = {"leftovers": 0, "failed": 0, "taken_over": 0, "repaired": 0}
        # The runtime first: a sandbox created after this has its record in the listing below.
        in_runtime = set(await self.runtime.list_sandboxes())
        listing = await self.store.list_prefix("")
        records: dict[str, SandboxRecord] = {}
        creating: dict[str, str] = {}  # sandbox id → the replica creating it
        for kv in listing.kvs:
            key = kv.key_str
            if key.startswith(SANDBOXES):
                record = SandboxRecord.from_kv(kv)
                records[record.id] = record
            elif key.startswith(CREATING):
                creating[key.rsplit("/", 1)[-1]] = kv.value_str
        for sandbox_id in sorted(in_runtime - records.keys()):
            if sandbox_id in self._creations:
                continue
            log.info("deleting a leftover runtime sandbox", extra={"sandbox_id": sandbox_id})
            await self.runtime.delete(sandbox_id)
            self.metrics.leftovers.inc()
            done["leftovers"] += 1
        for record in records.values():
            if record.state == READY:
                status = await self.runtime.status(record.id)
                if status is not SandboxStatus.RUNNING and await self.fail(
                    record.tenant, record.id, *_dead_reason(status)
                ):
                    done["failed"] += 1
                elif status is SandboxStatus.RUNNING:
                    await self._adopt(record.id)
            elif record.state != PENDING or record.queued:
                continue
            elif record.id not in creating:
                if await self._take_over(record.tenant, record.id):
                    done["taken_over"] += 1
            elif creating[record.id] == self.replica_id and await self._repair(record):
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
                        await self.fail(record.tenant, record.id, event.reason.value, event.message)
                    else:
                        await self.runtime.delete(event.sandbox_id)
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("runtime exit events failed; following again")
                await asyncio.sleep(1)

    def _find(self, sandbox_id: str) -> SandboxRecord | None:
        for record in self.watcher.records.values():
            if record.id == sandbox_id:
                return record
        return None


async def _retrying(call: Callable[[], Any], deadline: float) -> Any:
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


def _log_failure(task: asyncio.Task[Any]) -> None:
    """A background task must not end in an exception nobody sees."""
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s failed", task.get_name(), exc_info=task.exception())


def _dead_reason(status: SandboxStatus) -> tuple[str, str]:
    if status is SandboxStatus.EXITED:
        return FailureReason.AGENT_EXITED.value, "the sandbox's agent exited"
    return FailureReason.RUNTIME_DIED.value, "the runtime no longer has this sandbox"


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
