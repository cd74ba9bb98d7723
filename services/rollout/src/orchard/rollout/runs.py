"""Running a rollout job to its end, and its groups as the consumer sees them.

A job's state lives in the job store (:mod:`orchard.rollout.job_store`, re-exported here):
after a restart the job resumes with the pairs not yet done (their rollouts in flight at the
restart are lost and the pair is sampled again from the start), and consumers resume
`StreamGroups` at the index they stopped at.

A rollout whose worker process was lost (`orchard.rollout.workers.WorkerLost`) is tried again as
a new rollout, up to `worker_attempts` tries; then it is excluded with the reason. Every try
counts in `rollouts_started`, so started minus done is the number of lost tries, and a retried
rollout's trajectories name the tries it replaced (metadata ``lost_attempts``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from orchard.rollout.batches import GroupFilter
from orchard.rollout.job_store import (
    CANCELS,
    ENDED,
    GROUPS,
    JOBS,
    OWNERS,
    REQUESTS,
    STATE_NAMES,
    JobCancelled,
    JobState,
    JobStore,
    group_key,
    new_job_id,
)
from orchard.rollout.metrics import RolloutMetrics
from orchard.rollout.provenance import FailureLayer, InfraFailure, RolloutRecord
from orchard.rollout.results import GroupKey, RolloutResult, RolloutStatus, RunRollout
from orchard.rollout.samplers import SampledGroup, Sampler
from orchard.rollout.trajectory_tree import build_tree, tree_trajectories
from orchard.rollout.v1 import rollout_service_pb2 as api
from orchard.rollout.workers import WorkerLost
from orchard.types.v1 import reward_pb2, trajectory_pb2

__all__ = [
    "CANCELS",
    "ENDED",
    "GROUPS",
    "JOBS",
    "OWNERS",
    "REQUESTS",
    "STATE_NAMES",
    "JobCancelled",
    "JobRun",
    "JobState",
    "JobStore",
    "group_key",
    "group_proto",
    "new_job_id",
    "pair_name",
]

log = logging.getLogger(__name__)


def pair_name(key: GroupKey) -> str:
    return f"{key.task_id}\x1f{key.harness}"


# -- groups as the consumer sees them -------------------------------------------------------

_OUTCOMES = {
    "step_limit": trajectory_pb2.TRAJECTORY_OUTCOME_STEP_LIMIT,
    "token_limit": trajectory_pb2.TRAJECTORY_OUTCOME_TOKEN_LIMIT,
    "time_limit": trajectory_pb2.TRAJECTORY_OUTCOME_TIME_LIMIT,
}


def _outcome(record: RolloutRecord) -> trajectory_pb2.TrajectoryOutcome.ValueType:
    if record.status is RolloutStatus.ABORTED:
        return trajectory_pb2.TRAJECTORY_OUTCOME_ABORTED
    return _OUTCOMES.get(record.outcome, trajectory_pb2.TRAJECTORY_OUTCOME_COMPLETED)


def _reward(record: RolloutRecord, discard_reason: str) -> reward_pb2.Reward:
    if record.status is RolloutStatus.ABORTED or record.reward is None:
        failure = record.failure
        return reward_pb2.Reward(
            status=reward_pb2.REWARD_STATUS_EXCLUDED,
            exclusion=reward_pb2.EXCLUSION_REASON_ABORTED,
            detail=(
                f"{failure.layer.value}: {failure.error}"
                if failure is not None
                else "aborted without a recorded failure"
            ),
        )
    reward = reward_pb2.Reward(
        status=reward_pb2.REWARD_STATUS_SCORED,
        value=record.reward.value,
        detail=record.reward.detail,
        scorer=record.reward.scorer,
        evidence=[
            reward_pb2.Evidence(title=e.title, text=e.text, turn_index=-1)
            for e in record.reward.evidence
        ],
    )
    if discard_reason:
        reward.status = reward_pb2.REWARD_STATUS_EXCLUDED
        reward.exclusion = reward_pb2.EXCLUSION_REASON_OTHER
        reward.detail = f"trajectory tree discarded: {discard_reason}"
    return reward


def _teacher_rollout(record: RolloutRecord) -> bool:
    """Every call of the rollout was answered by a scripted teacher (`ScriptedEngine`)."""
    return all(call.weight_version.startswith("scripted:") for call in record.calls)


def group_proto(
    job_id: str, sampled: SampledGroup, lost: Mapping[str, Sequence[str]] | None = None
) -> trajectory_pb2.TrajectoryGroup:
    """The sampled group with its trajectories rebuilt from the captured calls; advantages are
    reward minus the mean reward of the group's scored members (0 for excluded ones). `lost`:
    per rollout id, the tries it replaced (their workers were lost)."""
    key = sampled.key
    scored = [m.reward for m in sampled.members if m.reward is not None]
    mean = statistics.fmean(scored) if scored else 0.0
    group = trajectory_pb2.TrajectoryGroup(
        id=f"{job_id}/{key.task_id}/{key.harness}",
        task_id=key.task_id,
        harness=key.harness,
        sampler=f"{sampled.sampler}:{sampled.choice.value}",
        positive_fraction=sampled.positive_fraction,
        rollouts_run=len(sampled.rollouts),
        no_signal_reason=GroupFilter().drop_reason(sampled),
    )
    for member in sampled.members:
        record: RolloutRecord = member.payload
        discard = ""
        if record.calls:
            tree = build_tree(record.calls)
            discard = tree.discard_reason
            trajectories = tree_trajectories(
                tree, task_id=key.task_id, harness=key.harness, outcome=_outcome(record)
            )
            if record.messages_complete and _teacher_rollout(record):
                # A teacher's turns are in the built-in tokenizer; its conversation lets a
                # student of any tokenizer train on it (the trainer renders it).
                for trajectory in trajectories:
                    if "branch" not in trajectory.metadata:
                        trajectory.conversation_json = json.dumps(record.messages)
        else:
            # Not captured (an endpoint policy): the conversation stands in for the turns.
            trajectories = [
                trajectory_pb2.Trajectory(
                    id=f"{record.rollout_id}/0",
                    rollout_id=record.rollout_id,
                    task_id=key.task_id,
                    harness=key.harness,
                    outcome=_outcome(record),
                    conversation_json=json.dumps(record.messages) if record.messages else "",
                )
            ]
        reward = _reward(record, discard)
        for trajectory in trajectories:
            trajectory.group_id = group.id
            trajectory.reward.CopyFrom(reward)
            trained = (
                reward.status == reward_pb2.REWARD_STATUS_SCORED
                and "branch" not in trajectory.metadata
            )
            trajectory.advantage = reward.value - mean if trained else 0.0
            trajectory.metadata["status"] = record.status.value
            trajectory.metadata["outcome"] = record.outcome
            trajectory.metadata["steps"] = str(record.steps)
            trajectory.metadata["sandbox_ids"] = ",".join(record.sandbox_ids)
            if record.failure is not None:
                trajectory.metadata["failure_layer"] = record.failure.layer.value
            if record.weight_versions:
                trajectory.metadata["weight_versions"] = ",".join(record.weight_versions)
            if lost and lost.get(record.rollout_id):
                trajectory.metadata["lost_attempts"] = ",".join(lost[record.rollout_id])
            if record.gui_trail:
                trajectory.metadata["gui_trail"] = record.gui_trail
            group.trajectories.append(trajectory)
    return group


# -- running a job --------------------------------------------------------------------------


@dataclass
class JobRun:
    """Runs a job's remaining pairs, at most `concurrency` rollouts at once, and records its
    progress and groups. `changed` is set whenever a group or the state changes."""

    job: JobState
    jobs: JobStore
    sampler: Sampler
    pairs: Sequence[GroupKey]
    run_rollout: RunRollout
    concurrency: int
    metrics: RolloutMetrics
    group_filter: GroupFilter | None
    """None: every group is emitted (evaluation runs)."""
    on_change: Callable[[], None] = lambda: None
    worker_attempts: int = 1
    """Tries of a rollout whose worker was lost before it is excluded."""
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _slots: asyncio.Semaphore = field(init=False)
    _lost: dict[str, list[str]] = field(default_factory=dict)
    """Per rollout id, the lost tries it replaced (until its group is emitted)."""

    def __post_init__(self) -> None:
        self._slots = asyncio.Semaphore(self.concurrency)

    async def _rollout(self, key: GroupKey, index: int) -> RolloutResult:
        async with self._slots:
            lost: list[WorkerLost] = []
            while True:
                self.job.rollouts_started += 1
                self.metrics.started()
                result: RolloutResult | None = None
                try:
                    result = await self.run_rollout(key, index)
                except WorkerLost as exc:
                    lost.append(exc)
                    if len(lost) >= self.worker_attempts:
                        result = _lost_result(key, index, lost)
                    else:
                        log.warning("job %s: %s; tried again", self.job.id, exc)
                finally:
                    if result is not None:
                        self.metrics.finished(result.payload)
                        self.job.rollouts_done += 1
                        self.job.rollouts_excluded += int(result.status is RolloutStatus.ABORTED)
                    else:
                        self.metrics.rollouts_running.dec()
                if result is not None:
                    if lost:
                        self._lost[result.rollout_id] = [e.rollout_id for e in lost]
                    return result

    async def _pair(self, key: GroupKey) -> None:
        sampled = await self.sampler.sample(key, self._rollout)
        reason = self.group_filter.drop_reason(sampled) if self.group_filter else ""
        async with self._lock:
            self.job.pairs_done.append(pair_name(key))
            if reason:
                self.job.groups_dropped += 1
                self.metrics.groups_dropped.labels(sampled.sampler).inc()
                log.info("job %s: group of %s/%s dropped: %s", self.job.id, *_names(key), reason)
                await self.jobs.put_running(self.job)
            else:
                group = group_proto(self.job.id, sampled, self._lost)
                index = await self.jobs.emit(self.job, group)
                self.metrics.groups_emitted.labels(sampled.sampler).inc()
                log.info("job %s: group %d (%s/%s) emitted", self.job.id, index, *_names(key))
            for rollout in sampled.rollouts:
                self._lost.pop(rollout.rollout_id, None)
        self.on_change()

    async def run(self) -> None:
        """To the end: SUCCEEDED, or FAILED with the error. A cancel propagates (the caller
        decides whether it is a client's cancel or a shutdown)."""
        done = set(self.job.pairs_done)
        remaining = [k for k in self.pairs if pair_name(k) not in done]
        progress = asyncio.create_task(self._save_progress())
        try:
            async with asyncio.TaskGroup() as group:
                for key in remaining:
                    group.create_task(self._pair(key))
            self.job.state = api.ROLLOUT_JOB_STATE_SUCCEEDED
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            errors = exc.exceptions if isinstance(exc, BaseExceptionGroup) else [exc]
            if any(isinstance(e, JobCancelled) for e in errors):
                log.info("job %s: cancelled; its runner stops", self.job.id)
                self.on_change()
                return
            self.job.state = api.ROLLOUT_JOB_STATE_FAILED
            self.job.error = "; ".join(f"{type(e).__name__}: {e}" for e in errors)[:2000]
            log.error("job %s failed: %s", self.job.id, self.job.error)
        finally:
            progress.cancel()
        async with self._lock:
            with contextlib.suppress(JobCancelled):  # a cancel from elsewhere stays
                await self.jobs.put_running(self.job)
        self.on_change()

    async def _save_progress(self, interval_s: float = 1.0) -> None:
        """Rollout counters reach etcd at most every `interval_s` (groups write them too)."""
        saved = -1
        while True:
            await asyncio.sleep(interval_s)
            if self.job.rollouts_done != saved:
                saved = self.job.rollouts_done
                async with self._lock:
                    try:
                        await self.jobs.put_running(self.job)
                    except JobCancelled:
                        return
                self.on_change()


def _lost_result(key: GroupKey, index: int, lost: Sequence[WorkerLost]) -> RolloutResult:
    """A rollout excluded because its worker was lost on every try."""
    last = lost[-1]
    record = RolloutRecord(rollout_id=last.rollout_id, task_id=key.task_id, harness=key.harness)
    tries = ", ".join(e.rollout_id for e in lost)
    record.failure = InfraFailure(
        FailureLayer.HARNESS,
        f"the rollout's worker was lost on each of {len(lost)} tries ({tries}); last: "
        f"{last.reason}",
        len(lost),
    )
    record.ended_at = record.started_at
    return RolloutResult(
        key, index, RolloutStatus.ABORTED, None, 0, rollout_id=last.rollout_id, payload=record
    )


def _names(key: GroupKey) -> tuple[str, str]:
    return key.task_id, key.harness
