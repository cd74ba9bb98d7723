"""``orchard.trainer.v1.TrainerService``: training jobs as long-running operations in etcd.

A job's record (spec, state, last step's metrics, checkpoints, latest weight version) lives in
etcd (`records`); its engine and data buffer live in its worker group, rank processes this
process starts and drives (`jobs.JobRunner`, `workers.WorkerGroup`): the service never trains
itself. A rank that dies fails its job (FAILED, the error names the rank, its pid and how it
ended), whether it dies in a call or while the job waits, and the job's other ranks are
stopped; ending a job (finished, cancelled, failed, or the service stopping) ends its ranks. Every
state change is written to the record before the RPC answers, so a restarted service lists
every job and its checkpoints. A job that was PENDING or RUNNING when the process stopped is
resumed on start from its last checkpoint (from the start of its schedule when it had none;
data submitted since that checkpoint is gone and must be submitted again), or marked FAILED
when ``jobs.resume_on_start`` is off.

Training runs off the event loop, one operation at a time per job (a per-job lock): Step,
SubmitGroups and SaveCheckpoint of one job queue behind each other; jobs run side by side.
Cancel stops a running Step between two optimizer steps.

Bad input is INVALID_ARGUMENT, an unknown job or checkpoint NOT_FOUND, an operation the job's
state does not allow FAILED_PRECONDITION (each message says what to do), raised as
``OrchardError`` and turned into a status by the server's error interceptor.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import timestamp_pb2

from orchard.core.errors import OrchardError, Reason
from orchard.lm.weights import WeightRegistry
from orchard.trainer.checkpoints import (
    MANIFEST,
    CheckpointError,
    StoredCheckpoint,
    publish_checkpoint,
)
from orchard.trainer.config import TrainerConfig
from orchard.trainer.engine import StepResult
from orchard.trainer.jobs import (
    MODE_NAMES,
    JobRunner,
    NotEnoughData,
    RankFailed,
    RayWorkers,
    SpecError,
    artifact_cache,
    check_artifacts,
    plan_validation,
    resolve_spec,
)
from orchard.trainer.masks import TrajectoryError
from orchard.trainer.metrics import TrainerMetrics
from orchard.trainer.pod_workers import PodRanks
from orchard.trainer.prepare import DatasetPreparer
from orchard.trainer.records import JobRecord, JobStore
from orchard.trainer.rl import StaleBatchError
from orchard.trainer.v1 import trainer_service_pb2 as api
from orchard.trainer.v1 import trainer_service_pb2_grpc
from orchard.trainer.weight_versions import WeightVersions
from orchard.trainer.workers import RankLost, RankTransport, WorkerGroupConfig
from orchard.types.v1 import trajectory_pb2

__all__ = ["JobManager", "TrainerServicer"]

log = logging.getLogger(__name__)

State = api.TrainingJobState
ENDED = (
    State.TRAINING_JOB_STATE_SUCCEEDED,
    State.TRAINING_JOB_STATE_FAILED,
    State.TRAINING_JOB_STATE_CANCELLED,
)
MAX_PAGE_SIZE = 1000


def _invalid(message: str) -> OrchardError:
    return OrchardError(Reason.INVALID_ARGUMENT, message)


def _state_name(state: int) -> str:
    return State.Name(state).removeprefix("TRAINING_JOB_STATE_")  # type: ignore[arg-type]


def _now() -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.GetCurrentTime()
    return stamp


def _step_metrics(result: StepResult) -> api.StepMetrics:
    metrics = api.StepMetrics(
        step=result.step,
        loss=result.loss,
        learning_rate=result.learning_rate,
        grad_norm=result.grad_norm,
        loss_tokens=result.loss_tokens,
        extra={**result.extra, "tokens_per_second": result.tokens_per_second},
    )
    if result.validation is not None:
        metrics.validation_loss = result.validation.loss
    return metrics


@dataclass
class _Running:
    runner: JobRunner
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    watched: list[int] = field(default_factory=list)
    """pidfds of the job's ranks, watched by the event loop."""


class JobManager:
    """The jobs of this replica: records in etcd, runners in memory."""

    def __init__(
        self,
        config: TrainerConfig,
        store: JobStore,
        registry: WeightRegistry,
        metrics: TrainerMetrics,
    ) -> None:
        self.config = config
        self.store = store
        self.registry = registry
        self.metrics = metrics
        self.artifacts = config.artifacts.store()
        self.checkpoint_url = config.checkpoint_url()
        self.scratch = Path(config.weights.scratch_dir)
        self.datasets = DatasetPreparer(
            self.artifacts, artifact_cache(self.scratch), limit=config.jobs.max_preparing
        )
        self.weights = WeightVersions(
            registry, self.artifacts, self.scratch, artifact_cache(self.scratch)
        )
        self._running: dict[str, _Running] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        self._starting = 0
        workers = config.workers
        self.workers = WorkerGroupConfig(
            ranks=workers.ranks,
            start_timeout_s=workers.start_timeout_s,
            stop_timeout_s=workers.stop_timeout_s,
            threads_per_rank=workers.threads_per_rank,
        )
        self.ray: RayWorkers | None = None
        if workers.kind == "ray":
            from orchard.trainer.ray_workers import RayPlacement, RayRuntime  # noqa: PLC0415

            self.ray = RayWorkers(
                RayPlacement(
                    cpus_per_rank=workers.ray.cpus_per_rank,
                    gpus_per_rank=workers.ray.gpus_per_rank,
                    local=not workers.ray.address,
                ),
                RayRuntime(workers.ray.address or None, workers.ray.init_cpus),
            )
        self.transport: RankTransport | None = None
        if workers.kind == "pods":
            self.transport = PodRanks(
                workers.pods.endpoints,
                workers.pods.key_file,
                rendezvous_port=workers.pods.rendezvous_port,
                connect_timeout_s=workers.pods.connect_timeout_s,
            )

    # -- helpers ---------------------------------------------------------------------------

    async def _record(self, job_id: str) -> JobRecord:
        if not job_id:
            raise _invalid("job_id is required")
        record = await self.store.get(job_id)
        if record is None:
            raise OrchardError(
                Reason.NOT_FOUND, f"no training job {job_id!r}; ListTrainingJobs shows the jobs"
            )
        return record

    def _running_job(self, record: JobRecord, doing: str) -> _Running:
        state = record.job.state
        if state != State.TRAINING_JOB_STATE_RUNNING:
            hint = {
                State.TRAINING_JOB_STATE_PENDING: "it is starting; retry in a moment",
                State.TRAINING_JOB_STATE_SUCCEEDED: (
                    "early stopping ended it at step "
                    f"{record.job.last_step.step} (its best checkpoint is at step "
                    f"{record.job.validation.best_step})"
                    if record.job.validation.stopped_early
                    else "it finished its total_steps"
                )
                + "; start a new job (a checkpoint of it can be the new job's model)",
                State.TRAINING_JOB_STATE_FAILED: f"it failed: {record.job.error}",
                State.TRAINING_JOB_STATE_CANCELLED: "it was cancelled; its checkpoints stay",
            }.get(state, "")
            raise OrchardError(
                Reason.FAILED_PRECONDITION,
                f"cannot {doing}: job {record.id} is {_state_name(state)}; {hint}",
            )
        running = self._running.get(record.id)
        if running is None:
            raise OrchardError(
                Reason.FAILED_PRECONDITION,
                f"cannot {doing}: job {record.id} is RUNNING but not in this replica",
            )
        return running

    def _mode(self, record: JobRecord) -> str:
        return MODE_NAMES.get(record.job.spec.mode, "unknown")

    async def _set_state(self, record: JobRecord, state: int, error: str = "") -> None:
        record.job.state = state  # type: ignore[assignment]
        record.job.error = error
        await self.store.put(record)
        self.metrics.jobs.labels(self._mode(record), _state_name(state).lower()).inc()

    def _checkpoints_of(self, job_id: str) -> str:
        """The job's folder in the store: ``<checkpoint_url>/<job id>``."""
        return f"{self.checkpoint_url}/{job_id}"

    async def _start_runner(self, record: JobRecord, resume_from: str | None) -> None:
        """Build the job's engine off the loop; RUNNING on success, FAILED with the reason."""
        self._starting += 1
        try:
            runner = await asyncio.to_thread(
                JobRunner,
                record.id,
                record.job.spec,
                self.artifacts,
                self._checkpoints_of(record.id),
                self.scratch / record.id,
                resume_from=resume_from,
                recorder=self.metrics.steps,
                workers=self.workers,
                ray=self.ray,
                transport=self.transport,
                validation=(
                    record.job.validation if record.job.spec.HasField("validation") else None
                ),
            )
        except Exception as exc:
            log.exception("training job %s failed to start", record.id)
            await self._set_state(
                record, State.TRAINING_JOB_STATE_FAILED, f"the job could not start: {exc}"
            )
            return
        finally:
            self._starting -= 1
        running = _Running(runner)
        self._running[record.id] = running
        self._watch(record.id, running)
        self.metrics.running_jobs.set(len(self._running))
        await self._set_state(record, State.TRAINING_JOB_STATE_RUNNING)

    def _watch(self, job_id: str, running: _Running) -> None:
        """Fail the job when one of its ranks exits while no call is waiting on it."""
        loop = asyncio.get_running_loop()
        for fd in running.runner.group.exited():
            running.watched.append(fd)
            loop.add_reader(fd, self._rank_exited, job_id, running)

    def _unwatch(self, running: _Running) -> None:
        loop = asyncio.get_running_loop()
        for fd in running.watched:
            loop.remove_reader(fd)
            os.close(fd)
        running.watched.clear()

    def _rank_exited(self, job_id: str, running: _Running) -> None:
        if self._running.get(job_id) is running:
            self._unwatch(running)
            task = asyncio.get_running_loop().create_task(self._fail_lost(job_id, running))
            self._watchers.add(task)
            task.add_done_callback(self._watchers.discard)

    async def _fail_lost(self, job_id: str, running: _Running) -> None:
        async with running.lock:
            if self._running.get(job_id) is not running:
                return  # a call saw the loss first and failed the job
            reason = await asyncio.to_thread(running.runner.group.check)
            if reason is None:
                self._watch(job_id, running)  # a worker Pod's answer woke it, not an exit
                return
            await self._stop_runner(job_id)
            await self._set_state(
                await self._record(job_id), State.TRAINING_JOB_STATE_FAILED, reason
            )

    async def _fail(self, job_id: str, doing: str, exc: Exception) -> OrchardError:
        """Fail a running job whose ranks broke (or one of them failed) in `doing`; the
        error to answer with. Called with the job's lock held."""
        log.error("training job %s failed in %s: %s", job_id, doing, exc)
        await self._stop_runner(job_id)
        record = await self._record(job_id)
        if record.job.state not in ENDED:
            await self._set_state(record, State.TRAINING_JOB_STATE_FAILED, f"{doing} failed: {exc}")
        return OrchardError(
            Reason.INTERNAL,
            f"job {job_id} failed in {doing} and is FAILED: {exc}; its checkpoints stay "
            "(a new job can start from the last one)",
        )

    async def _stop_runner(self, job_id: str) -> None:
        running = self._running.pop(job_id, None)
        self.metrics.running_jobs.set(len(self._running))
        if running is not None:
            self._unwatch(running)
            await asyncio.to_thread(running.runner.close)

    def rank_pids(self, job_id: str) -> list[int]:
        """The process ids of a job's ranks, rank 0 first (empty when none run here)."""
        running = self._running.get(job_id)
        return [] if running is None else running.runner.group.pids

    # -- lifecycle -------------------------------------------------------------------------

    async def recover(self) -> None:
        """Resume (or fail) the jobs a previous process left PENDING or RUNNING."""
        for record in await self.store.list_jobs():
            if record.job.state in ENDED:
                continue
            last = record.checkpoints[-1] if record.checkpoints else None
            where = f"step {last.step} ({last.uri})" if last else "no checkpoint"
            if not self.config.jobs.resume_on_start:
                await self._set_state(
                    record,
                    State.TRAINING_JOB_STATE_FAILED,
                    f"interrupted by a restart of the trainer service; last checkpoint: {where}",
                )
                continue
            log.info("resuming training job %s from %s", record.id, where)
            await self._start_runner(record, last.uri if last else None)

    async def close(self) -> None:
        for job_id in list(self._running):
            running = self._running[job_id]
            running.runner.cancelled = True
            async with running.lock:
                await self._stop_runner(job_id)
        if self.ray is not None:
            await asyncio.to_thread(self.ray.runtime.close)

    # -- RPCs ------------------------------------------------------------------------------

    async def create(self, spec: api.TrainingJobSpec, request_id: str) -> api.TrainingJob:
        try:
            resolved = resolve_spec(spec, max_ranks=self.config.workers.max_ranks)
            # Before anything runs: a model or dataset the store does not allow or hold fails
            # the call (PERMISSION_DENIED, NOT_FOUND), never the job.
            await asyncio.to_thread(
                check_artifacts, resolved, self.artifacts, artifact_cache(self.scratch)
            )
            validation = await asyncio.to_thread(plan_validation, resolved, self.artifacts)
        except SpecError as exc:
            raise _invalid(str(exc)) from None
        if request_id:
            earlier = await self.store.by_request(request_id)
            if earlier is not None:
                return earlier.job
        if len(self._running) + self._starting >= self.config.jobs.max_running:
            raise OrchardError(
                Reason.RESOURCE_EXHAUSTED,
                f"this trainer runs at most {self.config.jobs.max_running} job(s) at once "
                "(jobs.max_running); cancel one or wait for one to finish",
            )
        record = JobRecord(
            job=api.TrainingJob(
                id=f"job-{uuid.uuid4().hex[:12]}",
                spec=resolved,
                state=State.TRAINING_JOB_STATE_PENDING,
                create_time=_now(),
            )
        )
        if resolved.HasField("validation"):
            record.job.validation.CopyFrom(validation)
        record, created = await self.store.create(record, request_id)
        if not created:
            return record.job
        self.metrics.jobs.labels(self._mode(record), "pending").inc()
        log.info("training job created", extra={"job": record.id, "model": resolved.model})
        await self._start_runner(record, None)
        return record.job

    async def get(self, job_id: str) -> api.TrainingJob:
        return (await self._record(job_id)).job

    async def list_jobs(self, page_size: int, page_token: str) -> tuple[list[api.TrainingJob], str]:
        if not 0 <= page_size <= MAX_PAGE_SIZE:
            raise _invalid(f"page_size must be in [0, {MAX_PAGE_SIZE}], got {page_size}")
        size = page_size or 100
        start = 0
        if page_token:
            if not page_token.isdigit():
                raise _invalid("page_token is not one this service gave; pass next_page_token")
            start = int(page_token)
        records = await self.store.list_jobs()
        page = records[start : start + size]
        more = start + size < len(records)
        return [r.job for r in page], str(start + size) if more else ""

    async def cancel(self, job_id: str) -> api.TrainingJob:
        record = await self._record(job_id)
        if record.job.state in ENDED:
            return record.job
        running = self._running.get(job_id)
        if running is not None:
            running.runner.cancelled = True
            async with running.lock:
                await self._stop_runner(job_id)
        record = await self._record(job_id)
        if record.job.state in ENDED:  # a Step finished it (or it failed) meanwhile
            return record.job
        await self._set_state(record, State.TRAINING_JOB_STATE_CANCELLED)
        log.info("training job cancelled", extra={"job": job_id})
        return record.job

    async def submit(
        self, requests: AsyncIterator[api.SubmitGroupsRequest]
    ) -> api.SubmitGroupsResponse:
        response = api.SubmitGroupsResponse()
        job_id = ""
        running: _Running | None = None
        mode = ""
        index = -1
        async for request in requests:
            index += 1
            if running is None:
                record = await self._record(request.job_id)
                running = self._running_job(record, "submit groups")
                job_id, mode = record.id, self._mode(record)
            elif request.job_id and request.job_id != job_id:
                raise _invalid(
                    f"message {index} names job {request.job_id!r}; every message of one "
                    f"stream must name the same job ({job_id!r})"
                )
            runner = running.runner
            if runner.buffered >= self.config.jobs.max_buffered_samples:
                raise OrchardError(
                    Reason.RESOURCE_EXHAUSTED,
                    f"job {job_id} buffers {runner.buffered} samples "
                    f"(jobs.max_buffered_samples); run Step before submitting more",
                )
            async with running.lock:
                if runner.cancelled:
                    raise OrchardError(
                        Reason.FAILED_PRECONDITION, f"job {job_id} was cancelled meanwhile"
                    )
                lag = None
                if runner.spec.HasField("max_staleness"):
                    lag = await self._version_lag(
                        self._registry_of(runner.spec), job_id, request.group
                    )
                try:
                    counts = await asyncio.to_thread(runner.submit, request.group, lag)
                except (RankLost, RankFailed) as exc:
                    raise await self._fail(job_id, "submitting groups", exc) from None
                except StaleBatchError as exc:
                    raise OrchardError(
                        Reason.FAILED_PRECONDITION,
                        f"group {index} ({request.group.id or 'no id'}): {exc} "
                        f"(spec.max_staleness); sample it again with newer weights, or create "
                        f"the job with skip_stale; the groups before it "
                        f"({response.groups_accepted}) were accepted",
                    ) from None
                except (TrajectoryError, ValueError) as exc:
                    raise _invalid(
                        f"group {index} ({request.group.id or 'no id'}): {exc}; the groups "
                        f"before it ({response.groups_accepted}) were accepted"
                    ) from None
            response.groups_accepted += 1
            response.trajectories_trainable += counts.trainable
            response.trajectories_skipped += counts.skipped
            self.metrics.groups.labels(mode).inc()
            self.metrics.trajectories.labels(mode, "trainable").inc(counts.trainable)
            self.metrics.trajectories.labels(mode, "skipped").inc(counts.skipped)
        if running is None:
            raise _invalid("the stream held no message; send job_id and a group per message")
        return response

    def _registry_of(self, spec: api.TrainingJobSpec) -> WeightRegistry:
        """Where a job publishes: its `weight_model`, or the service's registry model."""
        return self.registry.for_model(spec.weight_model or self.registry.model)

    async def _version_lag(
        self, registry: WeightRegistry, job_id: str, group: trajectory_pb2.TrajectoryGroup
    ) -> dict[str, int | None]:
        """How many versions each weight version named in `group` lags behind in the job's
        model (None: not a published version of it): the newer versions that this job or no job
        published. Another job's versions do not count: two RL jobs may train on one model
        (experiment arms from one SFT model), and the versions one publishes are not updates
        of the other's policy; counted, they made every group of the job that started second
        stale."""
        versions = await registry.versions()
        by_name = {v.version: v for v in versions}
        updates = [v.number for v in versions if v.metadata.get("job", job_id) == job_id]
        names = {
            turn.weight_version
            for trajectory in group.trajectories
            for turn in trajectory.turns
            if turn.kind == trajectory_pb2.TURN_KIND_POLICY
        }
        lag: dict[str, int | None] = {}
        for name in names:
            found = by_name.get(name)
            lag[name] = None if found is None else sum(1 for n in updates if n > found.number)
        return lag

    async def step(self, job_id: str, steps: int, publish: bool) -> api.StepResponse:
        if steps < 1:
            raise _invalid(f"steps must be at least 1, got {steps}")
        record = await self._record(job_id)
        running = self._running_job(record, "step")
        runner = running.runner
        response = api.StepResponse()
        async with running.lock:
            if runner.cancelled:
                raise OrchardError(Reason.FAILED_PRECONDITION, f"job {job_id} was cancelled")
            if steps > runner.steps_left:
                raise OrchardError(
                    Reason.FAILED_PRECONDITION,
                    f"job {job_id} is at step {runner.step} of total_steps "
                    f"{record.job.spec.total_steps}: at most {runner.steps_left} step(s) left",
                )
            record = await self._record(job_id)  # as of now: a save may have changed it
            try:
                results = await asyncio.to_thread(runner.run_steps, steps)
            except NotEnoughData as exc:
                raise OrchardError(Reason.FAILED_PRECONDITION, str(exc)) from None
            except Exception as exc:
                raise await self._fail(job_id, "a step", exc) from None
            for kept in runner.take_kept():  # the best validation losses' checkpoints
                self._keep(record, kept)
            if runner.validation is not None:
                record.job.validation.CopyFrom(runner.validation.progress)
            response.steps.extend(_step_metrics(r) for r in results)
            if results:
                record.job.last_step.CopyFrom(_step_metrics(results[-1]))
            done = runner.steps_left == 0 or runner.stopped_early
            finished = done and not runner.cancelled
            if (publish or finished) and not runner.cancelled:
                checkpoint = await self._save(record, runner, publish=publish)
                response.weight_version = checkpoint.weight_version
            if finished:
                await self._stop_runner(job_id)
                await self._set_state(record, State.TRAINING_JOB_STATE_SUCCEEDED)
            elif not runner.cancelled:
                await self.store.put(record)
        return response

    async def _save(self, record: JobRecord, runner: JobRunner, *, publish: bool) -> api.Checkpoint:
        """Save (or find) the checkpoint at the runner's step, publish it when asked, and write
        both into the record. Called with the job's lock held."""
        started = time.monotonic()
        try:
            info = await asyncio.to_thread(runner.save)
        except OrchardError:
            raise  # the store's own status (denied, unavailable, ...)
        except (RankLost, RankFailed) as exc:
            raise await self._fail(record.id, "saving a checkpoint", exc) from None
        except (CheckpointError, OSError) as exc:
            raise OrchardError(
                Reason.INTERNAL, f"job {record.id}: the checkpoint could not be saved: {exc}"
            ) from None
        checkpoint = self._keep(record, info, time.monotonic() - started)
        if publish and not checkpoint.weight_version:
            await self._publish(record, checkpoint, info)
        await self.store.put(record)
        return checkpoint

    def _keep(
        self, record: JobRecord, info: StoredCheckpoint, seconds: float | None = None
    ) -> api.Checkpoint:
        """The record's checkpoint at `info`'s step, added (in step order) when new."""
        checkpoint = record.checkpoint_at(info.step)
        if checkpoint is None:
            self.metrics.checkpoints.labels(self._mode(record)).inc()
            if seconds is not None:
                self.metrics.checkpoint_seconds.observe(seconds)
            checkpoint = api.Checkpoint(step=info.step, uri=info.url)
            checkpoint.create_time.FromNanoseconds(int(info.created_at * 1e9))
            record.checkpoints.append(checkpoint)
            record.checkpoints.sort(key=lambda c: c.step)
        return checkpoint

    async def _publish(
        self, record: JobRecord, checkpoint: api.Checkpoint, info: StoredCheckpoint
    ) -> None:
        version = await publish_checkpoint(
            self._registry_of(record.job.spec),
            info,
            metadata={"job": record.id, "mode": self._mode(record)},
        )
        checkpoint.weight_version = version.version
        record.job.weight_version = version.version
        self.metrics.publications.labels(self._mode(record)).inc()
        log.info(
            "weight version published",
            extra={"job": record.id, "version": version.version, "number": version.number},
        )

    async def save(self, job_id: str, publish: bool) -> api.Checkpoint:
        record = await self._record(job_id)
        running = self._running_job(record, "save a checkpoint")
        async with running.lock:
            if running.runner.cancelled:
                raise OrchardError(Reason.FAILED_PRECONDITION, f"job {job_id} was cancelled")
            record = await self._record(job_id)
            return await self._save(record, running.runner, publish=publish)

    async def publish(self, job_id: str, step: int) -> api.Checkpoint:
        record = await self._record(job_id)
        checkpoint = record.checkpoint_at(step)
        if checkpoint is None:
            saved = ", ".join(str(c.step) for c in record.checkpoints) or "none"
            raise OrchardError(
                Reason.NOT_FOUND,
                f"job {job_id} has no checkpoint at step {step} (saved steps: {saved}); "
                "SaveCheckpoint makes one",
            )
        if checkpoint.weight_version:
            return checkpoint
        try:
            info = await asyncio.to_thread(self._stored, checkpoint.uri)
        except CheckpointError as exc:
            raise OrchardError(Reason.FAILED_PRECONDITION, str(exc)) from None
        running = self._running.get(job_id)
        if running is None:
            await self._publish(record, checkpoint, info)
            await self.store.put(record)
            return checkpoint
        async with running.lock:
            # Re-read: a Step may have written the record meanwhile.
            record = await self._record(job_id)
            checkpoint = record.checkpoint_at(step)
            assert checkpoint is not None
            if not checkpoint.weight_version:
                await self._publish(record, checkpoint, info)
                await self.store.put(record)
            return checkpoint

    def _stored(self, url: str) -> StoredCheckpoint:
        """The checkpoint at `url` in the store, by its manifest."""
        return StoredCheckpoint.from_manifest(self.artifacts.read_bytes(f"{url}/{MANIFEST}"), url)

    async def checkpoints(self, job_id: str) -> list[api.Checkpoint]:
        return list((await self._record(job_id)).checkpoints)


class TrainerServicer(trainer_service_pb2_grpc.TrainerServiceServicer):
    """The RPC handlers; :meth:`attach` gives them the job manager once the server started."""

    def __init__(self) -> None:
        self._jobs: JobManager | None = None

    def attach(self, jobs: JobManager | None) -> None:
        self._jobs = jobs

    @property
    def jobs(self) -> JobManager:
        if self._jobs is None:
            raise OrchardError(Reason.UNAVAILABLE, "the trainer service is starting or stopping")
        return self._jobs

    async def CreateTrainingJob(
        self, request: api.CreateTrainingJobRequest, context: grpc.aio.ServicerContext
    ) -> api.CreateTrainingJobResponse:
        if not request.HasField("spec"):
            raise _invalid("spec is required: mode, model and hyperparameters of the job")
        job = await self.jobs.create(request.spec, request.request_id)
        return api.CreateTrainingJobResponse(job=job)

    async def GetTrainingJob(
        self, request: api.GetTrainingJobRequest, context: grpc.aio.ServicerContext
    ) -> api.GetTrainingJobResponse:
        return api.GetTrainingJobResponse(job=await self.jobs.get(request.job_id))

    async def ListTrainingJobs(
        self, request: api.ListTrainingJobsRequest, context: grpc.aio.ServicerContext
    ) -> api.ListTrainingJobsResponse:
        jobs, token = await self.jobs.list_jobs(request.page_size, request.page_token)
        return api.ListTrainingJobsResponse(jobs=jobs, next_page_token=token)

    async def CancelTrainingJob(
        self, request: api.CancelTrainingJobRequest, context: grpc.aio.ServicerContext
    ) -> api.CancelTrainingJobResponse:
        return api.CancelTrainingJobResponse(job=await self.jobs.cancel(request.job_id))

    async def SubmitGroups(
        self,
        request_iterator: AsyncIterator[api.SubmitGroupsRequest],
        context: grpc.aio.ServicerContext,
    ) -> api.SubmitGroupsResponse:
        return await self.jobs.submit(request_iterator)

    async def Step(
        self, request: api.StepRequest, context: grpc.aio.ServicerContext
    ) -> api.StepResponse:
        return await self.jobs.step(request.job_id, request.steps, request.publish)

    async def ListCheckpoints(
        self, request: api.ListCheckpointsRequest, context: grpc.aio.ServicerContext
    ) -> api.ListCheckpointsResponse:
        return api.ListCheckpointsResponse(checkpoints=await self.jobs.checkpoints(request.job_id))

    async def SaveCheckpoint(
        self, request: api.SaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> api.SaveCheckpointResponse:
        checkpoint = await self.jobs.save(request.job_id, request.publish)
        return api.SaveCheckpointResponse(checkpoint=checkpoint)

    async def PublishCheckpoint(
        self, request: api.PublishCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> api.PublishCheckpointResponse:
        checkpoint = await self.jobs.publish(request.job_id, request.step)
        return api.PublishCheckpointResponse(checkpoint=checkpoint)

    async def PrepareDataset(
        self, request: api.PrepareDatasetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api.PrepareDatasetResponse]:
        async for message in self.jobs.datasets.stream(request):
            yield message

    async def GetWeightVersion(
        self, request: api.GetWeightVersionRequest, context: grpc.aio.ServicerContext
    ) -> api.GetWeightVersionResponse:
        found = await self.jobs.weights.get(request.model, request.version)
        return api.GetWeightVersionResponse(weight_version=found)

    async def ListWeightVersions(
        self, request: api.ListWeightVersionsRequest, context: grpc.aio.ServicerContext
    ) -> api.ListWeightVersionsResponse:
        versions, token = await self.jobs.weights.list(
            request.model, request.page_size, request.page_token
        )
        return api.ListWeightVersionsResponse(weight_versions=versions, next_page_token=token)

    async def PublishModel(
        self, request: api.PublishModelRequest, context: grpc.aio.ServicerContext
    ) -> api.PublishModelResponse:
        return await self.jobs.weights.publish_model(request)
