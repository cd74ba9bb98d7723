"""`EtcdStore`: the async etcd client every Orchard service keeps its durable state in."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any

import grpc
from aetcd import rpc

from orchard.core.etcd._connection import Connection
from orchard.core.etcd.exceptions import (
    EtcdClosed,
    EtcdError,
    EtcdUnavailable,
    LeaseNotFound,
    map_rpc_error,
)
from orchard.core.etcd.kv import (
    Key,
    KeyValue,
    RangeResult,
    SortOrder,
    SortTarget,
    prefix_range_end,
    to_bytes,
)
from orchard.core.etcd.lease import Lease, LeaseInfo, LeaseKeepAlive
from orchard.core.etcd.txn import (
    Compare,
    CompareOp,
    DeleteOp,
    DeleteResult,
    Op,
    OpResult,
    PutOp,
    PutResult,
    TxnResult,
)
from orchard.core.etcd.watch import Watch

log = logging.getLogger(__name__)


class EtcdStore:
    """An async etcd v3 client with typed results and errors.

    Use as `async with EtcdStore(["http://127.0.0.1:2379"], namespace="orchard/env/") as
    store:`. Every key is stored under `namespace`, which results and events strip again, so
    services sharing one etcd never see each other's keys.

    With several endpoints the store talks to one at a time: `connect()` picks the first that
    answers, and a call that fails as unavailable raises `EtcdUnavailable` and moves the store
    to the next endpoint for the calls after it. Each unary call runs under `timeout` seconds,
    so a dead or partitioned etcd raises `EtcdUnavailable` (or its subclass `EtcdTimeout`)
    instead of hanging. Plain-text (`http://`) endpoints only for now.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        namespace: Key = b"",
        timeout: float = 5.0,
        connect_timeout: float = 5.0,
    ) -> None:
        self._endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not self._endpoints:
            raise ValueError("EtcdStore needs at least one endpoint")
        self._namespace = to_bytes(namespace)
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._connection: Connection | None = None
        self._endpoint_index = 0
        self._closing: set[asyncio.Task[None]] = set()
        self._keepalives: dict[int, LeaseKeepAlive] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def namespace(self) -> bytes:
        """The prefix every key of this store lives under."""
        return self._namespace

    @property
    def endpoint(self) -> str:
        """The endpoint the store is talking to now."""
        return self._endpoints[self._endpoint_index]

    async def connect(self) -> None:
        """Open a channel to the first endpoint that answers a status call.

        Raises `EtcdUnavailable` naming every endpoint tried when none answers within
        `connect_timeout` each.
        """
        if self._connection is not None:
            return
        failures: list[str] = []
        for offset in range(len(self._endpoints)):
            index = (self._endpoint_index + offset) % len(self._endpoints)
            connection = Connection.open(self._endpoints[index])
            try:
                # Not wait_for_ready: a refused connection should move on to the next endpoint.
                await connection.maintenance.Status(
                    rpc.StatusRequest(), timeout=self._connect_timeout
                )
            except grpc.aio.AioRpcError as e:
                failures.append(f"{connection.endpoint}: {e.code().name} {e.details()}")
                await connection.channel.close()
                continue
            self._endpoint_index = index
            self._connection = connection
            return
        raise EtcdUnavailable(f"no etcd endpoint answered: {'; '.join(failures)}")

    async def close(self) -> None:
        """Stop every keep-alive, close the channel; open watches end with `EtcdUnavailable`."""
        for keepalive in list(self._keepalives.values()):
            await keepalive.stop()
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.channel.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def __aenter__(self) -> EtcdStore:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def current(self) -> Connection:
        """The live connection (for this package's watches and keep-alives)."""
        if self._connection is None:
            raise EtcdClosed("the etcd store is not connected: use `async with` or connect()")
        return self._connection

    def report_unavailable(self, connection: Connection) -> None:
        """Move to the next endpoint after `connection` failed (no-op with one endpoint)."""
        if connection is not self._connection or len(self._endpoints) == 1:
            return
        self._endpoint_index = (self._endpoint_index + 1) % len(self._endpoints)
        self._connection = Connection.open(self.endpoint)
        log.warning(
            "etcd at %s is unavailable; switching to %s", connection.endpoint, self.endpoint
        )
        task = asyncio.get_running_loop().create_task(connection.channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _unary(self, service: str, method: str, request: Any) -> Any:
        connection = self.current()
        stub = getattr(connection, service)
        try:
            return await getattr(stub, method)(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            error = map_rpc_error(e, connection.endpoint)
            if isinstance(error, EtcdUnavailable):
                self.report_unavailable(connection)
            raise error from e
        except asyncio.CancelledError:
            if _task_cancelled():
                raise
            # grpc.aio raises CancelledError from calls in flight when their channel is closed
            # (a switch to another endpoint, or close()): a retryable failure, not our cancel.
            raise EtcdUnavailable(
                f"etcd at {connection.endpoint}: the call was cut off when its channel closed"
            ) from None

    # -- keys --------------------------------------------------------------------------------

    def _key(self, key: Key) -> bytes:
        return self._namespace + to_bytes(key)

    def _prefix_end(self, prefix: Key) -> bytes:
        return prefix_range_end(self._key(prefix))

    def _kv(self, kv: Any) -> KeyValue:
        return KeyValue.from_proto(kv, len(self._namespace))

    async def get(self, key: Key, *, revision: int = 0) -> KeyValue | None:
        """Read one key (at `revision`, or the latest); None when absent.

        Raises `CompactedRevision` for a compacted `revision`, `EtcdUnavailable`.
        """
        response = await self._unary(
            "kv", "Range", rpc.RangeRequest(key=self._key(key), revision=revision)
        )
        return self._kv(response.kvs[0]) if response.kvs else None

    async def range(
        self,
        start: Key,
        end: Key | None = None,
        *,
        limit: int = 0,
        revision: int = 0,
        sort_target: SortTarget = SortTarget.KEY,
        sort_order: SortOrder = SortOrder.NONE,
        keys_only: bool = False,
    ) -> RangeResult:
        """Read the keys in `[start, end)` (just `start` when `end` is None).

        `limit` 0 means no limit. Read the next page with `start` = last key + b"\\0" and
        `revision` = the first page's revision for a consistent snapshot (or use
        `iter_prefix`). Raises `CompactedRevision`, `EtcdUnavailable`.
        """
        request = rpc.RangeRequest(
            key=self._key(start),
            range_end=self._key(end) if end is not None else b"",
            limit=limit,
            revision=revision,
            sort_target=sort_target.value,
            sort_order=sort_order.value,
            keys_only=keys_only,
        )
        return self._range_result(await self._unary("kv", "Range", request))

    async def get_prefix(
        self,
        prefix: Key,
        *,
        limit: int = 0,
        revision: int = 0,
        start_after: Key | None = None,
        sort_target: SortTarget = SortTarget.KEY,
        sort_order: SortOrder = SortOrder.NONE,
        keys_only: bool = False,
    ) -> RangeResult:
        """Read the keys that start with `prefix`, optionally one page of `limit` keys that
        come after `start_after` (page by key).

        Raises `CompactedRevision`, `EtcdUnavailable`.
        """
        start = self._key(prefix) if start_after is None else self._key(start_after) + b"\0"
        request = rpc.RangeRequest(
            key=start,
            range_end=self._prefix_end(prefix),
            limit=limit,
            revision=revision,
            sort_target=sort_target.value,
            sort_order=sort_order.value,
            keys_only=keys_only,
        )
        return self._range_result(await self._unary("kv", "Range", request))

    async def iter_prefix(
        self, prefix: Key, *, page_size: int = 500, revision: int = 0
    ) -> AsyncIterator[KeyValue]:
        """Yield every key under `prefix` in key order, `page_size` keys per call, all read
        at one revision (the first page's, unless `revision` is given)."""
        start_after: bytes | None = None
        while True:
            page = await self.get_prefix(
                prefix, limit=page_size, revision=revision, start_after=start_after
            )
            revision = page.revision
            for kv in page.kvs:
                yield kv
            if not page.more or not page.kvs:
                return
            start_after = page.kvs[-1].key

    async def list_prefix(self, prefix: Key, *, page_size: int = 500) -> RangeResult:
        """Read every key under `prefix` at one revision, in pages of `page_size`."""
        kvs: list[KeyValue] = []
        first = await self.get_prefix(prefix, limit=page_size)
        kvs.extend(first.kvs)
        page = first
        while page.more and page.kvs:
            page = await self.get_prefix(
                prefix, limit=page_size, revision=first.revision, start_after=page.kvs[-1].key
            )
            kvs.extend(page.kvs)
        return RangeResult(kvs=kvs, revision=first.revision, more=False, count=len(kvs))

    def _range_result(self, response: Any) -> RangeResult:
        return RangeResult(
            kvs=[self._kv(kv) for kv in response.kvs],
            revision=response.header.revision,
            more=response.more,
            count=response.count,
        )

    async def put(self, key: Key, value: Key, *, lease: int | Lease = 0) -> int:
        """Set `key` to `value` (attached to `lease` if given); returns the new revision.

        Raises `LeaseNotFound` for an expired lease, `EtcdUnavailable`.
        """
        request = rpc.PutRequest(key=self._key(key), value=to_bytes(value), lease=_lease_id(lease))
        response = await self._unary("kv", "Put", request)
        return int(response.header.revision)

    async def delete(self, key: Key) -> bool:
        """Delete one key; returns whether it existed. Raises `EtcdUnavailable`."""
        response = await self._unary(
            "kv", "DeleteRange", rpc.DeleteRangeRequest(key=self._key(key))
        )
        return bool(response.deleted)

    async def delete_prefix(self, prefix: Key) -> int:
        """Delete every key under `prefix`; returns how many there were."""
        request = rpc.DeleteRangeRequest(key=self._key(prefix), range_end=self._prefix_end(prefix))
        response = await self._unary("kv", "DeleteRange", request)
        return int(response.deleted)

    # -- transactions ------------------------------------------------------------------------

    async def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Op] = (),
        failure: Sequence[Op] = (),
    ) -> TxnResult:
        """Apply `success` if every comparison holds, else `failure`, atomically.

        Keys in comparisons and operations are namespaced like every other key.
        Raises `LeaseNotFound`, `EtcdRequestError` (e.g. a key written twice), `EtcdUnavailable`.
        """
        request = rpc.TxnRequest(
            compare=[self._compare(c) for c in compare],
            success=[self._request_op(op) for op in success],
            failure=[self._request_op(op) for op in failure],
        )
        response = await self._unary("kv", "Txn", request)
        results: list[OpResult] = []
        for item in response.responses:
            kind = item.WhichOneof("response")
            if kind == "response_range":
                results.append(self._range_result(item.response_range))
            elif kind == "response_put":
                put = item.response_put
                results.append(
                    PutResult(self._kv(put.prev_kv) if put.HasField("prev_kv") else None)
                )
            elif kind == "response_delete_range":
                results.append(DeleteResult(int(item.response_delete_range.deleted)))
        return TxnResult(
            succeeded=bool(response.succeeded),
            revision=int(response.header.revision),
            results=results,
        )

    async def create_if_absent(self, key: Key, value: Key, *, lease: int | Lease = 0) -> int | None:
        """Create `key` only if it does not exist; returns the new revision, or None if it did."""
        result = await self.txn(
            [Compare.create_revision(key, CompareOp.EQUAL, 0)],
            [PutOp.of(key, value, _lease_id(lease))],
        )
        return result.revision if result.succeeded else None

    async def put_if_mod_revision(
        self, key: Key, value: Key, mod_revision: int, *, lease: int | Lease = 0
    ) -> int | None:
        """Set `key` only if it was last changed at `mod_revision` (0: only if absent);
        returns the new revision, or None when someone else changed it first."""
        result = await self.txn(
            [Compare.mod_revision(key, CompareOp.EQUAL, mod_revision)],
            [PutOp.of(key, value, _lease_id(lease))],
        )
        return result.revision if result.succeeded else None

    async def delete_if_mod_revision(self, key: Key, mod_revision: int) -> bool:
        """Delete `key` only if it was last changed at `mod_revision`; returns whether it was."""
        result = await self.txn(
            [Compare.mod_revision(key, CompareOp.EQUAL, mod_revision)], [DeleteOp.of(key)]
        )
        return result.succeeded

    def _compare(self, compare: Compare) -> Any:
        message = rpc.Compare(
            key=self._key(compare.key),
            target=compare.target.value,
            result=compare.op.value,
        )
        field = {
            "VERSION": "version",
            "CREATE_REVISION": "create_revision",
            "MOD_REVISION": "mod_revision",
            "VALUE": "value",
            "LEASE": "lease",
        }[compare.target.name]
        setattr(message, field, compare.operand)
        return message

    def _request_op(self, op: Op) -> Any:
        if isinstance(op, PutOp):
            return rpc.RequestOp(
                request_put=rpc.PutRequest(key=self._key(op.key), value=op.value, lease=op.lease)
            )
        end = self._prefix_end(op.key) if op.prefix else b""
        if isinstance(op, DeleteOp):
            return rpc.RequestOp(
                request_delete_range=rpc.DeleteRangeRequest(key=self._key(op.key), range_end=end)
            )
        return rpc.RequestOp(request_range=rpc.RangeRequest(key=self._key(op.key), range_end=end))

    # -- leases ------------------------------------------------------------------------------

    async def grant_lease(self, ttl: int) -> Lease:
        """Grant a lease of `ttl` seconds (etcd may round it up to its minimum)."""
        response = await self._unary("lease", "LeaseGrant", rpc.LeaseGrantRequest(TTL=ttl))
        if response.error:
            raise EtcdError(f"etcd refused the lease: {response.error}")
        return Lease(id=int(response.ID), ttl=int(response.TTL))

    async def refresh_lease(self, lease: int | Lease) -> int:
        """Refresh a lease once (a heartbeat); returns its renewed TTL.

        Raises `LeaseNotFound` when it has expired or was revoked, `EtcdUnavailable`.
        """
        lease_id = _lease_id(lease)
        connection = self.current()
        call = connection.lease.LeaseKeepAlive(timeout=self._timeout)
        try:
            await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
            response = await call.read()
        except grpc.aio.AioRpcError as e:
            error = map_rpc_error(e, connection.endpoint)
            if isinstance(error, EtcdUnavailable):
                self.report_unavailable(connection)
            raise error from e
        except asyncio.InvalidStateError:
            # gRPC refuses to write to a stream that already failed.
            self.report_unavailable(connection)
            raise EtcdUnavailable(f"etcd at {connection.endpoint} is unavailable") from None
        except asyncio.CancelledError:
            if _task_cancelled():
                raise
            raise EtcdUnavailable(
                f"etcd at {connection.endpoint}: the keep-alive was cut off when its channel closed"
            ) from None
        finally:
            call.cancel()
        if response is grpc.aio.EOF:
            raise EtcdUnavailable(f"etcd at {connection.endpoint} ended the keep-alive stream")
        if response.TTL <= 0:
            raise LeaseNotFound(f"lease {lease_id:x} has expired or was revoked")
        return int(response.TTL)

    def keep_alive(self, lease: Lease, *, interval: float | None = None) -> LeaseKeepAlive:
        """Start refreshing `lease` in the background every `interval` s (default TTL/3).

        The keep-alive runs until its `stop()`, `revoke_lease`, `close`, or until etcd
        reports the lease gone (see `LeaseKeepAlive.error`). One keep-alive per lease.
        """
        if lease.id in self._keepalives:
            raise ValueError(f"lease {lease.id:x} already has a keep-alive")
        self.current()
        keepalive = LeaseKeepAlive(
            self,
            lease,
            interval=interval,
            call_timeout=self._timeout,
            on_done=self._forget_keepalive,
        )
        self._keepalives[lease.id] = keepalive
        return keepalive

    def _forget_keepalive(self, keepalive: LeaseKeepAlive) -> None:
        if self._keepalives.get(keepalive.lease.id) is keepalive:
            del self._keepalives[keepalive.lease.id]

    async def revoke_lease(self, lease: int | Lease) -> None:
        """Stop its keep-alive and revoke the lease, deleting every key attached to it.

        Raises `LeaseNotFound` if it already expired, `EtcdUnavailable`.
        """
        lease_id = _lease_id(lease)
        keepalive = self._keepalives.get(lease_id)
        if keepalive is not None:
            await keepalive.stop()
        await self._unary("lease", "LeaseRevoke", rpc.LeaseRevokeRequest(ID=lease_id))

    async def lease_time_to_live(
        self, lease: int | Lease, *, keys: bool = False
    ) -> LeaseInfo | None:
        """The lease's remaining TTL (and its keys if asked); None when it no longer exists."""
        request = rpc.LeaseTimeToLiveRequest(ID=_lease_id(lease), keys=keys)
        response = await self._unary("lease", "LeaseTimeToLive", request)
        if response.TTL < 0:
            return None
        strip = len(self._namespace)
        return LeaseInfo(
            id=int(response.ID),
            ttl=int(response.TTL),
            granted_ttl=int(response.grantedTTL),
            keys=[bytes(k[strip:]) for k in response.keys if k.startswith(self._namespace)],
        )

    # -- watches -----------------------------------------------------------------------------

    def watch(
        self,
        key: Key,
        *,
        start_revision: int | None = None,
        prev_kv: bool = False,
        progress_notify: bool = False,
    ) -> Watch:
        """Watch one key; use the result with `async with`. See `Watch`."""
        return Watch(
            self,
            self._key(key),
            b"",
            namespace_len=len(self._namespace),
            start_revision=start_revision,
            prev_kv=prev_kv,
            progress_notify=progress_notify,
            create_timeout=self._timeout,
        )

    def watch_prefix(
        self,
        prefix: Key,
        *,
        start_revision: int | None = None,
        prev_kv: bool = False,
        progress_notify: bool = False,
    ) -> Watch:
        """Watch every key under `prefix`, from `start_revision` (inclusive) if given, else
        from now; use the result with `async with`.

        `prev_kv` adds each key's previous version to events. A compacted `start_revision`
        raises `CompactedRevision` from the first read. See `Watch`.
        """
        return Watch(
            self,
            self._key(prefix),
            self._prefix_end(prefix),
            namespace_len=len(self._namespace),
            start_revision=start_revision,
            prev_kv=prev_kv,
            progress_notify=progress_notify,
            create_timeout=self._timeout,
        )

    @contextlib.asynccontextmanager
    async def list_and_watch(
        self, prefix: Key, *, prev_kv: bool = False, page_size: int = 500
    ) -> AsyncIterator[tuple[RangeResult, Watch]]:
        """A consistent snapshot of `prefix` and every change after it, with no gap.

        `async with store.list_and_watch(p) as (snapshot, watch):` — `snapshot` holds every
        key at revision R (`snapshot.revision`), `watch` yields changes from R + 1 on. When
        the watch fails, enter `list_and_watch` again (or resume the watch from
        `watch.next_revision` if that has not been compacted).
        """
        snapshot = await self.list_prefix(prefix, page_size=page_size)
        async with self.watch_prefix(
            prefix, start_revision=snapshot.revision + 1, prev_kv=prev_kv
        ) as watch:
            yield snapshot, watch

    # -- maintenance -------------------------------------------------------------------------

    async def revision(self) -> int:
        """The store's current revision (a cheap read that touches no key)."""
        response = await self._unary(
            "kv", "Range", rpc.RangeRequest(key=self._namespace or b"\0", count_only=True)
        )
        return int(response.header.revision)

    async def compact(self, revision: int, *, physical: bool = False) -> None:
        """Discard history before `revision` for the whole etcd (not only this namespace).

        Reads and watches from an older revision then raise `CompactedRevision`.
        """
        await self._unary(
            "kv", "Compact", rpc.CompactionRequest(revision=revision, physical=physical)
        )


def _task_cancelled() -> bool:
    """Whether the running task itself is being cancelled (else a CancelledError came from a
    gRPC call whose channel was closed under it)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _lease_id(lease: int | Lease) -> int:
    return lease.id if isinstance(lease, Lease) else lease
