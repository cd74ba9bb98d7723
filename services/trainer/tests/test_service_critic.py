"""PPO with a value model chosen per job through the TrainerService, over real gRPC on
127.0.0.1 with a real etcd: the critic's settings are checked and resolved, value pretraining
fits the value model before the first policy step, Steps report the critic's numbers, the
checkpoint carries the value model and a restarted service resumes it; a default RL job still
uses group-relative advantages."""

from __future__ import annotations

import math
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
from orchard.trainer.config import EtcdConfig, TrainerConfig, WeightsConfig, WorkersConfig
from orchard.trainer.policy import load_policy
from orchard.trainer.v1 import trainer_service_pb2 as api
from orchard.types.v1 import trajectory_pb2

from .conftest import TrajectoryBuilder
from .test_service import Running, Trainer, failure, local, submit

State = api.TrainingJobState
CRITIC = api.ADVANTAGE_ESTIMATOR_CRITIC

PRETRAIN_STEPS = 10
TOTAL_STEPS = 6
VALUE_LR = 0.005


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


def rl_spec(**fields: Any) -> api.TrainingJobSpec:
    spec: dict[str, Any] = dict(
        mode=api.TRAINING_MODE_RL,
        model="builtin:tiny",
        learning_rate=1e-3,
        total_steps=TOTAL_STEPS,
        micro_batch_size=2,
    )
    spec.update(fields)
    return api.TrainingJobSpec(**spec)


def ppo_spec(**fields: Any) -> api.TrainingJobSpec:
    critic = api.CriticConfig(learning_rate=VALUE_LR, value_pretrain_steps=PRETRAIN_STEPS)
    return rl_spec(advantage_estimator=CRITIC, critic=critic, **fields)


def scored_groups() -> list[trajectory_pb2.TrajectoryGroup]:
    """Three groups of a rewarded action (13, 14) and an unrewarded one (15, 16), twice each,
    and a group whose two rewards agree (GRPO gives it no advantage). 14 trajectories of three
    action tokens each; 8 rewarded; each half of the batch holds 4 rewarded of 7."""
    build = TrajectoryBuilder()
    out = []
    for g in range(3):
        trajectories = []
        for k in range(4):
            good = k % 2 == 0
            action = [13, 14, 3] if good else [15, 16, 3]
            t = build(
                [build.Turn(inputs=[1, 11, 12 + g, 2], outputs=action)],
                trajectory_id=f"g{g}-{k}",
                task_id=f"task{g}",
                reward=1.0 if good else 0.0,
            )
            t.rollout_id = f"r{g}-{k}"  # one rollout each: no shared prefix is masked
            trajectories.append(t)
        out.append(trajectory_pb2.TrajectoryGroup(id=f"g{g}", trajectories=trajectories))
    agreeing = []
    for k in range(2):
        t = build(
            [build.Turn(inputs=[1, 11, 20, 2], outputs=[13, 14, 3])],
            trajectory_id=f"same-{k}",
            task_id="same",
            reward=1.0,
        )
        t.rollout_id = f"same-{k}"
        agreeing.append(t)
    out.append(trajectory_pb2.TrajectoryGroup(id="same", trajectories=agreeing))
    return out


def value_lr(critic_steps_before: int) -> float:
    """The value model's rate at its step after `critic_steps_before` steps: cosine, no
    warmup, over pretraining and one value step per policy step."""
    total = PRETRAIN_STEPS + TOTAL_STEPS
    return VALUE_LR * 0.5 * (1.0 + math.cos(math.pi * critic_steps_before / total))


async def create(t: Running, spec: api.TrainingJobSpec) -> api.TrainingJob:
    job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))).job
    assert job.state == State.TRAINING_JOB_STATE_RUNNING, job.error
    return job


CRITIC_KEYS = {
    "value_loss",
    "value_mean",
    "return_mean",
    "value_clip_fraction",
    "value_grad_norm",
    "value_learning_rate",
}
PRETRAIN_KEYS = {"value_pretrain_steps", "value_pretrain_loss_first", "value_pretrain_loss_last"}


async def test_a_ppo_job_pretrains_its_value_model_then_steps_both_and_resumes_them(trainer):
    t = await trainer.start()
    job = await create(t, ppo_spec())
    critic = job.spec.critic
    assert job.spec.advantage_estimator == CRITIC
    assert (critic.learning_rate, critic.steps_per_update) == (pytest.approx(VALUE_LR), 1)
    assert (critic.gamma, critic.gae_lambda, critic.value_clip) == (1.0, 1.0, pytest.approx(0.2))
    assert critic.value_pretrain_steps == PRETRAIN_STEPS

    data = scored_groups()
    accepted = await submit(t.stub, job.id, data)
    # The agreeing group counts too: the value model gives its tokens advantages.
    assert (accepted.trajectories_trainable, accepted.trajectories_skipped) == (14, 0)

    first, second = (await t.stub.Step(api.StepRequest(job_id=job.id, steps=2))).steps
    assert [first.step, second.step] == [1, 2]
    assert set(first.extra) >= CRITIC_KEYS and set(second.extra) >= CRITIC_KEYS
    # Pretraining ran once, before the first policy step, on the returns: the zero-headed
    # value model's first loss is 0.5 * mean(R^2) over the first half's loss tokens, 4 of 7
    # trajectories rewarded; it fell as the value model fitted the returns.
    assert set(first.extra) >= PRETRAIN_KEYS and not PRETRAIN_KEYS & set(second.extra)
    assert first.extra["value_pretrain_steps"] == PRETRAIN_STEPS
    loss_first = first.extra["value_pretrain_loss_first"]
    assert loss_first == pytest.approx(0.5 * 4 / 7, rel=1e-5)
    assert first.extra["value_pretrain_loss_last"] < 0.6 * loss_first
    # The first policy step already sees fitted values (a fresh value model says 0, and its
    # advantages would be the rewards, 4/7 on average).
    assert first.extra["value_mean"] > 0.2
    assert abs(first.extra["advantage_mean"]) < 0.5 * 4 / 7
    for s in (first, second):
        assert s.extra["return_mean"] == pytest.approx(4 / 7, rel=1e-5)  # gamma = 1: R
        assert 0.0 <= s.extra["value_clip_fraction"] <= 1.0
        assert s.extra["value_loss"] < loss_first
        assert s.grad_norm > 0 and s.extra["value_grad_norm"] > 0
        assert {"clip_fraction", "entropy", "advantage_mean"} <= set(s.extra)
    # The value model runs its own schedule: after the pretraining steps, one step per policy
    # step.
    assert first.extra["value_learning_rate"] == pytest.approx(value_lr(PRETRAIN_STEPS))
    assert second.extra["value_learning_rate"] == pytest.approx(value_lr(PRETRAIN_STEPS + 1))
    assert first.learning_rate == pytest.approx(1e-3)
    assert t.metric("orchard_trainer_value_loss_ratio", job=job.id, mode="rl") == pytest.approx(
        second.extra["value_loss"]
    )

    saved = (await t.stub.SaveCheckpoint(api.SaveCheckpointRequest(job_id=job.id))).checkpoint
    assert saved.step == 2
    assert (local(saved.uri) / "critic").is_dir()
    # The policy moved away from its starting weights.
    trained = load_model_folder(local(saved.uri) / "model").model.state_dict()
    start = load_policy("builtin:tiny").model.state_dict()
    moved = [name for name, w in start.items() if not torch.equal(w, trained[name])]
    assert moved
    await trainer.stop_last()

    # A restarted service resumes the job with its value model: no second pretraining, and
    # the value model's schedule continues where it stopped.
    t = await trainer.start()
    resumed = (await t.stub.GetTrainingJob(api.GetTrainingJobRequest(job_id=job.id))).job
    assert resumed.state == State.TRAINING_JOB_STATE_RUNNING, resumed.error
    await submit(t.stub, job.id, data)
    (third,) = (await t.stub.Step(api.StepRequest(job_id=job.id, steps=1))).steps
    assert third.step == 3
    assert not PRETRAIN_KEYS & set(third.extra)
    assert third.extra["value_learning_rate"] == pytest.approx(value_lr(PRETRAIN_STEPS + 2))
    assert third.extra["value_mean"] > 0.2


async def test_a_default_rl_job_keeps_group_relative_advantages(trainer):
    t = await trainer.start()
    job = await create(t, rl_spec())
    assert job.spec.advantage_estimator == api.ADVANTAGE_ESTIMATOR_GROUP_RELATIVE
    assert not job.spec.HasField("critic")
    accepted = await submit(t.stub, job.id, scored_groups())
    # The group whose rewards agree has no advantage and stays out of the loss.
    assert (accepted.trajectories_trainable, accepted.trajectories_skipped) == (12, 2)
    (step,) = (await t.stub.Step(api.StepRequest(job_id=job.id, steps=1))).steps
    assert not (CRITIC_KEYS | PRETRAIN_KEYS) & set(step.extra)
    assert step.extra["advantage_mean"] == pytest.approx(0.0, abs=1e-6)
    saved = (await t.stub.SaveCheckpoint(api.SaveCheckpointRequest(job_id=job.id))).checkpoint
    assert not (local(saved.uri) / "critic").exists()


async def test_bad_critic_settings_are_refused_naming_the_field_and_its_range(trainer):
    t = await trainer.start()
    sft = api.TRAINING_MODE_SFT
    cases: list[tuple[api.TrainingJobSpec, list[str]]] = [
        (rl_spec(mode=sft, advantage_estimator=CRITIC), ["spec.advantage_estimator", "RL jobs"]),
        (rl_spec(mode=sft, critic=api.CriticConfig()), ["spec.critic", "RL jobs"]),
        (rl_spec(advantage_estimator=7), ["spec.advantage_estimator", "CRITIC (2)"]),
        (
            rl_spec(critic=api.CriticConfig(value_pretrain_steps=4)),
            ["spec.critic", "set spec.advantage_estimator"],
        ),
        (
            rl_spec(
                advantage_estimator=api.ADVANTAGE_ESTIMATOR_GROUP_RELATIVE,
                critic=api.CriticConfig(gamma=0.9),
            ),
            ["spec.critic", "ADVANTAGE_ESTIMATOR_CRITIC"],
        ),
    ]
    bad_critic: list[tuple[dict[str, Any], list[str]]] = [
        ({"learning_rate": -1.0}, ["spec.critic.learning_rate", "positive", "-1"]),
        ({"learning_rate": math.inf}, ["spec.critic.learning_rate", "inf"]),
        ({"steps_per_update": -1}, ["spec.critic.steps_per_update", "or more", "-1"]),
        ({"gamma": 1.5}, ["spec.critic.gamma", "[0, 1]", "1.5"]),
        ({"gamma": -0.1}, ["spec.critic.gamma", "[0, 1]"]),
        ({"gamma": math.nan}, ["spec.critic.gamma", "[0, 1]", "nan"]),
        ({"gae_lambda": 2.0}, ["spec.critic.gae_lambda", "[0, 1]", "2.0"]),
        ({"value_clip": -0.2}, ["spec.critic.value_clip", "0 (no clipping)", "-0.2"]),
        ({"value_clip": math.inf}, ["spec.critic.value_clip", "inf"]),
        ({"value_pretrain_steps": -3}, ["spec.critic.value_pretrain_steps", "or more", "-3"]),
    ]
    for fields, needles in bad_critic:
        cases.append(
            (rl_spec(advantage_estimator=CRITIC, critic=api.CriticConfig(**fields)), needles)
        )
    for spec, needles in cases:
        code, message = await failure(
            t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT, message
        for needle in needles:
            assert needle in message, (needle, message)
    listed = await t.stub.ListTrainingJobs(api.ListTrainingJobsRequest())
    assert list(listed.jobs) == []  # nothing was created

    # The edges of the ranges are accepted: gamma and lambda 0, no clipping, no pretraining.
    edges = api.CriticConfig(gamma=0.0, gae_lambda=0.0, value_clip=0.0, value_pretrain_steps=0)
    job = await create(t, rl_spec(advantage_estimator=CRITIC, critic=edges))
    assert (job.spec.critic.gamma, job.spec.critic.gae_lambda) == (0.0, 0.0)
    assert job.spec.critic.value_clip == 0.0
    assert job.spec.critic.learning_rate == pytest.approx(1e-3)  # the job's


# Two ranks all-reduce what one rank accumulates: the same numbers summed in another order.
LOSS_TOLERANCE = 1e-4


@pytest.mark.slow
async def test_two_ranks_take_the_same_ppo_steps_as_one_and_the_value_model_resumes_at_one(
    trainer,
):
    t = await trainer.start(ranks=2)
    data = scored_groups()
    one = await create(t, ppo_spec(zero_stage=2, ranks=1, gradient_accumulation=2))
    two = await create(t, ppo_spec(zero_stage=2))  # ranks 0: the service's 2
    curves = {}
    for job in (one, two):
        assert (await submit(t.stub, job.id, data)).trajectories_trainable == 14
        curves[job.id] = (await t.stub.Step(api.StepRequest(job_id=job.id, steps=2))).steps
    assert len(t.app.jobs.rank_pids(two.id)) == 2
    keys = ["value_pretrain_loss_first", "value_pretrain_loss_last"]
    for a, b in zip(curves[one.id], curves[two.id], strict=True):
        assert b.loss == pytest.approx(a.loss, rel=LOSS_TOLERANCE)
        for key in ["value_loss", "value_mean", *keys]:
            if key in a.extra:
                assert b.extra[key] == pytest.approx(a.extra[key], rel=LOSS_TOLERANCE), key
    assert all(key in curves[two.id][0].extra for key in keys)
    await t.stub.CancelTrainingJob(api.CancelTrainingJobRequest(job_id=one.id))
    saved = (await t.stub.SaveCheckpoint(api.SaveCheckpointRequest(job_id=two.id))).checkpoint
    assert (local(saved.uri) / "critic").is_dir()
    await trainer.stop_last()

    # At one rank the ZeRO-2 state of both models goes through DeepSpeed's universal format.
    t = await trainer.start(ranks=1)
    resumed = (await t.stub.GetTrainingJob(api.GetTrainingJobRequest(job_id=two.id))).job
    assert resumed.state == State.TRAINING_JOB_STATE_RUNNING, resumed.error
    assert len(t.app.jobs.rank_pids(two.id)) == 1
    await submit(t.stub, two.id, data)
    (third,) = (await t.stub.Step(api.StepRequest(job_id=two.id, steps=1))).steps
    assert third.step == 3
    assert not PRETRAIN_KEYS & set(third.extra)
    assert third.extra["value_learning_rate"] == pytest.approx(value_lr(PRETRAIN_STEPS + 2))
    assert third.extra["value_mean"] > 0.2
