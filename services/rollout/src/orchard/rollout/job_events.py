"""One etcd watch per process over the job store, fanned out to whoever waits on a job.

:class:`JobEvents` watches every key of the rollout namespace (jobs, groups, claims, cancels)
from one revision on, so a group written by any replica wakes the streams of its job at once,
and the scheduler hears of a dead replica's claims vanishing and of cancels as they happen.
A broken watch (etcd restarted, a member lost) is opened again from the revision it had
reached, so nothing is missed or repeated; a revision etcd has compacted meanwhile cannot be
resumed, so then every waiter and the listener are told to read the store again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Protocol

from orchard.core.etcd import CompactedRevision, EtcdError, EtcdStore, WatchEvent
from orchard.rollout.job_store import job_id_of
from orchard.rollout.metrics import RolloutMetrics

__all__ = ["JobEventListener", "JobEvents"]

log = logging.getLogger(__name__)

_RETRY_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0)


class JobEventListener(Protocol):
    """Told about every change, in revision order, on the event loop (must not block)."""

    def job_event(self, job_id: str, event: WatchEvent) -> None: ...

    def resynced(self) -> None: ...


class JobEvents:
    """The process's watch over the rollout namespace."""

    def __init__(self, store: EtcdStore, metrics: RolloutMetrics | None = None) -> None:
        self._store = store
        self._metrics = metrics
        self._listeners: list[JobEventListener] = []
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._watching = asyncio.Event()
        self.next_revision = 0
        """One past the last change delivered: where a broken watch resumes."""

    def listen(self, listener: JobEventListener) -> None:
        self._listeners.append(listener)

    async def start(self, from_revision: int = 0) -> None:
        """Starts watching from `from_revision` (0: now); returns once etcd registered the
        watch, so every change after this call is delivered."""
        self.next_revision = from_revision or await self._store.revision() + 1
        self._task = asyncio.create_task(self._run(), name="rollout-job-events")
        watching = asyncio.create_task(self._watching.wait())
        await asyncio.wait({self._task, watching}, return_when=asyncio.FIRST_COMPLETED)
        watching.cancel()
        if self._task.done():
            self._task.result()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._wake_all()

    def changed(self, job_id: str) -> asyncio.Future[None]:
        """A future done at the next change of the job (its record, a group, a cancel, its
        claim) or when the store must be read again; `forget` it when done waiting."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(job_id, set()).add(future)
        return future

    def forget(self, job_id: str, future: asyncio.Future[None]) -> None:
        waiters = self._waiters.get(job_id)
        if waiters is not None:
            waiters.discard(future)
            if not waiters:
                del self._waiters[job_id]

    def wake(self, job_id: str) -> None:
        """Wakes the job's waiters now (a change this process made; the watch repeats it)."""
        for future in self._waiters.pop(job_id, ()):
            if not future.done():
                future.set_result(None)

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                async with self._store.watch_prefix("", start_revision=self.next_revision) as w:
                    self._watching.set()
                    failures = 0
                    async for event in w:
                        self.next_revision = w.next_revision
                        self._deliver(event)
                    self.next_revision = max(self.next_revision, w.next_revision)
            except CompactedRevision:
                # What happened in the compacted stretch is lost: watch from now on, then
                # everyone reads the store (which holds at least what that stretch wrote).
                log.warning("job watch: revision %d compacted; reading again", self.next_revision)
                self.next_revision = await self._revision_now()
                self._counted("relisted")
                self._resync()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                # A call cut off by a channel switch: the watch must outlive it.
                await asyncio.sleep(_RETRY_S[0])
                self._counted("resumed")
            except EtcdError as exc:
                delay = _RETRY_S[min(failures, len(_RETRY_S) - 1)]
                failures += 1
                log.warning(
                    "job watch broke (%s); resuming from revision %d in %.2f s",
                    exc,
                    self.next_revision,
                    delay,
                )
                await asyncio.sleep(delay)
                self._counted("resumed")

    async def _revision_now(self) -> int:
        """One past the store's revision, retried while etcd is away."""
        attempt = 0
        while True:
            try:
                return await self._store.revision() + 1
            except EtcdError:
                await asyncio.sleep(_RETRY_S[min(attempt, len(_RETRY_S) - 1)])
                attempt += 1

    def _counted(self, how: str) -> None:
        if self._metrics is not None:
            self._metrics.job_watch_restarts.labels(how).inc()

    def _deliver(self, event: WatchEvent) -> None:
        job_id = job_id_of(event.kv.key_str)
        if job_id is None:
            return
        self.wake(job_id)
        for listener in self._listeners:
            _call(functools.partial(listener.job_event, job_id, event))

    def _resync(self) -> None:
        self._wake_all()
        for listener in self._listeners:
            _call(listener.resynced)

    def _wake_all(self) -> None:
        for job_id in list(self._waiters):
            self.wake(job_id)


def _call(function: Callable[[], None]) -> None:
    """A listener's failure is logged; the watch goes on."""
    try:
        function()
    except Exception:
        log.exception("job event listener failed")
