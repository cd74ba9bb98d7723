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
- **Reconcile** (at start and every ``reconcile_interval_s``): runtime sandboxes without a
  record are deleted; READY records whose runtime sandbox is gone or exited become FAILED;
  PENDING records without a creating key are taken over. ``runtime.exits()`` events make
  records FAILED as they happen.

Replicas must see one runtime (the same host for ``local``, the same cluster for
``kubernetes``): any replica may delete, status or reconcile any sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from google.protobuf import timestamp_pb2

from orchard.core.errors import OrchardError, Reason
from orchard.core.etcd import (
    Compare,
    CompareOp,
    DeleteOp,
    EtcdError,
    EtcdStore,
    EtcdUnavailable,
    Lease,
    LeaseKeepAlive,
    LeaseNotFound,
    PutOp,
)
from orchard.env.agents import AgentLink, AgentLinks
from orchard.env.config import EnvConfig
from orchard.env.metrics import EnvMetrics
from orchard.env.reasons import EnvReason
from orchard.env.record_watch import RecordWatcher
from orchard.env.records import (
    CREATING,
    REPLICAS,
    SANDBOXES,
    SandboxRecord,
    creating_key,
    request_key,
    sandbox_key,
)
from orchard.env.runtime.base import (
    EgressRule,
    FailureReason,
    Runtime,
    RuntimeFailure,
    RuntimeResources,
    RuntimeSandboxSpec,
    SandboxStatus,
)
from orchard.env.v1 import env_pb2

__all__ = ["SandboxController"]

log = logging.getLogger(__name__)

PENDING = env_pb2.SANDBOX_STATE_PENDING
READY = env_pb2.SANDBOX_STATE_READY
FAILED = env_pb2.SANDBOX_STATE_FAILED
DELETING = env_pb2.SANDBOX_STATE_DELETING
_SETTLED = (READY, FAILED)


def new_sandbox_id() -> str:
    return "sbx-" + secrets.token_hex(6)


def _now() -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.GetCurrentTime()
    return stamp


def _store_unavailable(exc: EtcdError) -> OrchardError:
    return OrchardError(EnvReason.STATE_STORE_UNAVAILABLE, f"state store unavailable: {exc}")


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
        self.agents = AgentLinks()
        self._replica_lease: Lease | None = None
        self._keepalive: LeaseKeepAlive | None = None
        self._creations: dict[str, asyncio.Task[None]] = {}  # sandbox id → creation task
        self._tasks: set[asyncio.Task[Any]] = set()
        self._background: list[asyncio.Task[None]] = []
        self._create_slots = asyncio.Semaphore(config.max_concurrent_creates)
        self._closing = False

    # -- lifecycle of the controller ----------------------------------------------------------

    async def start(self) -> None:
        self._replica_lease = await self.store.grant_lease(self.config.replica_ttl_s)
        self._keepalive = self.store.keep_alive(self._replica_lease)
        await self.store.put(
            f"{REPLICAS}{self.replica_id}",
            json.dumps({"started": time.time(), "runtime": self.runtime.name}),
            lease=self._replica_lease,
        )
        await self.watcher.start()
        await self.reconcile()
        self._background = [
            asyncio.create_task(self._reconcile_loop(), name="reconcile"),
            asyncio.create_task(self._follow_exits(), name="runtime-exits"),
            asyncio.create_task(self._watch_replica_lease(), name="replica-lease"),
        ]
        log.info("controller started", extra={"replica": self.replica_id})

    async def close(self) -> None:
        """Stop background work. Creations in flight are cancelled (the runtime releases what
        they made); their records stay PENDING and another replica, or this one after a
        restart, takes them over once this replica's lease is gone."""
        self._closing = True
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
        return task

    async def _watch_replica_lease(self) -> None:
        assert self._keepalive is not None
        with contextlib.suppress(LeaseNotFound):
            await self._keepalive.wait()
        if not self._closing:
            # Another replica may be taking over our creations now; nothing safe remains.
            log.error("this replica's lease was lost; its creations may be taken over")

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
        assert self._replica_lease is not None
        started = time.monotonic()
        rkey = request_key(tenant, request_id) if request_id else ""
        try:
            if rkey:
                existing = await self._by_request(tenant, rkey)
                if existing is not None:
                    return existing
            lease = await self.store.grant_lease(ttl_s)
            sandbox = env_pb2.Sandbox(
                id=new_sandbox_id(),
                tenant=tenant,
                spec=spec,
                state=PENDING,
                runtime=self.runtime.name,
                create_time=_now(),
            )
            record = SandboxRecord(sandbox, request_key=rkey)
            key = record.key
            ops = [
                PutOp.of(key, record.encode(), lease.id),
                PutOp.of(creating_key(tenant, sandbox.id), self.replica_id, self._replica_lease.id),
            ]
            compare = []
            if rkey:
                ops.append(PutOp.of(rkey, sandbox.id, lease.id))
                compare.append(Compare.create_revision(rkey, CompareOp.EQUAL, 0))
            result = await self.store.txn(compare, ops)
            if not result.succeeded:
                # A concurrent retry with the same request id won.
                with contextlib.suppress(EtcdError):
                    await self.store.revoke_lease(lease)
                existing = await self._by_request(tenant, rkey)
                if existing is None:
                    raise OrchardError(Reason.ABORTED, "a retry with this request_id raced; retry")
                return existing
        except EtcdError as exc:
            raise _store_unavailable(exc) from exc
        record.mod_revision = result.revision
        record.lease = lease.id
        record.sandbox.expire_time.FromSeconds(int(time.time()) + lease.ttl)
        self._start_creation(record, started)
        self.metrics.create_seconds.observe(time.monotonic() - started)
        return record

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
        self, record: SandboxRecord, started: float, *, replace: bool = False
    ) -> None:
        task = asyncio.create_task(
            self._create_in_runtime(record, started, replace), name=f"create-{record.id}"
        )
        self._creations[record.id] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._creations.get(record.id) is t:
                del self._creations[record.id]

        task.add_done_callback(done)

    def runtime_spec(self, sandbox: env_pb2.Sandbox) -> RuntimeSandboxSpec:
        spec, limits = sandbox.spec, self.config.limits
        resources = RuntimeResources(
            cpu_millis=spec.resources.cpu_millis or limits.default_cpu_millis,
            memory_bytes=spec.resources.memory_bytes or limits.default_memory_bytes,
            pids=spec.resources.pids or limits.default_pids,
            disk_bytes=spec.resources.disk_bytes or limits.default_disk_bytes,
        )
        return RuntimeSandboxSpec(
            sandbox_id=sandbox.id,
            image=spec.image,
            resources=resources,
            env=dict(spec.env),
            working_dir=spec.working_dir or "/",
            egress=egress_rules(spec.network_policy),
            labels=dict(spec.labels),
        )

    async def _create_in_runtime(
        self, record: SandboxRecord, started: float, replace: bool
    ) -> None:
        sid, tenant = record.id, record.tenant
        key, ckey = record.key, creating_key(tenant, sid)
        async with self._create_slots:
            if replace:
                # A replica died while creating it: clear whatever it left first.
                await self.runtime.delete(sid)
            try:
                made = await self.runtime.create(self.runtime_spec(record.sandbox))
            except asyncio.CancelledError:
                if not self._closing:
                    with contextlib.suppress(EtcdError):
                        await self.store.delete(ckey)
                raise
            except RuntimeFailure as exc:
                await self.fail(
                    tenant, sid, exc.reason.value, exc.message, extra_ops=[DeleteOp.of(ckey)]
                )
                await self._drop_creating(ckey)
                return
            except Exception as exc:
                log.exception("runtime.create failed", extra={"sandbox_id": sid})
                await self.fail(
                    tenant,
                    sid,
                    FailureReason.INTERNAL.value,
                    f"runtime error: {exc}",
                    extra_ops=[DeleteOp.of(ckey)],
                )
                await self._drop_creating(ckey)
                return

            def to_ready(r: SandboxRecord) -> bool:
                if r.state != PENDING:
                    return False
                r.sandbox.state = READY
                r.sandbox.ready_time.CopyFrom(_now())
                r.sandbox.agent_version = made.agent_version
                r.agent_address = made.agent_address
                return True

            try:
                updated = await self._update(key, to_ready, extra_ops=[DeleteOp.of(ckey)])
            except EtcdError:
                updated = None
                log.exception("could not record READY", extra={"sandbox_id": sid})
            if updated is None:
                # Deleted, reaped or failed meanwhile: what we made must not outlive it.
                await self.runtime.delete(sid)
                await self._drop_creating(ckey)
                return
            self.metrics.ready_seconds.observe(time.monotonic() - started)

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
    ) -> bool:
        """PENDING/READY → FAILED with a reason, then release the runtime's resources."""

        def to_failed(r: SandboxRecord) -> bool:
            if r.state not in (PENDING, READY):
                return False
            r.sandbox.state = FAILED
            r.sandbox.failure.reason = reason
            r.sandbox.failure.message = message
            return True

        try:
            updated = await self._update(
                sandbox_key(tenant, sandbox_id), to_failed, extra_ops=extra_ops
            )
        except EtcdError:
            log.exception("could not record FAILED", extra={"sandbox_id": sandbox_id})
            return False
        if updated is not None:
            self.metrics.failed.labels(reason=reason).inc()
            log.info("sandbox failed", extra={"sandbox_id": sandbox_id, "reason": reason})
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
                record = await self.get(tenant, sandbox_id, expire_time=False)
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
        self.metrics.delete_seconds.observe(time.monotonic() - started)

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
        return self.agents.get(sandbox_id, record.agent_address)

    def check_alive(self, tenant: str, sandbox_id: str) -> None:
        """After an agent did not answer: ask the runtime, and fail the record if it died."""
        self._spawn(self._check_alive(tenant, sandbox_id), f"check-{sandbox_id}")

    async def _check_alive(self, tenant: str, sandbox_id: str) -> None:
        status = await self.runtime.status(sandbox_id)
        if status is not SandboxStatus.RUNNING:
            await self.fail(tenant, sandbox_id, *_dead_reason(status))

    # -- watcher events (RecordListener) -------------------------------------------------

    def record_changed(self, record: SandboxRecord, previous: SandboxRecord | None) -> None:
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
        self._count_states()

    def creating_deleted(self, tenant: str, sandbox_id: str, replica: str) -> None:
        if replica == self.replica_id or self._closing:
            return
        record = self.watcher.records.get(sandbox_key(tenant, sandbox_id))
        if record is not None and record.state == PENDING:
            self._spawn(self._take_over(tenant, sandbox_id), f"take-over-{sandbox_id}")

    def resynced(self) -> None:
        self._count_states()

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
            if record.state != PENDING:
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
            try:
                await self.reconcile()
            except EtcdUnavailable as exc:
                log.warning("reconcile skipped: %s", exc)
            except Exception:
                log.exception("reconcile failed")

    async def reconcile(self) -> dict[str, int]:
        """Compare the runtime with the records once; returns what it did, by kind."""
        done = {"leftovers": 0, "failed": 0, "taken_over": 0}
        # The runtime first: a sandbox created after this has its record in the listing below.
        in_runtime = set(await self.runtime.list_sandboxes())
        listing = await self.store.list_prefix("")
        records: dict[str, SandboxRecord] = {}
        creating: set[str] = set()
        for kv in listing.kvs:
            key = kv.key_str
            if key.startswith(SANDBOXES):
                record = SandboxRecord.from_kv(kv)
                records[record.id] = record
            elif key.startswith(CREATING):
                creating.add(key.rsplit("/", 1)[-1])
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
            elif (
                record.state == PENDING
                and record.id not in creating
                and await self._take_over(record.tenant, record.id)
            ):
                done["taken_over"] += 1
        if any(done.values()):
            log.info("reconciled", extra=done)
        return done

    async def _follow_exits(self) -> None:
        while True:
            try:
                async for event in self.runtime.exits():
                    record = self._find(event.sandbox_id)
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
