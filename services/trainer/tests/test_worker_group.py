"""Jobs train on a worker group of rank processes, over real gRPC with a real etcd: two ranks
under ZeRO-2 and ZeRO-3 follow one rank's loss curve, a checkpoint saved at two ranks resumes
at one, a killed rank fails its job with a message instead of hanging, and ending a job ends
all its ranks (checked by pid)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from orchard.core.artifacts import ArtifactsConfig
from orchard.core.config import ServerConfig
from orchard.lm.model_folder import load_model_folder
from orchard.trainer.batch import TokenBatch
from orchard.trainer.config import EtcdConfig, TrainerConfig, WeightsConfig, WorkersConfig
from orchard.trainer.losses import sft_loss
from orchard.trainer.masks import SampleConfig, build_sft_samples
from orchard.trainer.microbatches import MicroBatchPlan
from orchard.trainer.policy import load_policy
from orchard.trainer.v1 import trainer_service_pb2 as api
from orchard.types.v1 import trajectory_pb2

from .conftest import TrajectoryBuilder
from .test_service import Running, Trainer, failure, groups, local, sft_spec, submit

State = api.TrainingJobState
PAD = load_policy("builtin:tiny").pad_id

# Two ranks average their gradients with an all-reduce where one rank sums its accumulated
# micro-batches: the same numbers in another order, so float32 rounding differs slightly.
LOSS_TOLERANCE = 1e-4
"""Largest relative difference allowed between the loss of a step at one and at two ranks."""


@pytest.fixture
def configure(etcd, tmp_path: Path) -> Callable[..., TrainerConfig]:
    namespace = f"test/{uuid.uuid4().hex}/"

    def make(ranks: int = 1, **_: Any) -> TrainerConfig:
        return TrainerConfig(
            server=ServerConfig(listen=["127.0.0.1:0"], metrics_address="127.0.0.1:0"),
            etcd=EtcdConfig(
                endpoints=[etcd.endpoint], prefix=namespace + "trainer/", weights_prefix=namespace
            ),
            artifacts=ArtifactsConfig(root=(tmp_path / "store").as_uri()),
            weights=WeightsConfig(scratch_dir=str(tmp_path / "scratch")),
            workers=WorkersConfig(ranks=ranks, stop_timeout_s=5.0),
        )

    return make


@pytest.fixture
async def trainer(configure) -> AsyncIterator[Trainer]:
    running = Trainer(configure)
    try:
        yield running
    finally:
        await running.close()


def alive(pid: int) -> bool:
    """Whether process `pid` exists (a child reaped by its group is gone)."""
    return Path(f"/proc/{pid}").exists()


def left_behind(pids: list[int]) -> list[int]:
    """The ranks of `pids` still running; the service reaps a job's ranks before it answers."""
    return [p for p in pids if alive(p)]


def pids_of(t: Running, job_id: str) -> list[int]:
    assert t.app.jobs is not None
    return t.app.jobs.rank_pids(job_id)


async def create(t: Running, **fields: Any) -> api.TrainingJob:
    request = api.CreateTrainingJobRequest(spec=sft_spec(**fields))
    job = (await t.stub.CreateTrainingJob(request)).job
    assert job.state == State.TRAINING_JOB_STATE_RUNNING, job.error
    return job


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
async def test_two_ranks_follow_the_loss_curve_of_one_and_cancel_ends_them(trainer, zero_stage):
    t = await trainer.start()
    data = groups(2, 8)  # 16 samples: 4 micro-batches of 4, 2 steps per epoch
    common = dict(zero_stage=zero_stage, micro_batch_size=4, total_steps=8, warmup_steps=1)
    one = await create(t, ranks=1, gradient_accumulation=2, **common)
    two = await create(t, ranks=2, gradient_accumulation=1, **common)
    assert len(pids_of(t, one.id)) == 1
    pids = pids_of(t, two.id)
    assert len(pids) == 2 and os.getpid() not in pids
    curves = {}
    for job in (one, two):
        assert (await submit(t.stub, job.id, data)).trajectories_trainable == 16
        stepped = await t.stub.Step(api.StepRequest(job_id=job.id, steps=4))
        curves[job.spec.ranks] = stepped.steps
    assert [s.step for s in curves[2]] == [1, 2, 3, 4]
    for a, b in zip(curves[1], curves[2], strict=True):
        assert b.loss == pytest.approx(a.loss, rel=LOSS_TOLERANCE)
        assert b.learning_rate == pytest.approx(a.learning_rate)
        assert b.loss_tokens == a.loss_tokens == 2 * 4 * 5  # both ranks' tokens counted
    assert curves[2][-1].loss < curves[2][0].loss

    cancelled = (await t.stub.CancelTrainingJob(api.CancelTrainingJobRequest(job_id=two.id))).job
    assert cancelled.state == State.TRAINING_JOB_STATE_CANCELLED
    assert left_behind(pids) == []
    assert t.metric("orchard_trainer_running_jobs") == 1
    left = pids_of(t, one.id)
    await trainer.stop_last()  # stopping the service ends the other job's rank
    assert left_behind(left) == []


@pytest.mark.slow
async def test_two_ranks_take_the_same_rl_updates_as_one(trainer):
    t = await trainer.start()
    build = TrajectoryBuilder()
    group = trajectory_pb2.TrajectoryGroup(
        id="g0",
        trajectories=[
            build(
                [build.Turn(inputs=[1, 11 + k, 12, 2], outputs=[13 + k, 14, 3])],
                trajectory_id=f"t{k}",
                reward=float(k % 2),
            )
            for k in range(8)
        ],
    )
    curves = {}
    for ranks, accumulation in ((1, 2), (2, 1)):
        spec = api.TrainingJobSpec(
            mode=api.TRAINING_MODE_RL,
            model="builtin:tiny",
            zero_stage=2,
            learning_rate=3e-3,
            total_steps=8,
            gradient_accumulation=accumulation,
            ranks=ranks,
        )
        job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))).job
        assert job.state == State.TRAINING_JOB_STATE_RUNNING, job.error
        assert (await submit(t.stub, job.id, [group])).trajectories_trainable == 8
        if ranks == 2:
            code, message = await failure(t.stub.Step(api.StepRequest(job_id=job.id, steps=5)))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            assert "on 2 rank(s) need at least 10 trainable samples; 8 are buffered" in message
        curves[ranks] = (await t.stub.Step(api.StepRequest(job_id=job.id, steps=2))).steps
    for a, b in zip(curves[1], curves[2], strict=True):
        assert b.step == a.step
        assert b.loss == pytest.approx(a.loss, rel=LOSS_TOLERANCE, abs=1e-6)
        assert b.loss_tokens == a.loss_tokens == 4 * 3
        for key in ("clip_fraction", "importance_mean", "advantage_mean", "entropy"):
            assert b.extra[key] == pytest.approx(a.extra[key], rel=LOSS_TOLERANCE, abs=1e-6)


def loss_of(model_dir: Path, batch: TokenBatch) -> float:
    """The SFT loss of `batch` under the weights of a model folder."""
    model = load_model_folder(model_dir).model
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return float(sft_loss(logits, batch.targets, batch.loss_mask))


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
async def test_a_checkpoint_saved_at_two_ranks_resumes_at_one(trainer, zero_stage):
    t = await trainer.start(ranks=2)
    data = groups(2, 8)
    job = await create(t, zero_stage=zero_stage, micro_batch_size=4, total_steps=8)
    assert len(pids_of(t, job.id)) == 2
    await submit(t.stub, job.id, data)
    await t.stub.Step(api.StepRequest(job_id=job.id, steps=2))
    saved = (await t.stub.SaveCheckpoint(api.SaveCheckpointRequest(job_id=job.id))).checkpoint
    before = await t.stub.Step(api.StepRequest(job_id=job.id, steps=2))
    await trainer.stop_last()

    # The same job after a restart of the service configured for one rank per job: DeepSpeed
    # cannot repartition ZeRO's optimizer state itself; it resumes from a universal checkpoint.
    t = await trainer.start(ranks=1)
    resumed = (await t.stub.GetTrainingJob(api.GetTrainingJobRequest(job_id=job.id))).job
    assert resumed.state == State.TRAINING_JOB_STATE_RUNNING, resumed.error
    assert len(pids_of(t, job.id)) == 1
    await submit(t.stub, job.id, data)
    after = await t.stub.Step(api.StepRequest(job_id=job.id, steps=2))
    assert [s.step for s in after.steps] == [3, 4]
    # The schedule (and step count) carried over.
    assert [s.learning_rate for s in after.steps] == pytest.approx(
        [s.learning_rate for s in before.steps]
    )
    # The weights carried over: step 3 at one rank trains on micro-batch 2 of the plan, whose
    # loss under the saved weights the test computes itself.
    samples = build_sft_samples(
        [tr for group in data for tr in group.trajectories], SampleConfig()
    ).samples
    plan = MicroBatchPlan(
        samples, micro_batch_size=4, gradient_accumulation=1, world_size=1, pad_id=PAD
    )
    (batch,) = plan.for_step(2, 0)
    expected = loss_of(local(saved.uri) / "model", batch)
    assert after.steps[0].loss == pytest.approx(expected, rel=LOSS_TOLERANCE)
    assert after.steps[1].loss < after.steps[0].loss + 0.5  # still training sensibly


@pytest.mark.slow
async def test_a_killed_rank_fails_its_job_and_leaves_no_rank_behind(trainer):
    t = await trainer.start()
    # Killed while the job waits between calls: the service notices by itself.
    idle = await create(t, ranks=2)
    await submit(t.stub, idle.id, groups(1, 8))
    await t.stub.Step(api.StepRequest(job_id=idle.id, steps=1))
    pids = pids_of(t, idle.id)
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 30
    job = idle
    while job.state == State.TRAINING_JOB_STATE_RUNNING and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        job = (await t.stub.GetTrainingJob(api.GetTrainingJobRequest(job_id=idle.id))).job
    assert job.state == State.TRAINING_JOB_STATE_FAILED
    assert f"rank 1 of 2 (pid {pids[1]}) was killed by SIGKILL" in job.error
    assert left_behind(pids) == []
    code, message = await failure(t.stub.Step(api.StepRequest(job_id=idle.id, steps=1)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "FAILED" in message and "SIGKILL" in message

    # Killed in the middle of a Step: the call fails at once, the other rank is stopped.
    busy = await create(t, ranks=2, total_steps=1000)
    await submit(t.stub, busy.id, groups(1, 8))
    pids = pids_of(t, busy.id)
    step = asyncio.ensure_future(t.stub.Step(api.StepRequest(job_id=busy.id, steps=1000)))
    await asyncio.sleep(3.0)
    assert not step.done()
    os.kill(pids[0], signal.SIGKILL)
    code, message = await asyncio.wait_for(failure(step), timeout=30)
    assert code == grpc.StatusCode.INTERNAL
    assert f"rank 0 of 2 (pid {pids[0]}) was killed by SIGKILL" in message
    job = (await t.stub.GetTrainingJob(api.GetTrainingJobRequest(job_id=busy.id))).job
    assert job.state == State.TRAINING_JOB_STATE_FAILED
    assert "SIGKILL" in job.error
    assert left_behind(pids) == []
    assert t.metric("orchard_trainer_running_jobs") == 0


async def test_a_job_asking_for_more_ranks_than_allowed_is_refused(trainer):
    t = await trainer.start()
    for ranks in (-1, 9):
        code, message = await failure(
            t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=sft_spec(ranks=ranks)))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "spec.ranks" in message and str(ranks) in message
