"""The recipe's side of orchard-trainer: training jobs driven over gRPC.

The collect and curate stages have the trainer prepare the SFT dataset (PrepareDataset: the
teacher's conversations rendered in the student's tokens, curated, counted); the SFT stage
hands the trainer that dataset by URL and steps the job to its end; the RL stage submits each
step's groups and asks for one optimizer step and a published weight version. Jobs publish
under the run's own registry model (`TrainingJobSpec.weight_model`), so the engines of this
run follow this run's versions only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from orchard.recipes.connection import ServiceConnection, ServiceError
from orchard.trainer.v1 import trainer_service_pb2 as api
from orchard.trainer.v1 import trainer_service_pb2_grpc as rpc
from orchard.types.v1 import trajectory_pb2

__all__ = ["TrainerError", "TrainerJobs", "step_entry"]

_RUNNING = api.TRAINING_JOB_STATE_RUNNING


class TrainerError(ServiceError):
    """orchard-trainer refused or failed a call; the message is the service's, with the call."""


def step_entry(metrics: api.StepMetrics) -> dict[str, Any]:
    """One optimizer step's metrics as the run log writes them (with the validation loss
    evaluated after it, when one was)."""
    entry = {
        "step": int(metrics.step),
        "loss": float(metrics.loss),
        "lr": float(metrics.learning_rate),
        "grad_norm": float(metrics.grad_norm),
        "loss_tokens": int(metrics.loss_tokens),
        **{k: float(v) for k, v in sorted(metrics.extra.items())},
    }
    if metrics.HasField("validation_loss"):
        entry["validation_loss"] = float(metrics.validation_loss)
    return entry


@dataclass
class TrainerJobs(ServiceConnection):
    """A connection to orchard-trainer at ``address`` (HOST:PORT)."""

    service = "orchard-trainer"
    error = TrainerError

    def stub(self, channel: grpc.aio.Channel) -> Any:
        return rpc.TrainerServiceStub(channel)

    async def create(self, spec: api.TrainingJobSpec, request_id: str) -> api.TrainingJob:
        """Start a job (the same `request_id` returns the same job); raises TrainerError when
        it does not come up running."""
        response = await self._retried(
            "CreateTrainingJob",
            lambda: self._stub.CreateTrainingJob(
                api.CreateTrainingJobRequest(spec=spec, request_id=request_id)
            ),
        )
        job: api.TrainingJob = response.job
        if job.state != _RUNNING:
            state = api.TrainingJobState.Name(job.state)
            raise TrainerError(f"training job {job.id} is {state}: {job.error or 'no reason'}")
        return job

    async def step(self, job_id: str, steps: int, *, publish: bool = False) -> api.StepResponse:
        request = api.StepRequest(job_id=job_id, steps=steps, publish=publish)
        response: api.StepResponse = await self._call("Step", self._stub.Step(request))
        return response

    async def submit(
        self, job_id: str, groups: Sequence[trajectory_pb2.TrajectoryGroup]
    ) -> api.SubmitGroupsResponse:
        async def messages() -> AsyncIterator[api.SubmitGroupsRequest]:
            for group in groups:
                yield api.SubmitGroupsRequest(job_id=job_id, group=group)

        response: api.SubmitGroupsResponse = await self._call(
            "SubmitGroups", self._stub.SubmitGroups(messages())
        )
        return response

    async def get(self, job_id: str) -> api.TrainingJob:
        response = await self._retried(
            "GetTrainingJob",
            lambda: self._stub.GetTrainingJob(api.GetTrainingJobRequest(job_id=job_id)),
        )
        job: api.TrainingJob = response.job
        return job

    async def publish_checkpoint(self, job_id: str, step: int) -> api.Checkpoint:
        """Publish the job's checkpoint at `step` as a weight version (PublishCheckpoint: the
        version it already has when published before)."""
        request = api.PublishCheckpointRequest(job_id=job_id, step=step)
        response = await self._retried(
            "PublishCheckpoint", lambda: self._stub.PublishCheckpoint(request)
        )
        checkpoint: api.Checkpoint = response.checkpoint
        return checkpoint

    async def cancel(self, job_id: str) -> None:
        """Stop a job that has steps left (its checkpoints stay)."""
        if (await self.get(job_id)).state == _RUNNING:
            await self._retried(
                "CancelTrainingJob",
                lambda: self._stub.CancelTrainingJob(api.CancelTrainingJobRequest(job_id=job_id)),
            )

    async def prepare_dataset(
        self,
        request: api.PrepareDatasetRequest,
        progress: Callable[[api.PrepareDatasetProgress], None] | None = None,
    ) -> api.PrepareDatasetResult:
        """PrepareDataset: the trainer renders, curates and counts the rows in the student's
        tokens; `progress` sees each progress message. Raises TrainerError."""

        async def follow() -> api.PrepareDatasetResult:
            async for message in self._stub.PrepareDataset(request):
                if message.HasField("result"):
                    result: api.PrepareDatasetResult = message.result
                    return result
                if progress is not None:
                    progress(message.progress)
            raise TrainerError(
                f"{self.service} at {self.address}: PrepareDataset ended without a result"
            )

        result: api.PrepareDatasetResult = await self._call("PrepareDataset", follow())
        return result
