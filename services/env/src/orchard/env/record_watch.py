"""One etcd watch per process over every record, fanned out to in-memory waiters.

:class:`RecordWatcher` keeps a mirror of every sandbox record and creating key (a snapshot at
revision R, then every change from R + 1: no gap), wakes the WaitSandbox calls waiting on a key
and tells its listener about each change. A broken watch resumes from the next revision; a
compacted one lists again and wakes every waiter, which then re-reads the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

from orchard.core.etcd import (
    CompactedRevision,
    EtcdError,
    EtcdStore,
    EventType,
    KeyValue,
    WatchEvent,
)
from orchard.env.records import CREATING, SANDBOXES, SLOTS, SandboxRecord, parse_sandbox_key

__all__ = ["RecordListener", "RecordWatcher"]

log = logging.getLogger(__name__)

_RETRY_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0)


class RecordListener(Protocol):
    """Told about every change, in revision order, on the event loop (must not block)."""

    def record_changed(self, record: SandboxRecord, previous: SandboxRecord | None) -> None: ...

    def record_deleted(
        self, previous: SandboxRecord | None, tenant: str, sandbox_id: str
    ) -> None: ...

    def creating_deleted(self, tenant: str, sandbox_id: str, replica: str) -> None: ...

    def slot_released(self) -> None: ...

    def resynced(self) -> None: ...


class RecordWatcher:
    """The process's one watch over ``sandboxes/`` and ``creating/`` (and admission slots
    being released)."""

    def __init__(self, store: EtcdStore, listener: RecordListener) -> None:
        self._store = store
        self._listener = listener
        self.records: dict[str, SandboxRecord] = {}  # key → record
        self.creating: dict[str, str] = {}  # key → replica id
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()

    async def start(self) -> None:
        """Start watching; returns once the first snapshot is loaded."""
        self._task = asyncio.create_task(self._run(), name="record-watch")
        synced = asyncio.create_task(self._synced.wait())
        await asyncio.wait({self._task, synced}, return_when=asyncio.FIRST_COMPLETED)
        synced.cancel()
        if self._task.done():
            self._task.result()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._wake_all()

    def changed(self, key: str) -> asyncio.Future[None]:
        """A future that completes at the next change of ``key`` (or a resync)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, set()).add(future)
        return future

    def forget(self, key: str, future: asyncio.Future[None]) -> None:
        waiters = self._waiters.get(key)
        if waiters is not None:
            waiters.discard(future)
            if not waiters:
                del self._waiters[key]

    async def _run(self) -> None:
        next_revision: int | None = None
        failures = 0
        while True:
            try:
                if next_revision is None:
                    async with self._store.list_and_watch("", prev_kv=True) as (snapshot, watch):
                        self._load(snapshot.kvs)
                        failures = 0
                        next_revision = snapshot.revision + 1
                        async for event in watch:
                            self._apply(event)
                            next_revision = watch.next_revision
                else:
                    async with self._store.watch_prefix(
                        "", start_revision=next_revision, prev_kv=True
                    ) as watch:
                        failures = 0
                        async for event in watch:
                            self._apply(event)
                            next_revision = watch.next_revision
            except CompactedRevision:
                log.warning("record watch compacted; listing again")
                next_revision = None
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                # A call cut off by a channel switch: the watch must outlive it, never end.
                log.warning("record watch cut off by a closed etcd channel; resuming")
                await asyncio.sleep(_RETRY_S[0])
            except EtcdError as exc:
                delay = _RETRY_S[min(failures, len(_RETRY_S) - 1)]
                failures += 1
                log.warning("record watch broke (%s); resuming in %.2f s", exc, delay)
                await asyncio.sleep(delay)
            except Exception:
                log.exception("record watch listener failed; listing again")
                next_revision = None
                await asyncio.sleep(0.1)

    def _load(self, kvs: list[KeyValue]) -> None:
        self.records.clear()
        self.creating.clear()
        for kv in kvs:
            key = kv.key_str
            if key.startswith(SANDBOXES):
                self.records[key] = SandboxRecord.from_kv(kv)
            elif key.startswith(CREATING):
                self.creating[key] = kv.value_str
        self._synced.set()
        self._wake_all()
        self._listener.resynced()

    def _apply(self, event: WatchEvent) -> None:
        key = event.kv.key_str
        if key.startswith(SANDBOXES):
            if event.type is EventType.PUT:
                record = SandboxRecord.from_kv(event.kv)
                previous = self.records.get(key)
                self.records[key] = record
                self._listener.record_changed(record, previous)
            else:
                previous = self.records.pop(key, None)
                if previous is None and event.prev_kv is not None:
                    previous = SandboxRecord.from_kv(event.prev_kv)
                parsed = parse_sandbox_key(key)
                if parsed is not None:
                    self._listener.record_deleted(previous, *parsed)
            self._wake(key)
        elif key.startswith(CREATING):
            if event.type is EventType.PUT:
                self.creating[key] = event.kv.value_str
            else:
                replica = self.creating.pop(key, "")
                if not replica and event.prev_kv is not None:
                    replica = event.prev_kv.value_str
                parsed = parse_sandbox_key(key)
                if parsed is not None:
                    self._listener.creating_deleted(*parsed, replica)
        elif key.startswith(SLOTS) and event.type is EventType.DELETE:
            self._listener.slot_released()

    def _wake(self, key: str) -> None:
        for future in self._waiters.pop(key, ()):
            if not future.done():
                future.set_result(None)

    def _wake_all(self) -> None:
        for key in list(self._waiters):
            self._wake(key)
