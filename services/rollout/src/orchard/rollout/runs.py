"""Rollout jobs: their state in etcd, and running one to its end.

Keys, under the service's namespace:

- ``jobs/<job_id>``: the job as JSON (spec, state, progress, the pairs sampled to their end);
- ``requests/<request_id>``: the job a client's request id created (retries return it);
- ``groups/<job_id>/<index>``: the emitted groups (``orchard.types.v1.TrajectoryGroup``, binary),
  numbered from 0 in emission order;
- ``cancels/<job_id>``: written by a cancel; every write of the job's runner is conditional on
  its absence, so a cancel (from any replica) is never overwritten;
- ``owners/<job_id>``: the process running the job, on that process's lease (it vanishes when
  the process stops or dies, and another process, or the restarted one, adopts the job).

A group is written in one transaction with the job record that counts it and marks its pair
done, so a group is emitted exactly once: after a restart the job resumes with the pairs not yet
done (their rollouts in flight at the restart are lost and the pair is sampled again from the
start), and consumers resume `StreamGroups` at the index they stopped at.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format, timestamp_pb2

from orchard.core.etcd import Compare, CompareOp, EtcdStore, PutOp
from orchard.rollout.batches import GroupFilter
from orchard.rollout.metrics import RolloutMetrics
from orchard.rollout.provenance import RolloutRecord
from orchard.rollout.results import GroupKey, RolloutResult, RolloutStatus, RunRollout
from orchard.rollout.samplers import SampledGroup, Sampler
from orchard.rollout.trajectory_tree import build_tree, tree_trajectories
from orchard.rollout.v1 import rollout_service_pb2 as api
from orchard.types.v1 import reward_pb2, trajectory_pb2

log = logging.getLogger(__name__)

JOBS = "jobs/"
REQUESTS = "requests/"
OWNERS = "owners/"
CANCELS = "cancels/"
GROUPS = "groups/"
INDEX_DIGITS = 10

STATE_NAMES: dict[int, str] = {
    api.ROLLOUT_JOB_STATE_RUNNING: "RUNNING",
    api.ROLLOUT_JOB_STATE_SUCCEEDED: "SUCCEEDED",
    api.ROLLOUT_JOB_STATE_FAILED: "FAILED",
    api.ROLLOUT_JOB_STATE_CANCELLED: "CANCELLED",
}
ENDED = frozenset(
    {
        api.ROLLOUT_JOB_STATE_SUCCEEDED,
        api.ROLLOUT_JOB_STATE_FAILED,
        api.ROLLOUT_JOB_STATE_CANCELLED,
    }
)


def pair_name(key: GroupKey) -> str:
    return f"{key.task_id}\x1f{key.harness}"


def group_key(job_id: str, index: int) -> str:
    return f"{GROUPS}{job_id}/{index:0{INDEX_DIGITS}d}"


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


@dataclass(slots=True)
class JobState:
    """A job as stored: everything `RolloutJob` shows, and the pairs already done."""

    id: str
    spec: api.RolloutJobSpec
    request_id: str = ""
    state: int = int(api.ROLLOUT_JOB_STATE_RUNNING)
    error: str = ""
    create_time: float = field(default_factory=time.time)
    update_time: float = field(default_factory=time.time)
    rollouts_started: int = 0
    rollouts_done: int = 0
    rollouts_excluded: int = 0
    groups_emitted: int = 0
    groups_dropped: int = 0
    pairs_total: int = 0
    pairs_done: list[str] = field(default_factory=list)
    resumes: int = 0

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def to_json(self) -> str:
        return json.dumps(
            {
                "id": self.id,
                "spec": json_format.MessageToDict(self.spec, preserving_proto_field_name=True),
                "request_id": self.request_id,
                "state": STATE_NAMES[self.state],
                "error": self.error,
                "create_time": self.create_time,
                "update_time": self.update_time,
                "rollouts_started": self.rollouts_started,
                "rollouts_done": self.rollouts_done,
                "rollouts_excluded": self.rollouts_excluded,
                "groups_emitted": self.groups_emitted,
                "groups_dropped": self.groups_dropped,
                "pairs_total": self.pairs_total,
                "pairs_done": self.pairs_done,
                "resumes": self.resumes,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> JobState:
        data: dict[str, Any] = json.loads(text)
        states = {name: number for number, name in STATE_NAMES.items()}
        return cls(
            id=data["id"],
            spec=json_format.ParseDict(data["spec"], api.RolloutJobSpec()),
            request_id=data.get("request_id", ""),
            state=states[data["state"]],
            error=data.get("error", ""),
            create_time=data["create_time"],
            update_time=data.get("update_time", data["create_time"]),
            rollouts_started=data.get("rollouts_started", 0),
            rollouts_done=data.get("rollouts_done", 0),
            rollouts_excluded=data.get("rollouts_excluded", 0),
            groups_emitted=data.get("groups_emitted", 0),
            groups_dropped=data.get("groups_dropped", 0),
            pairs_total=data.get("pairs_total", 0),
            pairs_done=list(data.get("pairs_done", [])),
            resumes=data.get("resumes", 0),
        )

    def to_proto(self) -> api.RolloutJob:
        return api.RolloutJob(
            id=self.id,
            spec=self.spec,
            state=self.state,  # type: ignore[arg-type]
            rollouts_done=self.rollouts_done,
            rollouts_excluded=self.rollouts_excluded,
            groups_emitted=self.groups_emitted,
            error=self.error,
            create_time=_timestamp(self.create_time),
            rollouts_started=self.rollouts_started,
            groups_dropped=self.groups_dropped,
            pairs_total=self.pairs_total,
            pairs_done=len(self.pairs_done),
            resumes=self.resumes,
            update_time=_timestamp(self.update_time),
        )


class JobCancelled(Exception):
    """The job was cancelled (possibly through another replica): its runner stops writing."""


class JobStore:
    """Jobs and their groups in etcd."""

    def __init__(self, store: EtcdStore) -> None:
        self.store = store

    async def create(self, job: JobState) -> JobState:
        """Stores a new job; with a request id already used, returns the job it created."""
        if job.request_id:
            created = await self.store.create_if_absent(REQUESTS + job.request_id, job.id)
            if created is None:
                existing = await self.store.get(REQUESTS + job.request_id)
                if existing is not None:
                    found = await self.get(existing.value_str)
                    if found is not None:
                        return found
        await self.put(job)
        return job

    async def put(self, job: JobState) -> None:
        job.update_time = time.time()
        await self.store.put(JOBS + job.id, job.to_json())

    async def put_running(self, job: JobState) -> None:
        """The runner's write: refused (JobCancelled) once the job was cancelled."""
        job.update_time = time.time()
        result = await self.store.txn(
            [Compare.version(CANCELS + job.id, CompareOp.EQUAL, 0)],
            [PutOp.of(JOBS + job.id, job.to_json())],
        )
        if not result.succeeded:
            raise JobCancelled(job.id)

    async def mark_cancelled(self, job_id: str) -> None:
        await self.store.put(CANCELS + job_id, "1")

    async def claim(self, job_id: str, owner: str, lease: int) -> bool:
        """Makes `owner` the job's runner unless another live process is; True when it is."""
        if await self.store.create_if_absent(OWNERS + job_id, owner, lease=lease) is not None:
            return True
        current = await self.store.get(OWNERS + job_id)
        return current is not None and current.value_str == owner

    async def get(self, job_id: str) -> JobState | None:
        kv = await self.store.get(JOBS + job_id)
        return None if kv is None else JobState.from_json(kv.value)

    async def all(self) -> list[JobState]:
        """Every job, newest first."""
        jobs = [JobState.from_json(kv.value) async for kv in self.store.iter_prefix(JOBS)]
        return sorted(jobs, key=lambda j: (-j.create_time, j.id))

    async def emit(self, job: JobState, group: trajectory_pb2.TrajectoryGroup) -> int:
        """Writes the group as the job's next one with the job record, atomically; returns its
        index."""
        index = job.groups_emitted
        job.groups_emitted += 1
        job.update_time = time.time()
        result = await self.store.txn(
            [Compare.version(CANCELS + job.id, CompareOp.EQUAL, 0)],
            [
                PutOp.of(group_key(job.id, index), group.SerializeToString()),
                PutOp.of(JOBS + job.id, job.to_json()),
            ],
        )
        if not result.succeeded:
            job.groups_emitted -= 1
            raise JobCancelled(job.id)
        return index

    async def groups(
        self, job_id: str, start_index: int, *, page_size: int = 64
    ) -> list[tuple[int, trajectory_pb2.TrajectoryGroup]]:
        """The job's groups from `start_index` on, in order (read from that key on)."""
        prefix = f"{GROUPS}{job_id}/"
        after: str | None = group_key(job_id, start_index - 1) if start_index > 0 else None
        out = []
        while True:
            page = await self.store.get_prefix(prefix, limit=page_size, start_after=after)
            for kv in page.kvs:
                group = trajectory_pb2.TrajectoryGroup()
                group.ParseFromString(kv.value)
                out.append((int(kv.key_str.rsplit("/", 1)[1]), group))
            if not page.more or not page.kvs:
                return out
            after = page.kvs[-1].key_str


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


def group_proto(job_id: str, sampled: SampledGroup) -> trajectory_pb2.TrajectoryGroup:
    """The sampled group with its trajectories rebuilt from the captured calls; advantages are
    reward minus the mean reward of the group's scored members (0 for excluded ones)."""
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
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _slots: asyncio.Semaphore = field(init=False)

    def __post_init__(self) -> None:
        self._slots = asyncio.Semaphore(self.concurrency)

    async def _rollout(self, key: GroupKey, index: int) -> RolloutResult:
        async with self._slots:
            self.job.rollouts_started += 1
            self.metrics.started()
            result: RolloutResult | None = None
            try:
                result = await self.run_rollout(key, index)
                return result
            finally:
                if result is not None:
                    self.metrics.finished(result.payload)
                    self.job.rollouts_done += 1
                    self.job.rollouts_excluded += int(result.status is RolloutStatus.ABORTED)
                else:
                    self.metrics.rollouts_running.dec()

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
                index = await self.jobs.emit(self.job, group_proto(self.job.id, sampled))
                self.metrics.groups_emitted.labels(sampled.sampler).inc()
                log.info("job %s: group %d (%s/%s) emitted", self.job.id, index, *_names(key))
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


def _names(key: GroupKey) -> tuple[str, str]:
    return key.task_id, key.harness


def new_job_id() -> str:
    return uuid.uuid4().hex
