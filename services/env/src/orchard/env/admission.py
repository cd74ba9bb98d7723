"""Admission control: at most N sandboxes starting or READY (in all, per tenant, per owner);
the rest wait, PENDING, in a fair queue.

The count lives in etcd, so it holds across replicas: an admitted sandbox holds one slot key per
limited scope, ``slots/all/<i>``, ``slots/tenant/<tenant>/<i>``, ``slots/owner/<owner>/<i>``
with ``i`` below that scope's limit, created in the same transaction that admits it (each key
compared absent) and bound to the sandbox's lease. Two replicas can never hand out one slot,
an expired lease frees its slots with the record, and FAILED or deleted sandboxes release
theirs (:meth:`AdmissionQueue.release`).

Queued sandboxes are records with ``queued`` set and no creation running. Every replica sees
them through its watch mirror and runs :meth:`AdmissionQueue.run_round` when something may have
freed a slot or joined the queue; the replica whose transaction wins runs the creation. The
order is the same on every replica (:func:`fair_order`): round-robin over tenants, FIFO within
one (fixed when a sandbox joins the queue). ``queue_position`` is written only when it changes, in
batched transactions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from orchard.core.etcd import (
    Compare,
    CompareOp,
    DeleteOp,
    EtcdError,
    EtcdStore,
    LeaseNotFound,
    PutOp,
)
from orchard.env.config import AdmissionConfig
from orchard.env.records import SandboxRecord, creating_key, slot_scope
from orchard.env.v1 import env_pb2

__all__ = ["AdmissionQueue", "Scope", "fair_order", "next_rounds"]

log = logging.getLogger(__name__)

_POSITION_BATCH = 48  # records per transaction (etcd's default cap is 128 operations)
_COALESCE_S = 0.02  # wake-ups within this window make one round
_CONFLICT_RETRY_S = 0.05


@dataclass(frozen=True)
class Scope:
    """One limited group of sandboxes: its slot key prefix and its limit."""

    prefix: str
    limit: int


def _order_key(record: SandboxRecord) -> tuple[int, int, int, str]:
    stamp = record.sandbox.create_time
    return (record.queue_round, stamp.seconds, stamp.nanos, record.id)


def fair_order(records: Iterable[SandboxRecord]) -> list[SandboxRecord]:
    """Queued records in admission order: by round (see :func:`next_rounds`), then by create
    time. Deterministic, so every replica agrees."""
    return sorted(records, key=_order_key)


def next_rounds(queued: Iterable[SandboxRecord], tenant: str, count: int) -> list[int]:
    """Rounds for ``count`` sandboxes of ``tenant`` joining the queue: each tenant's sandboxes
    take consecutive rounds, starting no earlier than the head of the queue (a tenant with
    nothing waiting joins the current round). Round-robin across tenants, FIFO within one,
    fixed at enqueue time so positions only ever move up."""
    head: int | None = None
    last: int | None = None
    for record in queued:
        head = record.queue_round if head is None else min(head, record.queue_round)
        if record.tenant == tenant:
            last = record.queue_round if last is None else max(last, record.queue_round)
    first = max(head or 0, (last + 1) if last is not None else 0)
    return [first + i for i in range(count)]


class AdmissionQueue:
    """One replica's part of admission: reserve slots, admit from the queue, write positions."""

    def __init__(
        self,
        store: EtcdStore,
        config: AdmissionConfig,
        *,
        queued: Callable[[], list[SandboxRecord]],
        start_creation: Callable[[SandboxRecord], None],
        replica_lease: Callable[[], int],
        replica_id: str,
    ) -> None:
        self.store = store
        self.config = config
        self._queued = queued
        self._start_creation = start_creation
        self._replica_lease = replica_lease
        self._replica_id = replica_id
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def scopes(self, sandbox: env_pb2.Sandbox) -> list[Scope]:
        config, scopes = self.config, []
        if config.max_sandboxes is not None:
            scopes.append(Scope(slot_scope("all"), config.max_sandboxes))
        if config.max_sandboxes_per_tenant is not None:
            scopes.append(
                Scope(slot_scope("tenant", sandbox.tenant), config.max_sandboxes_per_tenant)
            )
        if config.max_sandboxes_per_owner is not None and sandbox.spec.owner_id:
            scopes.append(
                Scope(slot_scope("owner", sandbox.spec.owner_id), config.max_sandboxes_per_owner)
            )
        return scopes

    # -- the loop ------------------------------------------------------------------------------

    def start(self) -> None:
        if self.enabled:
            self._task = asyncio.create_task(self._run(), name="admission")
            self.wake()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def wake(self) -> None:
        """Something may have freed a slot or joined the queue: run a round soon."""
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(_COALESCE_S)
            self._wake.clear()
            try:
                if not await self.run_round():
                    # A transaction lost to a change this replica has not seen yet.
                    await asyncio.sleep(_CONFLICT_RETRY_S)
                    self.wake()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                # A call cut off by a closed etcd channel: the loop must not end with it.
                log.warning("admission round cut off by a closed etcd channel; retrying")
                await asyncio.sleep(0.5)
                self.wake()
            except EtcdError as exc:
                log.warning("admission round failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
                self.wake()
            except Exception:
                log.exception("admission round failed")
                await asyncio.sleep(0.5)
                self.wake()

    async def run_round(self) -> bool:
        """Admit what fits, in fair order, then write the positions of the rest. Returns False
        when a transaction lost a race (the caller runs another round)."""
        order = fair_order(r for r in self._queued() if r.queued)
        used: dict[str, set[int]] = {}
        full: set[str] = set()
        admitted: set[str] = set()
        clean = True
        for record in order:
            scopes = self.scopes(record.sandbox)
            if any(scope.prefix in full for scope in scopes):
                continue
            slots = await self._pick(scopes, used, full)
            if slots is None:
                if self.config.max_sandboxes is not None and slot_scope("all") in full:
                    break
                continue
            outcome = await self._admit(record, slots)
            if outcome:
                admitted.add(record.id)
                for key in slots:
                    prefix, _, index = key.rpartition("/")
                    used[prefix + "/"].add(int(index))
            else:
                clean = False
        remaining = [r for r in order if r.id not in admitted]
        return await self._write_positions(remaining) and clean

    # -- slots ---------------------------------------------------------------------------------

    async def _used(self, prefix: str) -> set[int]:
        page = await self.store.get_prefix(prefix, keys_only=True)
        found = set()
        for kv in page.kvs:
            tail = kv.key_str[len(prefix) :]
            if tail.isdigit():
                found.add(int(tail))
        return found

    async def _pick(
        self, scopes: list[Scope], used: dict[str, set[int]], full: set[str]
    ) -> list[str] | None:
        """A free slot key in every scope, or None (and the full scopes noted)."""
        keys = []
        for scope in scopes:
            if scope.prefix not in used:
                used[scope.prefix] = await self._used(scope.prefix)
            taken = used[scope.prefix]
            free = next((i for i in range(scope.limit) if i not in taken), None)
            if free is None:
                full.add(scope.prefix)
                return None
            keys.append(f"{scope.prefix}{free}")
        return keys

    async def reserve(self, sandbox: env_pb2.Sandbox) -> list[str] | None:
        """Slot keys free right now for a new sandbox (to take in its creation transaction,
        each compared absent), or None when a scope is full or others are waiting."""
        used: dict[str, set[int]] = {}
        full: set[str] = set()
        slots = await self._pick(self.scopes(sandbox), used, full)
        if slots is None:
            return None
        for record in self._queued():
            # Fairness: one that waits and could start now goes first; one held back by its own
            # tenant's or owner's limit is not overtaken by this one.
            if record.queued and await self._pick(self.scopes(record.sandbox), used, full):
                return None
        return slots

    @staticmethod
    def slot_ops(
        sandbox_id: str, slots: list[str], lease: int
    ) -> tuple[list[Compare], list[PutOp]]:
        return (
            [Compare.create_revision(key, CompareOp.EQUAL, 0) for key in slots],
            [PutOp.of(key, sandbox_id, lease) for key in slots],
        )

    async def _admit(self, record: SandboxRecord, slots: list[str]) -> bool:
        """Claim ``slots`` for a queued record and start its creation here; False when the
        record or a slot changed first."""
        admitted = SandboxRecord.decode(record.encode(), lease=record.lease)
        admitted.queued = False
        admitted.slots = tuple(slots)
        admitted.sandbox.queue_position = 0
        compares, puts = self.slot_ops(record.id, slots, record.lease)
        try:
            result = await self.store.txn(
                [Compare.mod_revision(record.key, CompareOp.EQUAL, record.mod_revision), *compares],
                [
                    PutOp.of(record.key, admitted.encode(), record.lease),
                    *puts,
                    PutOp.of(
                        creating_key(record.tenant, record.id),
                        self._replica_id,
                        self._replica_lease(),
                    ),
                ],
            )
        except LeaseNotFound:
            return True  # its lease expired: the record is gone, nothing to admit
        if not result.succeeded:
            return False
        admitted.mod_revision = result.revision
        log.info("admitted from the queue", extra={"sandbox_id": record.id})
        self._start_creation(admitted)
        return True

    async def release(self, sandbox_id: str, slots: Iterable[str]) -> None:
        """Give back a sandbox's slots (each only if it still holds it)."""
        for key in slots:
            with contextlib.suppress(EtcdError):
                await self.store.txn(
                    [Compare.value(key, CompareOp.EQUAL, sandbox_id)], [DeleteOp.of(key)]
                )

    # -- positions -----------------------------------------------------------------------------

    async def _write_positions(self, order: list[SandboxRecord]) -> bool:
        changed = [
            (position, record)
            for position, record in enumerate(order, start=1)
            if record.sandbox.queue_position != position
        ]
        clean = True
        for start in range(0, len(changed), _POSITION_BATCH):
            batch = changed[start : start + _POSITION_BATCH]
            compares, puts = [], []
            for position, record in batch:
                updated = SandboxRecord.decode(record.encode())
                updated.sandbox.queue_position = position
                compares.append(
                    Compare.mod_revision(record.key, CompareOp.EQUAL, record.mod_revision)
                )
                puts.append(PutOp.of(record.key, updated.encode(), record.lease))
            try:
                result = await self.store.txn(compares, puts)
            except LeaseNotFound:
                result = None  # one of them expired meanwhile
            if result is None or not result.succeeded:
                clean = False
        return clean
