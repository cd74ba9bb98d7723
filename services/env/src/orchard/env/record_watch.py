"""One etcd watch per process over every record, fanned out to in-memory waiters.

:class:`RecordWatcher` keeps a mirror of every sandbox record and creating key (a snapshot at
revision R, then every change from R + 1: no gap), wakes the WaitSandbox calls waiting on a key
and tells its listener about each change. A broken watch resumes from the next revision; a
compacted one lists again and wakes every waiter, which then reads the mirror again.

The mirror is what reads are served from (``record_store.RecordStore``): it also indexes
records by sandbox id and holds the queued ones apart, so no read scans every record. A write
this replica made may be :meth:`~RecordWatcher.offer` ed before its event arrives, so a read
right after the write sees it; its event (and any older one still on its way) then changes
nothing and is not even decoded.
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
from orchard.env.records import (
    CREATING,
    OWNER_REQUESTS,
    REQUESTS,
    SANDBOXES,
    SLOTS,
    SandboxRecord,
    parse_sandbox_key,
)
from orchard.env.v1 import env_pb2

__all__ = ["RecordListener", "RecordWatcher"]

log = logging.getLogger(__name__)

PENDING = env_pb2.SANDBOX_STATE_PENDING
_REQUEST_PREFIXES = (REQUESTS, OWNER_REQUESTS)
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
        self.by_id: dict[str, str] = {}  # sandbox id → key
        self.queued: dict[str, SandboxRecord] = {}  # key → PENDING record in the admission queue
        self.creating: dict[str, str] = {}  # key → replica id
        self.requests: dict[str, str] = {}  # request-id key → what it made
        # Keys this replica deleted ahead of the watch → the deleting revision: the watch's
        # events for them up to that revision are already accounted for.
        self._gone: dict[str, int] = {}
        self._at: list[tuple[int, asyncio.Future[None]]] = []  # waiting for a revision
        # The revision of the last change applied (or of the snapshot): the mirror is current
        # up to it.
        self.revision = 0
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

    async def reached(self, revision: int) -> None:
        """Return once the mirror holds every change up to ``revision``."""
        if self.revision >= revision:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._at.append((revision, future))
        try:
            await future
        finally:
            if not future.done():
                future.cancel()
            self._at = [(r, f) for r, f in self._at if f is not future]

    def _advance(self, revision: int) -> None:
        self.revision = max(self.revision, revision)
        if self._at:
            for wanted, future in self._at:
                if wanted <= self.revision and not future.done():
                    future.set_result(None)

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
                    # No prev_kv: the mirror already holds every value a change replaces.
                    async with self._store.list_and_watch("") as (snapshot, watch):
                        self._load(snapshot.kvs, snapshot.revision)
                        failures = 0
                        next_revision = snapshot.revision + 1
                        async for event in watch:
                            self._apply(event)
                            next_revision = watch.next_revision
                else:
                    async with self._store.watch_prefix("", start_revision=next_revision) as watch:
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

    def offer(self, record: SandboxRecord) -> tuple[bool, SandboxRecord | None]:
        """Put a record this replica just wrote (at ``record.mod_revision``) into the mirror
        ahead of its event: ``(whether it was taken, the record it replaced)``; not taken
        when the watch is already past that revision (its event, and maybe later ones, are
        applied)."""
        key = record.key
        previous = self.records.get(key)
        if record.mod_revision <= self.revision or (
            previous is not None and previous.mod_revision >= record.mod_revision
        ):
            return False, previous
        self._put(key, record)
        self._wake(key)
        return True, previous

    def offer_deletion(self, key: str, revision: int) -> tuple[bool, SandboxRecord | None]:
        """Drop a record this replica deleted at ``revision`` ahead of its event:
        ``(whether it was dropped, the record dropped)``; not when the watch is past it."""
        if revision <= self.revision:
            return False, None
        self._gone[key] = revision
        previous = self._pop(key)
        self._wake(key)
        return True, previous

    def _put(self, key: str, record: SandboxRecord) -> None:
        self.records[key] = record
        self.by_id[record.id] = key
        if record.queued and record.state == PENDING:
            self.queued[key] = record
        else:
            self.queued.pop(key, None)

    def _pop(self, key: str) -> SandboxRecord | None:
        record = self.records.pop(key, None)
        self.queued.pop(key, None)
        if record is not None and self.by_id.get(record.id) == key:
            del self.by_id[record.id]
        return record

    def _load(self, kvs: list[KeyValue], revision: int) -> None:
        self.records.clear()
        self.by_id.clear()
        self.queued.clear()
        self.creating.clear()
        self.requests.clear()
        self._gone.clear()
        for kv in kvs:
            key = kv.key_str
            if key.startswith(SANDBOXES):
                self._put(key, SandboxRecord.from_kv(kv))
            elif key.startswith(CREATING):
                self.creating[key] = kv.value_str
            elif key.startswith(_REQUEST_PREFIXES):
                self.requests[key] = kv.value_str
        self.revision = 0
        self._advance(revision)
        self._synced.set()
        self._wake_all()
        self._listener.resynced()

    def _apply(self, event: WatchEvent) -> None:
        key = event.kv.key_str
        self._advance(event.kv.mod_revision)
        if len(self._gone) > 256:  # deletions whose own event never came (the key was gone)
            self._gone = {k: r for k, r in self._gone.items() if r > self.revision}
        gone = self._gone.get(key)
        if gone is not None:
            # Deleted here already: skip the changes up to that deletion, told of before.
            if event.kv.mod_revision >= gone:
                del self._gone[key]
            if event.kv.mod_revision <= gone:
                return
        if key.startswith(SANDBOXES):
            if event.type is EventType.PUT:
                previous = self.records.get(key)
                if previous is not None and previous.mod_revision >= event.kv.mod_revision:
                    return  # offered by this replica already, at this revision or a later one
                record = SandboxRecord.from_kv(event.kv)
                self._put(key, record)
                self._listener.record_changed(record, previous)
            else:
                previous = self._pop(key)
                parsed = parse_sandbox_key(key)
                if parsed is not None:
                    self._listener.record_deleted(previous, *parsed)
            self._wake(key)
        elif key.startswith(CREATING):
            if event.type is EventType.PUT:
                self.creating[key] = event.kv.value_str
            else:
                replica = self.creating.pop(key, "")
                parsed = parse_sandbox_key(key)
                if parsed is not None:
                    self._listener.creating_deleted(*parsed, replica)
        elif key.startswith(_REQUEST_PREFIXES):
            if event.type is EventType.PUT:
                self.requests[key] = event.kv.value_str
            else:
                self.requests.pop(key, None)
        elif key.startswith(SLOTS) and event.type is EventType.DELETE:
            self._listener.slot_released()

    def _wake(self, key: str) -> None:
        for future in self._waiters.pop(key, ()):
            if not future.done():
                future.set_result(None)

    def _wake_all(self) -> None:
        for key in list(self._waiters):
            self._wake(key)
