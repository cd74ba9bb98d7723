"""On-policy distillation in a recipe, the parts that need no service: the RL job's spec (the
estimator and the teacher), the teacher's own line of weights and SFT job, what OPD trains on,
the rollouts a run records for a comparison at equal budget, and the report's RL section."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchard.recipes.pipeline import rl_run, rl_verdict
from orchard.recipes.stages import (
    OPD_TEACHER,
    StageContext,
    _distillable,
    derived_seed,
    models_to_evaluate,
    opd_teacher,
    rl_spec,
    rollout_budget,
    sft_spec,
)
from orchard.recipes.workspace import RunDir, StackEndpoints
from orchard.sdk.recipe import Recipe
from orchard.sdk.report import RunReport, write_report
from orchard.trainer.v1 import trainer_service_pb2 as trainer_api
from orchard.types.v1 import reward_pb2, trajectory_pb2

TEACHER_URL = "file:///store/checkpoints/opd-teacher-step-000004"


def _recipe(tmp_path: Path, **rl: Any) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "swe",
            "tasks": {"builtin": {"count": 12}},
            "stages": {"rl": rl},
            "output_dir": tmp_path / "run",
        }
    )


def _ctx(recipe: Recipe, seed: int = 5) -> StageContext:
    stack = StackEndpoints("127.0.0.1:1", "", "127.0.0.1:2", "", "127.0.0.1:3", "127.0.0.1:4")
    return StageContext(recipe=recipe, run=RunDir.open(recipe), stack=stack, tasks={}, seed=seed)


OPD = {
    "estimator": "opd",
    "sampler": {"kind": "fixed", "n": 4},
    "distillation": {"teacher": {"train": "builtin:small", "epochs": 3}, "coef": 0.5},
}


def test_the_opd_job_names_the_estimator_and_the_published_teacher(tmp_path: Path) -> None:
    ctx = _ctx(_recipe(tmp_path, **OPD))
    teacher = {"model": "builtin:small", "weights": {"version": "v", "location": TEACHER_URL}}
    spec = rl_spec(ctx, "file:///store/checkpoints/sft", teacher)
    assert spec.mode == trainer_api.TRAINING_MODE_RL
    assert spec.advantage_estimator == trainer_api.ADVANTAGE_ESTIMATOR_ON_POLICY_DISTILLATION
    assert spec.distillation.teacher == TEACHER_URL
    assert spec.distillation.coef == 0.5 and spec.distillation.seed == 5
    assert spec.model == "file:///store/checkpoints/sft" and spec.weight_model == "swe-student"
    assert not spec.HasField("critic")
    with pytest.raises(ValueError, match="needs its teacher"):
        rl_spec(ctx, "file:///store/checkpoints/sft")


def test_grpo_and_ppo_jobs_carry_no_teacher(tmp_path: Path) -> None:
    grpo = rl_spec(_ctx(_recipe(tmp_path)), "file:///m")
    assert grpo.advantage_estimator == trainer_api.ADVANTAGE_ESTIMATOR_GROUP_RELATIVE
    assert not grpo.HasField("distillation")
    ppo = rl_spec(_ctx(_recipe(tmp_path / "ppo", estimator="ppo")), "file:///m")
    assert ppo.advantage_estimator == trainer_api.ADVANTAGE_ESTIMATOR_CRITIC
    assert not ppo.HasField("distillation") and ppo.HasField("critic")


def test_the_teacher_trains_on_a_line_of_its_own_with_its_own_settings(tmp_path: Path) -> None:
    ctx = _ctx(_recipe(tmp_path, **OPD))
    line = ctx.line(OPD_TEACHER, "builtin:small")
    assert line.registry_model == "swe-opd-teacher" and line.model == "builtin:small"
    assert ctx.registry_model == "swe-student" and ctx.model == ""
    student = sft_spec(ctx, "file:///d.jsonl", 40)
    teacher = sft_spec(line, "file:///d.jsonl", 60, learning_rate=0.002)
    assert teacher.weight_model == "swe-opd-teacher" and teacher.learning_rate == 0.002
    assert student.learning_rate == ctx.recipe.stages.sft.learning_rate
    # The student's seed is the one it always had; the teacher draws its own.
    assert student.seed == derived_seed(5, "sft") != teacher.seed
    assert teacher.dataset == student.dataset and teacher.total_steps == 60


def test_a_trained_teacher_needs_the_curated_set_and_a_kept_one_is_reused(tmp_path: Path) -> None:
    ctx = _ctx(_recipe(tmp_path, **OPD))
    folder = ctx.run.root / "rl" / OPD_TEACHER
    with pytest.raises(RuntimeError, match="run the collect and curate stages first"):
        opd_teacher(ctx, folder)
    kept = {"model": "builtin:small", "weights": {"version": "t", "location": TEACHER_URL}}
    folder.mkdir(parents=True)
    (folder / "teacher.json").write_text(json.dumps(kept))
    assert opd_teacher(ctx, folder) == kept  # a resumed rl stage trains no second teacher


def test_the_evaluate_stage_runs_the_teacher_on_its_registry_model(tmp_path: Path) -> None:
    ctx = _ctx(_recipe(tmp_path, **OPD))
    ctx.run.finish("sft", {"weights": {"version": "sft-v"}})
    teacher = {"weights": {"version": "teacher-v", "location": TEACHER_URL}}
    ctx.run.finish("rl", {"weights": {"version": "rl-v"}, "distillation": {"teacher": teacher}})
    assert models_to_evaluate(ctx) == [
        ("base", "base", ""),
        ("sft", "sft-v", ""),
        ("rl", "rl-v", ""),
        ("opd-teacher", "teacher-v", OPD_TEACHER),
    ]
    assert ctx.line(OPD_TEACHER).registry_model == "swe-opd-teacher"


def _trajectory(status: int, aborted: bool = False) -> trajectory_pb2.Trajectory:
    t = trajectory_pb2.Trajectory(turns=[trajectory_pb2.Turn(output_token_ids=[1, 2])])
    t.reward.status = status
    if aborted:
        t.outcome = trajectory_pb2.TRAJECTORY_OUTCOME_ABORTED
    return t


def test_opd_trains_on_unscored_rollouts_but_never_on_excluded_or_aborted_ones() -> None:
    assert _distillable(_trajectory(reward_pb2.REWARD_STATUS_SCORED))
    assert _distillable(_trajectory(reward_pb2.REWARD_STATUS_UNSPECIFIED))
    assert not _distillable(_trajectory(reward_pb2.REWARD_STATUS_EXCLUDED))
    assert not _distillable(_trajectory(reward_pb2.REWARD_STATUS_SCORED, aborted=True))
    assert not _distillable(trajectory_pb2.Trajectory())  # nothing captured


def test_the_rollout_budget_counts_what_each_step_ran_and_took() -> None:
    steps = [
        {"rollouts_run_by_job": 10, "rollouts": 8, "samples": 8},
        {"rollouts_run_by_job": 6, "rollouts": 4, "samples": 0},
    ]
    assert rollout_budget(steps) == {
        "steps": 2,
        "run_per_step": [10, 6],
        "run": 16,
        "in_groups_per_step": [8, 4],
        "in_groups": 12,
        "trained_per_step": [8, 0],
    }
    assert rollout_budget([])["run"] == 0


def _model(resolved: int, attempts: int = 10, **extra: Any) -> dict[str, Any]:
    return {"resolved": resolved, "attempts": attempts, **extra}


def test_the_verdict_says_what_opd_did_and_where_the_teacher_stands() -> None:
    better = rl_verdict("opd", {"sft": _model(3), "rl": _model(5), "opd-teacher": _model(8)})
    assert "OPD raised the held-out resolve rate from 30.0% (3/10) (sft) to 50.0% (5/10)" in better
    assert "+20.0 points" in better and "the teacher resolves 80.0% (8/10)" in better
    assert "a better model for OPD to move the student toward" in better
    worse = rl_verdict("opd", {"sft": _model(6), "rl": _model(4), "opd-teacher": _model(2)})
    assert "OPD lowered" in worse and "-20.0 points" in worse
    assert "OPD can only move the student toward it" in worse
    same = rl_verdict(
        "opd", {"sft": _model(4), "rl": _model(4, same_weights_as="sft"), "opd-teacher": _model(9)}
    )
    assert "handed on the sft model's weights unchanged (no RL version did better" in same
    idle = rl_verdict("grpo", {"sft": _model(4), "rl": _model(4, same_weights_as="sft")}, 0)
    assert "(no RL step updated the model: no group carried signal)" in idle
    assert rl_verdict("grpo", {"base": _model(1), "rl": _model(1)}).startswith(
        "RL (grpo) left the held-out resolve rate where it was"
    )
    assert rl_verdict("opd", {"sft": _model(1)}) == ""  # nothing evaluated after RL


def test_the_report_names_the_estimator_the_teacher_and_the_reverse_kl(tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, **OPD)
    teacher = {
        "model": "builtin:small",
        "trained": "SFT, 3 epochs at learning rate 0.003, on the curated teacher trajectories",
        "registry_model": "swe-opd-teacher",
        "weights": {"version": "job-step-000006", "location": TEACHER_URL},
        "steps": 6,
        "first_loss": 5.2,
        "last_loss": 1.3,
        "validation": {"best_loss": 1.7, "best_step": 6, "held_out_tasks": ["a"]},
    }
    rl = {
        "estimator": "opd",
        "distillation": {"coef": 0.5, "teacher": teacher},
        "steps": [
            {"step": 1, "rollouts_run_by_job": 8, "rollouts": 8, "reward_mean": -0.5,
             "loss": 0.1, "metrics": {"distill_reverse_kl": 0.8}, "published": "rl-1"},
            {"step": 2, "rollouts_run_by_job": 8, "rollouts": 8, "reward_mean": None,
             "published": None},
        ],
    }  # fmt: skip
    models = {"sft": _model(2), "rl": _model(3), "opd-teacher": _model(6)}
    section = rl_run(recipe, rl, models)
    assert section.rollouts == 16 and section.steps[0].distill_reverse_kl == 0.8
    text = write_report(RunReport(title="t", rl=section), tmp_path / "report").read_text()
    assert "- estimator: opd (on-policy distillation" in text
    assert "sampler: fixed, n 4, 4 group(s) per step" in text
    assert (
        "- teacher: builtin:small, SFT, 3 epochs at learning rate 0.003, on the curated teacher "
        "trajectories; published as swe-opd-teacher job-step-000006; SFT loss 5.2 to 1.3 over "
        "6 steps, validation loss 1.7 at step 6 on 1 held-out task(s); held-out resolve rate "
        "(as opd-teacher) 60.0% (6/10)"
    ) in text
    assert "- rollouts run: 16 over 2 step(s) (per step: 8, 8;" in text
    assert "| step | rollouts | reward mean | loss | distill reverse KL | published |" in text
    assert "| 1 | 8 | -0.5 | 0.1 | 0.8 | rl-1 |" in text
    assert "| 2 | 8 | - | - | - | - |" in text
    assert "OPD raised the held-out resolve rate" in text
    unevaluated = rl_run(recipe, rl, {})
    assert unevaluated.teacher.endswith("not evaluated on the held-out tasks")
    # A GRPO run's table has no distillation column.
    steps = [{k: v for k, v in s.items() if k != "metrics"} for s in rl["steps"]]
    grpo = rl_run(_recipe(tmp_path / "g"), {"estimator": "grpo", "steps": steps}, {})
    text = write_report(RunReport(title="t", rl=grpo), tmp_path / "g-report").read_text()
    assert "estimator: grpo" in text and "distill" not in text and "teacher" not in text
