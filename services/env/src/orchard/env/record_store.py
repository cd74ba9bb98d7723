"""One replica's sandbox records: typed reads and writes over etcd, served from the view the
watch keeps.

- **Reads** come from the :class:`~orchard.env.record_watch.RecordWatcher` mirror: GetSandbox,
  WaitSandbox, Heartbeat and exec routing touch no etcd key. A miss (a record this replica's
  watch has not delivered yet, e.g. one another replica wrote a moment ago, or none at all)
  reads etcd once. The mirror lags etcd by the watch's latency; a read right after this
  replica's own write sees it (:meth:`RecordStore.offer`).
- **Writes** are compare-and-swap on the mod revision the view holds: a stale view costs one
  failed compare and a read, never a lost update.
- **Expiry** (``expire_time``) comes from a :class:`LeaseClock`: the expiry this replica last
  learnt of for each lease (its own grants and refreshes, or one lease read). A heartbeat through
  another replica moves the true expiry later, so the one reported is a lower bound; when it
  passes while the record still exists the lease is read again.
- **State counts** (the ``orchard_env_sandboxes`` gauge) move by each change the watch delivers,
  never by counting every record.
- **Request ids** (:class:`RequestKeys`): create, fork and create-owner each put their request
  key in their own transaction, only if it is absent; a retry finds what the first made through
  it.
- **Batching**: etcd writes that belong together go in one transaction: a creation's record,
  request key, creating key and admission slots; up to 48 forks (each record and creating key)
  with the request key in the first; READY with the creating key's removal; a deletion's record,
  creating key and request key. Different sandboxes never share a transaction: one failed
  compare must not undo another client's creation.

Callbacks run one way: the watcher tells this store of each change; the store updates its
counts and tells its one listener (the controller), which never calls back into the watcher.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from orchard.core.errors import OrchardError, Reason
from orchard.core.etcd import Compare, CompareOp, EtcdStore, LeaseNotFound, PutOp
from orchard.env.metrics import EnvMetrics
from orchard.env.reasons import EnvReason
from orchard.env.record_watch import RecordListener, RecordWatcher
from orchard.env.records import SandboxRecord, sandbox_key
from orchard.env.v1 import env_pb2

__all__ = [
    "LeaseClock",
    "RecordStore",
    "RequestKeys",
    "StateCounts",
    "not_found",
    "store_unavailable",
]

T = TypeVar("T")

_STATES = [v for v in env_pb2.SandboxState.values() if v != env_pb2.SANDBOX_STATE_UNSPECIFIED]


def not_found(sandbox_id: str) -> OrchardError:
    return OrchardError(
        EnvReason.SANDBOX_NOT_FOUND,
        f"no sandbox {sandbox_id!r}",
        metadata={"sandbox_id": sandbox_id},
    )


def store_unavailable(exc: Exception) -> OrchardError:
    return OrchardError(EnvReason.STATE_STORE_UNAVAILABLE, f"state store unavailable: {exc}")


class StateCounts:
    """How many records are in each state, moved by deltas into the metrics gauge."""

    def __init__(self, metrics: EnvMetrics) -> None:
        self._gauges: dict[int, Any] = {
            state: metrics.sandboxes.labels(
                state=env_pb2.SandboxState.Name(state).removeprefix("SANDBOX_STATE_")
            )
            for state in _STATES
        }
        self.counts: dict[int, int] = dict.fromkeys(_STATES, 0)

    def move(self, old: int | None, new: int | None) -> None:
        """One record went from state ``old`` to ``new`` (None: absent)."""
        if old == new:
            return
        for state, step in ((old, -1), (new, 1)):
            if state in self.counts:
                assert state is not None
                self.counts[state] += step
                self._gauges[state].set(self.counts[state])

    def reset(self, states: Any) -> None:
        """Count again from scratch (after the watch listed every record)."""
        self.counts = dict.fromkeys(_STATES, 0)
        for state in states:
            if state in self.counts:
                self.counts[state] += 1
        for state, gauge in self._gauges.items():
            gauge.set(self.counts[state])


class LeaseClock:
    """When each lease this replica has heard of expires, as Unix seconds."""

    def __init__(self) -> None:
        self._expiry: dict[int, float] = {}
        self._prune_at = 1024

    def note(self, lease_id: int, ttl_s: float) -> None:
        """The lease has ``ttl_s`` left as of now (granted, refreshed or read)."""
        now = time.time()
        self._expiry[lease_id] = now + max(ttl_s, 0)
        if len(self._expiry) >= self._prune_at:
            self._expiry = {k: v for k, v in self._expiry.items() if v > now}
            self._prune_at = max(1024, 2 * len(self._expiry))

    def expiry(self, lease_id: int) -> float | None:
        """The expiry, while it lies in the future; None when unknown or passed."""
        when = self._expiry.get(lease_id)
        return when if when is not None and when > time.time() else None

    def forget(self, lease_id: int) -> None:
        self._expiry.pop(lease_id, None)


class RequestKeys:
    """Request-id de-duplication, the same for every mutation that takes a request id."""

    def __init__(self, etcd: EtcdStore, view: RecordWatcher) -> None:
        self._etcd = etcd
        self._view = view

    @staticmethod
    def guard(rkey: str, value: str, lease_id: int) -> tuple[list[Compare], list[PutOp]]:
        """What the mutation's transaction adds: the key must be absent; it is put with
        ``value`` (what the mutation makes) under ``lease_id`` (so it lives as long as that)."""
        if not rkey:
            return [], []
        return (
            [Compare.create_revision(rkey, CompareOp.EQUAL, 0)],
            [PutOp.of(rkey, value, lease_id)],
        )

    async def seen(self, rkey: str, resolve: Callable[[str], Awaitable[T | None]]) -> T | None:
        """What an earlier request with this key made, as far as this replica's view knows
        (no etcd read: a retry the view has not heard of is caught by :meth:`guard`)."""
        value = self._view.requests.get(rkey) if rkey else None
        return None if value is None else await resolve(value)

    async def holder(self, rkey: str, resolve: Callable[[str], Awaitable[T | None]]) -> T | None:
        """After the guarded transaction failed: what the request that holds the key made,
        read from etcd (None when there is no key, or what it made is gone)."""
        kv = await self._etcd.get(rkey) if rkey else None
        return None if kv is None else await resolve(kv.value_str)

    @staticmethod
    def raced(found: T | None) -> T:
        """What :meth:`holder` found for a request that lost the race; ABORTED when nothing
        (the holder vanished between the two reads: the client's retry settles it)."""
        if found is None:
            raise OrchardError(Reason.ABORTED, "a retry with this request_id raced; retry")
        return found


class RecordStore(RecordListener):
    """The records of every sandbox, as this replica sees and changes them."""

    def __init__(self, etcd: EtcdStore, metrics: EnvMetrics, listener: RecordListener) -> None:
        self.etcd = etcd
        self.view = RecordWatcher(etcd, self)
        self.leases = LeaseClock()
        self.requests = RequestKeys(etcd, self.view)
        self.states = StateCounts(metrics)
        self._listener = listener

    async def start(self) -> None:
        await self.view.start()

    async def close(self) -> None:
        await self.view.close()

    # -- reads ---------------------------------------------------------------------------------

    def cached(self, tenant: str, sandbox_id: str) -> SandboxRecord | None:
        """The view's record (shared: never change it), or None."""
        return self.view.records.get(sandbox_key(tenant, sandbox_id))

    def cached_by_id(self, sandbox_id: str) -> SandboxRecord | None:
        key = self.view.by_id.get(sandbox_id)
        return None if key is None else self.view.records.get(key)

    async def read(self, tenant: str, sandbox_id: str) -> SandboxRecord | None:
        """A copy of the record, from the view, or from etcd when the view has none; raises
        ``EtcdError`` only when it had to ask etcd."""
        record = self.cached(tenant, sandbox_id)
        if record is not None:
            return copy(record)
        kv = await self.etcd.get(sandbox_key(tenant, sandbox_id))
        return None if kv is None else SandboxRecord.from_kv(kv)

    async def fill_expire_time(self, record: SandboxRecord) -> None:
        """Set ``expire_time`` from the lease (see the module docstring); leaves it unset when
        etcd does not answer a lease read it needed."""
        if not record.lease:
            return
        expiry = self.leases.expiry(record.lease)
        if expiry is None:
            try:
                info = await self.etcd.lease_time_to_live(record.lease)
            except Exception:
                return
            if info is None:
                return
            self.leases.note(record.lease, info.ttl)
            expiry = time.time() + max(info.ttl, 0)
        record.sandbox.expire_time.FromSeconds(int(expiry))

    async def catch_up(self, marker: str, lease_id: int, timeout_s: float) -> bool:
        """Wait until the view holds every change etcd had when this was called: writes
        ``marker`` (under ``lease_id``) and waits for the watch to deliver it. False when it
        did not within ``timeout_s``."""
        try:
            revision = await self.etcd.put(marker, b"", lease=lease_id)
        except LeaseNotFound:  # the replica's lease is being replaced
            return False
        try:
            await asyncio.wait_for(self.view.reached(revision), timeout_s)
        except TimeoutError:
            return False
        return True

    # -- writes --------------------------------------------------------------------------------

    def offer(self, record: SandboxRecord) -> None:
        """This replica wrote ``record`` (its ``mod_revision`` and ``lease`` set): reads see it,
        and the listener hears of it, before the watch delivers it (the event then changes
        nothing)."""
        stored = copy(record)
        stored.sandbox.ClearField("expire_time")
        taken, previous = self.view.offer(stored)
        if taken:
            self.record_changed(stored, previous)

    def offer_deletion(self, tenant: str, sandbox_id: str, revision: int) -> None:
        """This replica deleted the record at ``revision``: reads miss it, and the listener
        hears of it, before the watch delivers the deletion."""
        dropped, previous = self.view.offer_deletion(sandbox_key(tenant, sandbox_id), revision)
        if dropped:
            self.record_deleted(previous, tenant, sandbox_id)

    async def update(
        self,
        key: str,
        mutate: Callable[[SandboxRecord], bool],
        *,
        extra_ops: list[Any] | None = None,
    ) -> SandboxRecord | None:
        """Compare-and-swap a record, keeping its lease, starting from the view's copy; None
        when it is gone or ``mutate`` declines (returns False)."""
        cached = self.view.records.get(key)
        record = copy(cached) if cached is not None else None
        while True:
            if record is None:
                kv = await self.etcd.get(key)
                if kv is None:
                    return None
                record = SandboxRecord.from_kv(kv)
            revision, lease = record.mod_revision, record.lease
            if not mutate(record):
                return None
            try:
                result = await self.etcd.txn(
                    [Compare.mod_revision(key, CompareOp.EQUAL, revision)],
                    [PutOp.of(key, record.encode(), lease), *(extra_ops or [])],
                )
            except LeaseNotFound:
                return None
            if result.succeeded:
                record.mod_revision = result.revision
                self.offer(record)
                return record
            record = None  # the view was behind: read the record itself

    # -- told by the watcher -----------------------------------------------------------------

    def record_changed(self, record: SandboxRecord, previous: SandboxRecord | None) -> None:
        self.states.move(previous.state if previous else None, record.state)
        self._listener.record_changed(record, previous)

    def record_deleted(self, previous: SandboxRecord | None, tenant: str, sandbox_id: str) -> None:
        if previous is not None:
            self.states.move(previous.state, None)
        self._listener.record_deleted(previous, tenant, sandbox_id)

    def creating_deleted(self, tenant: str, sandbox_id: str, replica: str) -> None:
        self._listener.creating_deleted(tenant, sandbox_id, replica)

    def slot_released(self) -> None:
        self._listener.slot_released()

    def resynced(self) -> None:
        self.states.reset(r.state for r in self.view.records.values())
        self._listener.resynced()


def copy(record: SandboxRecord) -> SandboxRecord:
    """A record the caller may change without touching the view's."""
    sandbox = env_pb2.Sandbox()
    sandbox.CopyFrom(record.sandbox)
    return dataclasses.replace(record, sandbox=sandbox)
