"""The recipe's side of orchard-rollout: rollout jobs driven over gRPC.

Evaluation, RL validation and the RL stage's sampling are rollout jobs: the recipe sends the
tasks (their SWE-bench instances as the reward service scores them), the harness, the sampler
and the policy (a weight version of the run's student in the registry, which the service loads
on a local engine behind its capture proxy), and reads back the scored groups, whose
trajectories carry the captured tokens. A job the recipe stops using (an interruption, enough
groups for an RL step) is cancelled, and the service deletes its sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from orchard.recipes.connection import ServiceConnection, ServiceError
from orchard.rollout.v1 import rollout_service_pb2 as api
from orchard.rollout.v1 import rollout_service_pb2_grpc as rpc
from orchard.types.v1 import trajectory_pb2

__all__ = ["RolloutError", "RolloutJobs"]

_ENDED = {
    api.ROLLOUT_JOB_STATE_SUCCEEDED,
    api.ROLLOUT_JOB_STATE_FAILED,
    api.ROLLOUT_JOB_STATE_CANCELLED,
}


class RolloutError(ServiceError):
    """orchard-rollout refused a job or the job failed; the message says which and why."""


Progress = Callable[[api.RolloutJob], None]
Enough = Callable[[list[trajectory_pb2.TrajectoryGroup]], bool]


@dataclass
class RolloutJobs(ServiceConnection):
    """A connection to orchard-rollout at ``address`` (HOST:PORT)."""

    service = "orchard-rollout"
    error = RolloutError
    poll_interval_s: float = 1.0
    """How often `run` reads the job's counters for `progress`."""

    def stub(self, channel: grpc.aio.Channel) -> Any:
        return rpc.RolloutServiceStub(channel)

    async def create(self, spec: api.RolloutJobSpec, request_id: str) -> api.RolloutJob:
        response = await self._retried(
            "CreateRolloutJob",
            lambda: self._stub.CreateRolloutJob(
                api.CreateRolloutJobRequest(spec=spec, request_id=request_id)
            ),
        )
        job: api.RolloutJob = response.job
        return job

    async def harnesses(self) -> dict[str, api.Harness]:
        """The harnesses the service drives, by name (ListHarnesses)."""
        response = await self._retried(
            "ListHarnesses", lambda: self._stub.ListHarnesses(api.ListHarnessesRequest())
        )
        return {harness.name: harness for harness in response.harnesses}

    async def get(self, job_id: str) -> api.RolloutJob:
        response = await self._retried(
            "GetRolloutJob",
            lambda: self._stub.GetRolloutJob(api.GetRolloutJobRequest(job_id=job_id)),
        )
        job: api.RolloutJob = response.job
        return job

    async def cancel(self, job_id: str) -> api.RolloutJob:
        response = await self._retried(
            "CancelRolloutJob",
            lambda: self._stub.CancelRolloutJob(api.CancelRolloutJobRequest(job_id=job_id)),
        )
        job: api.RolloutJob = response.job
        return job

    async def run(
        self,
        spec: api.RolloutJobSpec,
        request_id: str,
        *,
        progress: Progress | None = None,
        enough: Enough | None = None,
    ) -> tuple[api.RolloutJob, list[trajectory_pb2.TrajectoryGroup]]:
        """Runs a job to its end and returns it with its groups in emission order; `progress`
        sees the job's counters as they change. When `enough` says the groups so far suffice,
        the job is cancelled and what it emitted is returned. Raises RolloutError when the job
        fails; a job left by an error or a cancel of the caller is cancelled."""
        job = await self.create(spec, request_id)
        groups: list[trajectory_pb2.TrajectoryGroup] = []
        watcher = asyncio.create_task(self._watch(job.id, progress)) if progress else None
        ended = False
        try:
            await self._stream(job.id, groups, enough)
            job = await self.get(job.id)
            if job.state not in _ENDED:
                job = await self.cancel(job.id)
            ended = True
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError, ServiceError):
                    await watcher
            if not ended:
                with contextlib.suppress(ServiceError):
                    await asyncio.shield(self.cancel(job.id))
        if progress is not None:
            progress(job)
        if job.state == api.ROLLOUT_JOB_STATE_FAILED:
            raise RolloutError(f"rollout job {job.id} failed: {job.error or 'no reason given'}")
        return job, groups

    async def _stream(
        self, job_id: str, groups: list[trajectory_pb2.TrajectoryGroup], enough: Enough | None
    ) -> None:
        """Appends the job's groups to `groups` until the job ends or `enough` says so. A
        stream the service breaks off as UNAVAILABLE (a restart, its state store slow to
        answer) is opened again from the first group not yet read."""
        attempt = 0
        while True:
            request = api.StreamGroupsRequest(job_id=job_id, start_index=len(groups))
            call = self._stub.StreamGroups(request)
            try:
                async for message in call:
                    groups.append(message.group)
                    attempt = 0
                    if enough is not None and enough(groups):
                        return
                return
            except grpc.aio.AioRpcError as exc:
                await self._again(f"StreamGroups of job {job_id}", exc, attempt)
                attempt += 1
            finally:
                call.cancel()

    async def _watch(self, job_id: str, progress: Progress) -> None:
        while True:
            progress(await self.get(job_id))
            await asyncio.sleep(self.poll_interval_s)
