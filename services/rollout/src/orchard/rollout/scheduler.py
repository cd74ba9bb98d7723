"""The scheduler: which replica runs which job, and how long ended jobs stay.

Each replica holds one etcd lease; a job runs in the replica whose claim (``owners/<id>``,
on that lease) it holds. The scheduler reacts to the process's job watch
(:class:`orchard.rollout.job_events.JobEvents`): a claim that vanishes (its replica stopped,
or died and its lease ran out) makes every replica try to claim the job, and the one that wins
adopts it; a cancel written through any replica stops the job where it runs. A slow re-read of
every job (`recheck_s`) is the safety net under the watch; a sweep removes ended jobs, with
their groups, once they are older than the retention.

A replica whose lease is lost (etcd away longer than the lease's TTL, or the process too busy to
refresh it in time) takes a new one and claims its running jobs again on it; a job another
replica claimed meanwhile stops here (that one runs it). Without that, every later job of the
replica would fail on a lease that no longer exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Coroutine
from typing import Any, Protocol

from orchard.core.etcd import EtcdError, EventType, Lease, LeaseKeepAlive, WatchEvent
from orchard.rollout.job_events import JobEvents
from orchard.rollout.job_store import CANCELS, JOBS, OWNERS, JobState, JobStore
from orchard.rollout.metrics import RolloutMetrics
from orchard.rollout.v1 import rollout_service_pb2 as api

__all__ = ["JobLauncher", "JobScheduler"]

log = logging.getLogger(__name__)

Work = Coroutine[Any, Any, None]


class JobLauncher(Protocol):
    """What turns a claimed job into work (the service's wiring)."""

    async def resume(self, job: JobState) -> Work | None:
        """A job adopted from a replica that is gone: what runs it from where it stopped, or
        None when it was ended instead (it cannot resume here)."""
        ...


class JobScheduler:
    """This replica's claims, its running jobs, adoption and retention."""

    def __init__(
        self,
        jobs: JobStore,
        events: JobEvents,
        launcher: JobLauncher,
        metrics: RolloutMetrics,
        *,
        lease_ttl_s: int = 10,
        recheck_s: float = 30.0,
        retention_s: float = 0.0,
        sweep_interval_s: float = 600.0,
        owner: str | None = None,
    ) -> None:
        self.jobs = jobs
        self.events = events
        self.launcher = launcher
        self.metrics = metrics
        self.owner = owner or uuid.uuid4().hex
        self.lease_ttl_s = lease_ttl_s
        self.recheck_s = recheck_s
        self.retention_s = retention_s
        self.sweep_interval_s = sweep_interval_s
        self._lease: Lease | None = None
        self._keepalive: LeaseKeepAlive | None = None
        self._renewing = asyncio.Lock()
        self._unclaimed: set[str] = set()
        """Jobs running here whose claim a lease renewal could not put back yet."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._checks: asyncio.Queue[str | None] = asyncio.Queue()
        self._loops: list[asyncio.Task[None]] = []
        self._closing = False

    # -- lifetime --------------------------------------------------------------------------

    async def open(self) -> None:
        """Takes this replica's lease, adopts the jobs no live replica holds (a restart's),
        then follows the watch. Start `events` first: nothing between them is missed."""
        store = self.jobs.store
        self._lease = await store.grant_lease(self.lease_ttl_s)
        self._keepalive = store.keep_alive(self._lease)
        self.events.listen(self)
        await self.recheck()
        self._loops = [
            asyncio.create_task(self._lease_loop(), name="rollout-scheduler-lease"),
            asyncio.create_task(self._check_loop(), name="rollout-scheduler-checks"),
            asyncio.create_task(self._recheck_loop(), name="rollout-scheduler-recheck"),
        ]
        if self.retention_s > 0:
            self._loops.append(
                asyncio.create_task(self._sweep_loop(), name="rollout-scheduler-retention")
            )

    async def close(self) -> None:
        """Stops this replica's jobs without ending them and gives up its claims at once (the
        next replica, or this one restarted, adopts them)."""
        self._closing = True
        for loop in self._loops:
            loop.cancel()
        for loop in self._loops:
            with contextlib.suppress(asyncio.CancelledError):
                await loop
        self._loops = []
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._lease is not None:
            with contextlib.suppress(Exception):
                await self.jobs.store.revoke_lease(self._lease)
            self._lease = None

    # -- running jobs ----------------------------------------------------------------------

    @property
    def running(self) -> frozenset[str]:
        """The jobs running in this replica now."""
        return frozenset(self._tasks)

    @property
    def lease_id(self) -> int:
        """This replica's lease: its claims live on it."""
        assert self._lease is not None, "open() the scheduler first"
        return self._lease.id

    async def renew_lease(self, lost: int) -> None:
        """Replaces the lease ``lost`` (found gone by a call that used it) with a new one and
        claims this replica's running jobs on it; nothing when it was replaced already."""
        async with self._renewing:
            if self._lease is None or self._lease.id != lost or self._closing:
                return
            store = self.jobs.store
            delay = 0.1
            while not self._closing:
                try:
                    lease = await store.grant_lease(self.lease_ttl_s)
                except EtcdError as exc:
                    log.warning("could not take a new lease yet: %s", exc)
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 5.0)
                    continue
                old = self._keepalive
                self._lease, self._keepalive = lease, store.keep_alive(lease)
                if old is not None:
                    await old.stop()
                break
            kept, lost_jobs = await self._reclaim()
            self.metrics.lease_renewals.inc()
            log.info(
                "took a new lease",
                extra={"lease": f"{self.lease_id:x}", "jobs_kept": kept, "jobs_lost": lost_jobs},
            )

    async def _reclaim(self) -> tuple[int, int]:
        """Claims this replica's running jobs on its new lease (their claims went with the old
        one); a job another replica holds now stops here."""
        kept = lost = 0
        for job_id, task in list(self._tasks.items()):
            if task.done():
                continue
            try:
                mine = await self.claim(job_id)
            except EtcdError as exc:
                log.warning(
                    "could not claim job %s again yet (the re-check tries): %s", job_id, exc
                )
                self._unclaimed.add(job_id)
                continue
            self._unclaimed.discard(job_id)
            if mine:
                kept += 1
            else:
                lost += 1
                self._cancel_here(job_id, "claimed by another replica while this one had no lease")
        return kept, lost

    async def _lease_loop(self) -> None:
        while True:
            keepalive, lease = self._keepalive, self._lease
            assert keepalive is not None and lease is not None
            with contextlib.suppress(EtcdError):
                await keepalive.wait()
            if self._closing:
                return
            if self._lease is lease:
                log.error("this replica's lease was lost; taking a new one")
                await self.renew_lease(lease.id)

    async def claim(self, job_id: str) -> bool:
        """Makes this replica the job's runner unless another live one is."""
        assert self._lease is not None, "open() the scheduler first"
        return await self.jobs.claim(job_id, self.owner, self._lease.id)

    def start(self, job_id: str, work: Work) -> None:
        """Runs a job this replica claimed."""
        task = asyncio.create_task(work, name=f"rollout-job-{job_id}")
        self._tasks[job_id] = task
        self.metrics.jobs_running.inc()
        task.add_done_callback(lambda _: self._ended(job_id))

    def _ended(self, job_id: str) -> None:
        self._tasks.pop(job_id, None)
        self._unclaimed.discard(job_id)
        self.metrics.jobs_running.dec()

    async def stop(self, job_id: str) -> bool:
        """Stops the job's run here, if it runs here; True when it did."""
        task = self._tasks.get(job_id)
        if task is None:
            return False
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return True

    # -- events ----------------------------------------------------------------------------

    def job_event(self, job_id: str, event: WatchEvent) -> None:
        key = event.kv.key_str
        if key.startswith(OWNERS) and event.type is EventType.DELETE:
            if not self._closing and job_id not in self._tasks:
                self._checks.put_nowait(job_id)
        elif key.startswith(CANCELS) and event.type is EventType.PUT:
            self._cancel_here(job_id, "cancelled")
        elif key.startswith(JOBS) and event.type is EventType.DELETE:
            self._cancel_here(job_id, "removed")

    def resynced(self) -> None:
        if not self._closing:
            self._checks.put_nowait(None)

    def _cancel_here(self, job_id: str, why: str) -> None:
        task = self._tasks.get(job_id)
        if task is not None and not task.done():
            log.info("job %s %s: its run here stops", job_id, why)
            task.cancel()

    async def _check_loop(self) -> None:
        while True:
            job_id = await self._checks.get()
            try:
                if job_id is None:
                    await self.recheck()
                else:
                    await self._check(job_id)
            except EtcdError as exc:
                log.warning("checking jobs failed (the next re-check retries): %s", exc)
            except Exception:
                log.exception("checking jobs failed")

    async def _recheck_loop(self) -> None:
        while True:
            await asyncio.sleep(self.recheck_s)
            self._checks.put_nowait(None)

    async def recheck(self) -> None:
        """Reads every job: adopts the running ones no live replica holds and stops the runs
        here of jobs cancelled elsewhere (a run's own end is its own to finish)."""
        for job in await self.jobs.all():
            if job.id in self._tasks:
                if job.state == api.ROLLOUT_JOB_STATE_CANCELLED:
                    self._cancel_here(job.id, "cancelled")
                elif job.id in self._unclaimed:
                    self._unclaimed.discard(job.id)
                    if not await self.claim(job.id):
                        self._cancel_here(job.id, "claimed by another replica")
            elif not job.ended:
                await self._adopt(job)

    async def _check(self, job_id: str) -> None:
        if job_id in self._tasks:
            return
        job = await self.jobs.get(job_id)
        if job is not None and not job.ended:
            await self._adopt(job)

    async def _adopt(self, job: JobState) -> None:
        if self._closing or job.id in self._tasks or not await self.claim(job.id):
            return
        self.metrics.jobs_adopted.inc()
        log.info("adopting job %s", job.id)
        work = await self.launcher.resume(job)
        if work is not None:
            self.start(job.id, work)

    # -- retention -------------------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        while True:
            try:
                await self.sweep()
            except EtcdError as exc:
                log.warning("removing ended jobs failed (retried): %s", exc)
            except Exception:
                log.exception("removing ended jobs failed")
            await asyncio.sleep(self.sweep_interval_s)

    async def sweep(self, now: float | None = None) -> int:
        """Removes the jobs that ended more than the retention ago, with their groups; any
        replica may run it at any time (a removal is one conditional transaction). Returns how
        many this call removed."""
        if self.retention_s <= 0:
            return 0
        now = time.time() if now is None else now
        cutoff = now - self.retention_s
        removed = 0
        for stored in await self.jobs.stored():
            job = stored.job
            if not job.ended or job.update_time > cutoff or job.id in self._tasks:
                continue
            if await self.jobs.remove(stored, self.retention_s):
                removed += 1
                self.metrics.jobs_removed.inc()
                log.info("job %s removed: it ended more than %g s ago", job.id, self.retention_s)
        await self.jobs.forget_removed(cutoff)
        return removed
