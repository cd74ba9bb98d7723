"""Owners: a lease of their own with an ``owners/`` record; sandboxes created with
``spec.owner_id`` put their record, request key and slots under the owner's lease, so one
keep-alive keeps them all and a revoke (DeleteOwner) or an expiry deletes every record at once
(every replica's watch then reaps their runtime resources).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import time

from orchard.core.errors import OrchardError
from orchard.core.etcd import EtcdError, EtcdStore, LeaseNotFound, PutOp
from orchard.env.reasons import EnvReason
from orchard.env.record_store import RecordStore, store_unavailable
from orchard.env.records import SANDBOXES, OwnerRecord, owner_key, owner_request_key
from orchard.env.v1 import env_pb2

__all__ = ["OwnerRegistry", "new_owner_id", "owner_not_found"]

log = logging.getLogger(__name__)


def new_owner_id() -> str:
    return "own-" + secrets.token_hex(6)


def owner_not_found(owner_id: str) -> OrchardError:
    return OrchardError(
        EnvReason.OWNER_NOT_FOUND,
        f"no owner {owner_id!r} (unknown, another tenant's, or its lease expired)",
        metadata={"owner_id": owner_id},
    )


class OwnerRegistry:
    """Create, read, renew and delete owners in etcd."""

    def __init__(self, etcd: EtcdStore, records: RecordStore) -> None:
        self._etcd = etcd
        self._records = records

    async def create(
        self, tenant: str, labels: dict[str, str], ttl_s: int, request_id: str
    ) -> OwnerRecord:
        """An owner record under a new lease of ``ttl_s``; a retry with the same request id
        returns the same owner."""
        rkey = owner_request_key(tenant, request_id) if request_id else ""
        requests = self._records.requests
        by_request = functools.partial(self._by_id, tenant)
        try:
            existing = await requests.seen(rkey, by_request)
            if existing is not None:
                return existing
            lease = await self._etcd.grant_lease(ttl_s)
            owner = env_pb2.Owner(id=new_owner_id(), tenant=tenant, labels=labels)
            owner.heartbeat_timeout.FromSeconds(ttl_s)
            record = OwnerRecord(owner, lease=lease.id)
            compare, ops = requests.guard(rkey, owner.id, lease.id)
            result = await self._etcd.txn(
                compare, [PutOp.of(record.key, record.encode(), lease.id), *ops]
            )
            if not result.succeeded:
                with contextlib.suppress(EtcdError):
                    await self._etcd.revoke_lease(lease.id)
                return requests.raced(await requests.holder(rkey, by_request))
        except EtcdError as exc:
            raise store_unavailable(exc) from exc
        self._records.leases.note(lease.id, lease.ttl)
        owner.expire_time.FromSeconds(int(time.time()) + lease.ttl)
        return record

    async def _by_id(self, tenant: str, owner_id: str) -> OwnerRecord | None:
        with contextlib.suppress(OrchardError):
            return await self.get(tenant, owner_id)
        return None

    async def get(self, tenant: str, owner_id: str) -> OwnerRecord:
        """An owner of ``tenant`` with its expiry; NOT_FOUND for another tenant's or one whose
        lease expired."""
        try:
            kv = await self._etcd.get(owner_key(tenant, owner_id))
            if kv is None:
                raise owner_not_found(owner_id)
            record = OwnerRecord.from_kv(kv)
            info = await self._etcd.lease_time_to_live(record.lease)
        except EtcdError as exc:
            raise store_unavailable(exc) from exc
        if info is None:
            raise owner_not_found(owner_id)
        self._records.leases.note(record.lease, info.ttl)
        record.owner.expire_time.FromSeconds(int(time.time()) + max(info.ttl, 0))
        return record

    async def lease(self, tenant: str, owner_id: str) -> tuple[int, int]:
        """``(lease id, seconds left)`` of the owner, for a sandbox joining it."""
        record = await self.get(tenant, owner_id)
        return record.lease, max(int(record.owner.expire_time.seconds - time.time()), 0)

    async def heartbeat(self, tenant: str, owner_id: str) -> float:
        """Renew the owner's lease once (and with it every sandbox under it)."""
        try:
            kv = await self._etcd.get(owner_key(tenant, owner_id))
            if kv is None:
                raise owner_not_found(owner_id)
            ttl = await self._etcd.refresh_lease(kv.lease)
        except LeaseNotFound:
            raise owner_not_found(owner_id) from None
        except EtcdError as exc:
            raise store_unavailable(exc) from exc
        self._records.leases.note(kv.lease, ttl)
        return time.time() + ttl

    async def delete(self, tenant: str, owner_id: str) -> int:
        """Revoke the owner's lease: its record and every sandbox record under it vanish in
        one step, and each replica's watch reaps them. Returns how many sandboxes it had."""
        try:
            kv = await self._etcd.get(owner_key(tenant, owner_id))
            if kv is None:
                return 0
            info = await self._etcd.lease_time_to_live(kv.lease, keys=True)
            if info is None:
                return 0
            count = sum(1 for key in info.keys if key.startswith(SANDBOXES.encode()))
            with contextlib.suppress(LeaseNotFound):
                await self._etcd.revoke_lease(kv.lease)
        except EtcdError as exc:
            raise store_unavailable(exc) from exc
        self._records.leases.forget(kv.lease)
        log.info("owner deleted", extra={"owner_id": owner_id, "sandboxes": count})
        return count
