"""On-policy distillation chosen per job through the TrainerService, over real gRPC on
127.0.0.1 with a real etcd and real rank processes: a teacher model folder in the artifact
store scores the student's tokens, trajectories train without rewards, Steps report the
teacher-student log-ratio, and the student's reverse KL to the teacher falls; bad teacher
settings are refused before any job exists."""

from __future__ import annotations

import math
from typing import Any

import grpc
import pytest

from orchard.lm.model_folder import load_model_folder, save_model_folder
from orchard.trainer.batch import collate
from orchard.trainer.policy import load_policy
from orchard.trainer.rl import RlConfig, build_rl_batch
from orchard.trainer.v1 import trainer_service_pb2 as api
from orchard.types.v1 import trajectory_pb2

from .conftest import TrajectoryBuilder
from .test_distillation import ACTIONS, PROMPTS, exact_reverse_kl, sharp_teacher, trajectories
from .test_service import Running, failure, local, submit, trainer, trainer_config

__all__ = ["trainer", "trainer_config"]  # fixtures used here

State = api.TrainingJobState
OPD = api.ADVANTAGE_ESTIMATOR_ON_POLICY_DISTILLATION


def opd_spec(teacher: str = "builtin:small", **fields: Any) -> api.TrainingJobSpec:
    spec: dict[str, Any] = dict(
        mode=api.TRAINING_MODE_RL,
        model="builtin:tiny",
        learning_rate=1e-2,
        total_steps=6,
        micro_batch_size=4,
        gradient_accumulation=2,
        advantage_estimator=OPD,
        distillation=api.DistillationConfig(teacher=teacher),
    )
    spec.update(fields)
    return api.TrainingJobSpec(**spec)


def batch() -> list[trajectory_pb2.TrajectoryGroup]:
    """The teacher's answers without rewards or sampling logprobs (six), a group of two whose
    rewards agree (GRPO drops it) and an excluded trajectory (never trained on)."""
    build = TrajectoryBuilder()
    agree = []
    for k in range(2):
        t = build(
            [build.Turn(inputs=PROMPTS[0], outputs=ACTIONS[0], logprobs=[])],
            trajectory_id=f"agree-{k}",
            task_id="agree",
            reward=1.0,
        )
        t.rollout_id = f"agree-r{k}"
        agree.append(t)
    excluded = build([build.Turn(inputs=[1, 2], outputs=[5, 3])], trajectory_id="x", excluded=True)
    return [
        trajectory_pb2.TrajectoryGroup(
            id="unscored", trajectories=trajectories(build, logprobs=[], reward=None)
        ),
        trajectory_pb2.TrajectoryGroup(id="agree", trajectories=[*agree, excluded]),
    ]


async def create(t: Running, spec: api.TrainingJobSpec) -> api.TrainingJob:
    job = (await t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))).job
    assert job.state == State.TRAINING_JOB_STATE_RUNNING, job.error
    return job


async def test_an_opd_job_trains_without_rewards_toward_its_teacher(trainer, tmp_path):
    teacher = sharp_teacher(7, vocab_size=None)
    tokenizer = load_policy("builtin:tiny").tokenizer
    assert tokenizer is not None
    folder = save_model_folder(tmp_path / "store" / "teachers" / "sharp", teacher, tokenizer)
    t = await trainer.start()
    job = await create(t, opd_spec(teacher=folder.as_uri()))
    assert job.spec.advantage_estimator == OPD
    assert job.spec.distillation.teacher == folder.as_uri()
    assert job.spec.distillation.coef == 1.0

    data = batch()
    loss_tokens = sum(len(a) for a in ACTIONS) * 2 + len(ACTIONS[0]) * 2
    ratios = []
    for step in range(1, 5):
        accepted = await submit(t.stub, job.id, data)
        # Unscored trajectories and the agreeing group train; the excluded one never does.
        assert (accepted.trajectories_trainable, accepted.trajectories_skipped) == (8, 1)
        (metrics,) = (await t.stub.Step(api.StepRequest(job_id=job.id, steps=1))).steps
        assert metrics.step == step
        assert metrics.extra["distill_tokens"] == loss_tokens == metrics.loss_tokens
        assert metrics.extra["distill_student_recomputed"] == 8  # no sampling logprobs
        assert {"advantage_mean", "clip_fraction", "entropy"} <= set(metrics.extra)
        assert metrics.extra["reward_mean"] == pytest.approx(1.0)  # the two scored ones
        ratios.append(metrics.extra["distill_reverse_kl"])
    assert ratios[0] < -2.0  # the teacher is sure of tokens the student barely knows
    assert abs(ratios[-1]) < 0.75 * abs(ratios[0])

    saved = (await t.stub.SaveCheckpoint(api.SaveCheckpointRequest(job_id=job.id))).checkpoint
    trained = load_model_folder(local(saved.uri) / "model").model
    start = load_policy("builtin:tiny").model
    rows = list(data[0].trajectories)
    tokens = collate(
        build_rl_batch(rows, RlConfig(require_reward=False, skip_zero_advantage=False)).samples,
        pad_id=0,
    )
    # 2,048 tokens to move mass over (the built-in vocabulary): it falls by about a nat.
    before, after = (exact_reverse_kl(m, teacher, tokens) for m in (start, trained))
    assert after < before - 0.5, (before, after)


async def test_bad_distillation_settings_are_refused_naming_the_field(trainer, tmp_path):
    other = load_policy("builtin:tiny").tokenizer
    assert other is not None
    other.add_tokens(["<teacher-only>"])
    mismatched = save_model_folder(
        tmp_path / "store" / "teachers" / "other", load_policy("builtin:tiny").model, other
    )
    t = await trainer.start()
    sft = api.TRAINING_MODE_SFT
    teacher = api.DistillationConfig(teacher="builtin:small")
    grpo, critic = api.ADVANTAGE_ESTIMATOR_GROUP_RELATIVE, api.ADVANTAGE_ESTIMATOR_CRITIC
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases: list[tuple[api.TrainingJobSpec, grpc.StatusCode, list[str]]] = [
        (opd_spec(mode=sft), invalid, ["spec.distillation", "RL jobs"]),
        (
            opd_spec(mode=sft, distillation=None),
            invalid,
            ["spec.advantage_estimator", "RL jobs"],
        ),
        (opd_spec(distillation=None), invalid, ["spec.distillation.teacher is required"]),
        (
            opd_spec(distillation=api.DistillationConfig(coef=2.0)),
            invalid,
            ["spec.distillation.teacher is required", "builtin:<size>"],
        ),
        (opd_spec("builtin:huge"), invalid, ["spec.distillation.teacher", "unknown built-in"]),
        (opd_spec(str(tmp_path)), invalid, ["spec.distillation.teacher", "file://"]),
        (
            opd_spec((tmp_path / "store" / "nothing").as_uri()),
            grpc.StatusCode.NOT_FOUND,
            ["spec.distillation.teacher"],
        ),
        (
            opd_spec(mismatched.as_uri()),
            invalid,
            ["spec.distillation.teacher", "another vocabulary", "<teacher-only>"],
        ),
        (
            opd_spec(advantage_estimator=grpo),
            invalid,
            ["spec.distillation", "set spec.advantage_estimator"],
        ),
        (
            opd_spec(advantage_estimator=critic, critic=api.CriticConfig()),
            invalid,
            ["spec.distillation", "ADVANTAGE_ESTIMATOR_ON_POLICY_DISTILLATION"],
        ),
        (opd_spec(advantage_estimator=9), invalid, ["ON_POLICY_DISTILLATION (3)"]),
    ]
    for coef in (0.0, -1.0, math.nan, math.inf):
        bad = api.DistillationConfig(teacher="builtin:small", coef=coef)
        cases.append((opd_spec(distillation=bad), invalid, ["spec.distillation.coef", "above 0"]))
    for spec, code, needles in cases:
        got, message = await failure(
            t.stub.CreateTrainingJob(api.CreateTrainingJobRequest(spec=spec))
        )
        assert got == code, message
        for needle in needles:
            assert needle in message, (needle, message)
    listed = await t.stub.ListTrainingJobs(api.ListTrainingJobsRequest())
    assert list(listed.jobs) == []  # nothing was created

    # A larger built-in teacher (the same offline tokenizer) loads in the rank and scores.
    job = await create(
        t, opd_spec(distillation=api.DistillationConfig(teacher=teacher.teacher, coef=0.5, seed=1))
    )
    assert job.spec.distillation.coef == 0.5
    await submit(t.stub, job.id, batch())
    (metrics,) = (await t.stub.Step(api.StepRequest(job_id=job.id, steps=1))).steps
    assert metrics.extra["distill_tokens"] > 0
