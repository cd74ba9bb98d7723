"""Watching a key or a key range for changes, with resume from a revision."""

from __future__ import annotations

import asyncio
import collections
import enum
from collections.abc import Awaitable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc
from aetcd import rpc

from orchard.core.etcd._connection import Connection, ConnectionSource
from orchard.core.etcd.exceptions import (
    CompactedRevision,
    EtcdError,
    EtcdRequestError,
    EtcdTimeout,
    EtcdUnavailable,
    map_rpc_error,
)
from orchard.core.etcd.kv import KeyValue

_REQUIRE_LEADER = (("hasleader", "true"),)


class EventType(enum.Enum):
    """What happened to a key."""

    PUT = 0
    DELETE = 1


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change to one key, in revision order.

    For a DELETE, `kv` carries the key and the deleting revision and an empty value;
    `prev_kv` is the key before the change when the watch asked for it (and it was not
    compacted), else None.
    """

    type: EventType
    kv: KeyValue
    prev_kv: KeyValue | None

    @property
    def key(self) -> bytes:
        """The key that changed, without the store's namespace."""
        return self.kv.key

    @property
    def value(self) -> bytes:
        """The new value (empty for a DELETE)."""
        return self.kv.value

    @property
    def mod_revision(self) -> int:
        """The revision of this change."""
        return self.kv.mod_revision


class Watch:
    """A stream of changes under one key range, from a start revision on.

    Use as `async with store.watch_prefix(p, start_revision=r) as watch: async for event in
    watch: ...`. Entering returns once etcd has registered the watch, so every change after
    that point (and from `start_revision` on, if given) is delivered, in revision order.

    When the stream fails it raises `EtcdUnavailable`; open a new watch from
    `next_revision` to resume without loss. A start revision that has been compacted raises
    `CompactedRevision` from the first read (etcd creates the watch, then cancels it): list
    the range again and watch from the new revision.
    """

    def __init__(
        self,
        source: ConnectionSource,
        key: bytes,
        range_end: bytes,
        *,
        namespace_len: int,
        start_revision: int | None,
        prev_kv: bool,
        progress_notify: bool,
        create_timeout: float = 5.0,
    ) -> None:
        self._source = source
        self._create_timeout = create_timeout
        self._key = key
        self._range_end = range_end
        self._strip = namespace_len
        self._start_revision = start_revision
        self._prev_kv = prev_kv
        self._progress_notify = progress_notify
        self._call: Any = None
        self._connection: Connection | None = None
        self._pending: collections.deque[WatchEvent] = collections.deque()
        self._next_revision = start_revision or 0
        self._closed = False

    @property
    def next_revision(self) -> int:
        """The revision to resume from: one past the last event delivered (or the last
        progress notification), so a new watch from here misses and repeats nothing."""
        return self._next_revision

    async def __aenter__(self) -> Watch:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Register the watch with etcd; returns once etcd confirms it."""
        if self._call is not None:
            raise RuntimeError("watch already started")
        connection = self._source.current()
        create = rpc.WatchCreateRequest(
            key=self._key,
            range_end=self._range_end,
            start_revision=self._start_revision or 0,
            progress_notify=self._progress_notify,
            prev_kv=self._prev_kv,
        )
        self._connection = connection
        # Served only by a member that has a leader: one cut off from the others (or still
        # rejoining after a restart) ends the stream instead of holding it silent.
        self._call = connection.watch.Watch(metadata=_REQUIRE_LEADER)
        try:
            async with asyncio.timeout(self._create_timeout):
                await self._rpc(self._call.write(rpc.WatchRequest(create_request=create)))
                response = await self._read()
        except TimeoutError:
            await self.close()
            self._source.report_unavailable(connection)
            raise EtcdTimeout(
                f"etcd at {connection.endpoint} did not confirm a watch within "
                f"{self._create_timeout:g} s"
            ) from None
        except BaseException:
            await self.close()
            raise
        if not response.created:
            await self.close()
            raise EtcdRequestError(f"etcd answered a watch create without creating it: {response}")
        if response.compact_revision or response.canceled:
            await self.close()
            self._raise_canceled(response)
        if not self._start_revision:
            self._next_revision = response.header.revision + 1

    async def close(self) -> None:
        """Cancel the watch; iteration then stops. Safe to call more than once."""
        self._closed = True
        if self._call is not None:
            self._call.cancel()

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> WatchEvent:
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            if self._call is None:
                # Iterating a watch that was never started would end at once and look like
                # "no changes"; say what to do instead.
                raise EtcdError(
                    "watch not started: use `async with watch:` or `await watch.start()`"
                )
            response = await self._read()
            if response.compact_revision or response.canceled:
                await self.close()
                self._raise_canceled(response)
            if not response.events:
                # A progress notification: every change up to this revision was delivered.
                self._next_revision = max(self._next_revision, response.header.revision + 1)
            for event in response.events:
                self._pending.append(self._event(event))
        event = self._pending.popleft()
        self._next_revision = event.mod_revision + 1
        return event

    def _event(self, event: Any) -> WatchEvent:
        kind = EventType.DELETE if event.type == rpc.Event.DELETE else EventType.PUT
        prev = (
            KeyValue.from_proto(event.prev_kv, self._strip) if event.HasField("prev_kv") else None
        )
        return WatchEvent(kind, KeyValue.from_proto(event.kv, self._strip), prev)

    async def _read(self) -> Any:
        response = await self._rpc(self._call.read())
        if response is grpc.aio.EOF:
            connection = self._require_connection()
            self._source.report_unavailable(connection)
            raise EtcdUnavailable(f"etcd at {connection.endpoint} ended the watch stream")
        return response

    def _require_connection(self) -> Connection:
        if self._connection is None:
            raise RuntimeError("watch not started: use `async with` or call start()")
        return self._connection

    async def _rpc(self, step: Awaitable[Any]) -> Any:
        """Await one read or write of the stream, mapping its failures to typed errors."""
        connection = self._require_connection()
        try:
            return await step
        except grpc.aio.AioRpcError as e:
            error = map_rpc_error(e, connection.endpoint)
            if isinstance(error, EtcdUnavailable):
                self._source.report_unavailable(connection)
            raise error from e
        except asyncio.InvalidStateError:
            # gRPC refuses to write to a stream that already failed.
            self._source.report_unavailable(connection)
            raise EtcdUnavailable(
                f"the watch stream to etcd at {connection.endpoint} broke"
            ) from None
        except asyncio.CancelledError:
            # gRPC raises CancelledError from a call that was cancelled under us (our close(),
            # or the store closing its channel); only a cancelled task should see it as such.
            task = asyncio.current_task()
            if (task is not None and task.cancelling()) or not self._call.cancelled():
                raise
            if self._closed:
                raise StopAsyncIteration from None
            raise EtcdUnavailable(
                f"watch on etcd at {connection.endpoint} ended: the channel was closed"
            ) from None

    def _raise_canceled(self, response: Any) -> None:
        if response.compact_revision:
            raise CompactedRevision(
                f"cannot watch from revision {self._start_revision}: etcd has compacted "
                f"history up to {response.compact_revision}; re-list and watch from there",
                response.compact_revision,
            )
        raise EtcdError(f"etcd canceled the watch: {response.cancel_reason or 'no reason given'}")
