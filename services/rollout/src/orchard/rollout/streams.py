"""Group streaming: a job's groups from an index on, as they are written, by any replica.

A stream reads the groups it has not sent from the store, then waits for the job's next
change on the process's etcd watch (:class:`orchard.rollout.job_events.JobEvents`): a group
written by any replica reaches it as soon as etcd delivers the write. A slow re-read
(`recheck_s`) is the safety net should a wake-up ever be lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from orchard.core.errors import OrchardError
from orchard.rollout.errors import RolloutReason, find_job, invalid
from orchard.rollout.job_events import JobEvents
from orchard.rollout.job_store import JobStore
from orchard.rollout.v1 import rollout_service_pb2 as api

__all__ = ["GroupStreams"]


class GroupStreams:
    """`StreamGroups`: scored groups from `start_index`, ending when the job ends."""

    def __init__(self, jobs: JobStore, events: JobEvents, *, recheck_s: float = 30.0) -> None:
        self.jobs = jobs
        self.events = events
        self.recheck_s = recheck_s

    async def stream(
        self, job_id: str, start_index: int
    ) -> AsyncIterator[api.StreamGroupsResponse]:
        if start_index < 0:
            raise invalid(f"start_index must not be negative, got {start_index}")
        job = await find_job(self.jobs, job_id)
        if job.ended and start_index > job.groups_emitted:
            raise OrchardError(
                RolloutReason.GROUPS_PAST_END,
                f"start_index {start_index} is past the end of job {job_id}: it emitted "
                f"{job.groups_emitted} groups",
            )
        next_index = start_index
        while True:
            # Waiting starts before the reads: a change between them still wakes this stream.
            changed = self.events.changed(job_id)
            try:
                job = await find_job(self.jobs, job_id)
                for index, group in await self.jobs.groups(job_id, next_index):
                    yield api.StreamGroupsResponse(index=index, group=group)
                    next_index = index + 1
                if job.ended and next_index >= job.groups_emitted:
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.recheck_s):
                        await changed
            finally:
                self.events.forget(job_id, changed)
