"""The rollout service's error reasons, and a job looked up or refused as NOT_FOUND."""

from __future__ import annotations

import datetime
import enum

import grpc

from orchard.core.errors import ErrorReason, OrchardError, Reason
from orchard.rollout.job_store import JobState, JobStore

__all__ = ["RolloutReason", "find_job", "invalid"]


@enum.unique
class RolloutReason(ErrorReason):
    """Reasons of the rollout service."""

    GROUPS_PAST_END = (
        grpc.StatusCode.OUT_OF_RANGE,
        "start_index is past the last group of a job that has ended.",
    )
    JOB_REMOVED = (
        grpc.StatusCode.NOT_FOUND,
        "The job ended and was removed with its groups after the service's retention.",
    )


def invalid(message: str) -> OrchardError:
    return OrchardError(Reason.INVALID_ARGUMENT, message)


def _when(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def find_job(jobs: JobStore, job_id: str) -> JobState:
    """The job; NOT_FOUND saying it was removed after the retention when it was."""
    if not job_id:
        raise invalid("job_id is empty")
    job = await jobs.get(job_id)
    if job is not None:
        return job
    removed = await jobs.removed(job_id)
    if removed is not None:
        raise OrchardError(
            RolloutReason.JOB_REMOVED,
            f"rollout job {job_id!r} ended ({removed.state}) at {_when(removed.ended_at)} and "
            f"was removed with its groups at {_when(removed.removed_at)}, after the service's "
            f"retention of {removed.retention_s:g} s (jobs.retention_s)",
        )
    raise OrchardError(Reason.NOT_FOUND, f"no rollout job {job_id!r}")
