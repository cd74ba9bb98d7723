"""A job's ranks as Ray actors (`workers.kind: ray`), on a real local Ray bound to 127.0.0.1
that the service starts and ends: two ranks under ZeRO-2 follow the loss curve of one local
rank process, a killed actor fails its job with a message, and nothing the service's Ray
started is left once it stops."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from orchard.core.artifacts import ArtifactsConfig
from orchard.core.config import ServerConfig
from orchard.core.local_ray import descendants as _descendants
from orchard.trainer.config import (
    EtcdConfig,
    RayWorkersConfig,
    TrainerConfig,
    WeightsConfig,
    WorkersConfig,
)
from orchard.trainer.v1 import trainer_service_pb2 as api

from .test_service import Trainer, groups, sft_spec, submit
from .test_worker_group import LOSS_TOLERANCE, alive, pids_of

State = api.TrainingJobState


@pytest.fixture
def configure(etcd, tmp_path: Path) -> Callable[..., TrainerConfig]:
    namespace = f"test/{uuid.uuid4().hex}/"

    def make(kind: str = "subprocess", **_: Any) -> TrainerConfig:
        return TrainerConfig(
            server=ServerConfig(listen=["127.0.0.1:0"], metrics_address="127.0.0.1:0"),
            etcd=EtcdConfig(
                endpoints=[etcd.endpoint], prefix=namespace + "trainer/", weights_prefix=namespace
            ),
            artifacts=ArtifactsConfig(root=(tmp_path / "store").as_uri()),
            weights=WeightsConfig(scratch_dir=str(tmp_path / "scratch")),
            workers=WorkersConfig(
                kind=kind,  # type: ignore[arg-type]
                ray=RayWorkersConfig(init_cpus=2),
                start_timeout_s=60,
            ),
        )

    return make


@pytest.fixture
async def trainer(configure) -> AsyncIterator[Trainer]:
    running = Trainer(configure)
    try:
        yield running
    finally:
        await running.close()


@pytest.mark.slow
async def test_ranks_on_ray_train_like_local_ranks_and_a_lost_actor_fails_the_job(trainer):
    before = _descendants(os.getpid())
    data = groups(2, 8)
    common = dict(zero_stage=2, micro_batch_size=4, total_steps=8, warmup_steps=1)

    local = await trainer.start()
    job = (
        await local.stub.CreateTrainingJob(
            api.CreateTrainingJobRequest(spec=sft_spec(ranks=1, gradient_accumulation=2, **common))
        )
    ).job
    await submit(local.stub, job.id, data)
    expected = (await local.stub.Step(api.StepRequest(job_id=job.id, steps=3))).steps
    # Ended, so the next service does not resume it (on Ray, where it would hold a CPU).
    await local.stub.CancelTrainingJob(api.CancelTrainingJobRequest(job_id=job.id))
    await trainer.stop_last()

    t = await trainer.start(kind="ray")
    job = (
        await t.stub.CreateTrainingJob(
            api.CreateTrainingJobRequest(spec=sft_spec(ranks=2, gradient_accumulation=1, **common))
        )
    ).job
    assert job.state == State.TRAINING_JOB_STATE_RUNNING, job.error
    pids = pids_of(t, job.id)
    assert len(pids) == 2 and all(alive(p) for p in pids)
    await submit(t.stub, job.id, data)
    got = (await t.stub.Step(api.StepRequest(job_id=job.id, steps=3))).steps
    for a, b in zip(expected, got, strict=True):
        assert b.loss == pytest.approx(a.loss, rel=LOSS_TOLERANCE)
        assert b.loss_tokens == a.loss_tokens

    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while job.state == State.TRAINING_JOB_STATE_RUNNING and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        job = (await t.stub.GetTrainingJob(api.GetTrainingJobRequest(job_id=job.id))).job
    assert job.state == State.TRAINING_JOB_STATE_FAILED
    assert f"rank 1 of 2 (Ray actor, pid {pids[1]})" in job.error
    assert not any(alive(p) for p in pids)

    await trainer.stop_last()  # ends the local Ray the service started
    left = [p for p in _descendants(os.getpid()) - before if alive(p)]
    assert left == []
