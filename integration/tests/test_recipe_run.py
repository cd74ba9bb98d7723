"""A reduced recipe end to end against real services: etcd, orchard-env (local runtime),
orchard-reward, orchard-rollout and orchard-trainer as processes. Every rollout is an
orchard-rollout job: the scripted teacher's (a scripted policy in the job spec, which the
rollout service plays itself) and the student's (RL sampling, validation, evaluation: a weight
version on the service's local engine behind its capture proxy); SFT and RL train in
orchard-trainer. Checks the artifacts each stage leaves: teacher trajectories in the student's
tokens with loss masks, credit from the reward service's scripted judge on failed ones, a
published weight version, RL groups with captured tokens of the version that sampled them,
evaluation numbers in the report; then that a second run resumes (runs nothing again) and that
one stage runs alone on request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchard.recipes.pipeline import run_recipe
from orchard.recipes.recipe_tasks import prepare_tasks
from orchard.recipes.stages import read_groups
from orchard.recipes.weights_client import WeightVersions
from orchard.recipes.workspace import RunDir, StackEndpoints
from orchard.sdk.recipe import Recipe
from orchard.trainer.datasets import read_trajectories
from orchard.types.v1 import reward_pb2

from .conftest import REDUCED_RECIPE, EnvStack, recipe_stack, stage_done, written_recipe

# The whole reduced recipe runs in the first test's setup (module fixture `report`).
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(1200)]

RECIPE = REDUCED_RECIPE


@dataclass(frozen=True)
class Services:
    env: EnvStack
    endpoints: StackEndpoints


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    with recipe_stack(tmp_path_factory) as env:
        yield Services(env, env.endpoints())


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Recipe:
    return written_recipe(tmp_path_factory, RECIPE)


@pytest.fixture(scope="module")
def report(services: Services, recipe: Recipe) -> Path:
    return run_recipe(recipe, services.endpoints, progress=False, workers=3, say=lambda _: None)


def test_collect_scores_the_teacher_and_tokenizes_its_conversations(
    report: Path, recipe: Recipe
) -> None:
    assert recipe.output_dir is not None
    collect = stage_done(recipe, "collect")
    assert collect["rollouts"] == 10  # 5 SFT tasks x 2 attempts
    assert collect["resolved"] + collect["unresolved"] == 10
    assert collect["rollout_job"]
    # The teacher ran as an orchard-rollout job of a scripted policy the service played behind
    # a capture proxy: groups of two per task, each rollout with its reward, its captured turns
    # (the built-in tokenizer) and the tool loop's conversation.
    groups = read_groups(recipe.output_dir / "collect" / "groups.jsonl")
    assert len(groups) == 5 and all(len(g.trajectories) == 2 for g in groups)
    rewards = {t.reward.value for g in groups for t in g.trajectories}
    assert rewards <= {1.0, -1.0} and 1.0 in rewards  # ScoreTests: resolved or not
    for trajectory in (t for g in groups for t in g.trajectories):
        assert trajectory.turns
        assert {t.weight_version for t in trajectory.turns} == {"scripted:scripted-teacher"}
        conversation = json.loads(trajectory.conversation_json)
        assert [m["role"] for m in conversation[:2]] == ["system", "user"]
        assert any(m["role"] == "assistant" for m in conversation)
    # The scored conversations went to orchard-trainer without the captured turns; it rendered
    # them in the student's tokenizer.
    sent = list(read_trajectories(recipe.output_dir / "collect" / "conversations.jsonl"))
    assert len(sent) == 10 and all(t.conversation_json and not t.turns for t in sent)
    rows = list(read_trajectories(recipe.output_dir / "collect" / "trajectories.jsonl"))
    assert len(rows) == collect["trajectories"] == 10 and "unrendered" not in collect
    for row in rows:
        assert row.turns and all(t.output_token_ids for t in row.turns)
        assert all(len(t.output_loss_mask) == len(t.output_token_ids) for t in row.turns)
        assert row.turns[0].weight_version == "teacher:scripted-teacher"
        assert row.metadata["repository"].startswith("orchard/")


def test_credit_marks_rise_segments_on_failed_trajectories(report: Path, recipe: Recipe) -> None:
    assert recipe.output_dir is not None
    credit = stage_done(recipe, "credit")
    rows = list(read_trajectories(recipe.output_dir / "credit" / "trajectories.jsonl"))
    assert credit["failed"] == len(rows) + sum(credit["excluded"].values())
    for row in rows:
        assert row.reward.value < 0
        # The failure path reads, runs the tests (the rise), then breaks the code.
        assert [(s.start, s.end) for s in row.credit.rise_segments] == [(1, 1)]
        assert row.credit.step_values[2] < row.credit.step_values[1]
        assert row.credit.estimator == "judge:scripted-judge"  # the reward service's


def test_sft_trains_on_curated_rows_and_publishes_a_version(
    report: Path, recipe: Recipe, services: Services
) -> None:
    assert recipe.output_dir is not None
    sft = stage_done(recipe, "sft")
    assert sft["samples"] >= 1 and sft["steps"] >= 1
    curated = list(read_trajectories(recipe.output_dir / "curate" / "sft.jsonl"))
    successes = {r.task_id for r in curated if r.reward.value > 0}
    assert len([r for r in curated if r.reward.value > 0]) == len(successes)  # shortest only
    # orchard-trainer curated and counted: the SFT job trained on the dataset it wrote to the
    # store (the run folder holds a copy) and its sample count sized the schedule.
    curate = stage_done(recipe, "curate")
    assert curate["kept"] == len(curated) and sft["samples"] == curate["samples"]
    assert curate["dataset"].startswith(services.endpoints.artifacts + "/recipes/datasets/")
    stored = Path(curate["dataset"].removeprefix("file://"))
    assert stored.read_bytes() == (recipe.output_dir / "curate" / "sft.jsonl").read_bytes()
    shortest = next(s for s in curate["steps"] if s["step"].startswith("shortest_successful"))
    assert shortest["rows_in"] - shortest["kept"] == sum(shortest["by_reason"].values())

    weights = sft["weights"]
    # Trained by orchard-trainer, which held a task out (one of five at the default 0.2) and
    # kept the step with the lowest validation loss: that version is published under the
    # run's model.
    validation = sft["validation"]
    assert len(validation["held_out_tasks"]) == 1 and validation["samples"] >= 1
    best = min(validation["points"], key=lambda p: p["loss"])
    assert (
        validation["best_step"] == best["step"] and validation["points"][-1]["step"] == sft["steps"]
    )
    assert weights["version"] == f"{sft['job']}-step-{validation['best_step']:06d}"

    async def published() -> tuple[str, str, str]:
        # read through orchard-trainer's GetWeightVersion, as the recipe reads it
        async with WeightVersions(services.endpoints.trainer) as registry:
            version = await registry.get("reduced-student", weights["version"])
            base = await registry.get("reduced-student", "base")
        assert version is not None and base is not None
        # the base the SFT job started from: built by orchard-trainer, published before SFT
        assert base.number < version.number and base.metadata["source"] == recipe.student.model
        assert base.location.startswith(services.endpoints.artifacts + "/models/"), base
        return version.location, version.metadata["job"], version.metadata["mode"]

    location, job, mode = asyncio.run(published())
    assert (job, mode) == (sft["job"], "sft")
    assert location == weights["location"]
    # a URL in the stack's artifact store, never a path of the trainer's machine
    assert location.startswith(services.endpoints.artifacts + "/checkpoints/"), location
    assert (Path(location.removeprefix("file://")) / "config.json").is_file()
    log = [json.loads(line) for line in (recipe.output_dir / "sft" / "run.jsonl").open()]
    assert len(log) == sft["steps"] and log[0]["loss"] == sft["first_loss"]
    evaluated = [(e["step"], e["validation_loss"]) for e in log if "validation_loss" in e]
    assert evaluated == [(p["step"], p["loss"]) for p in validation["points"]]


def test_rl_samples_the_student_in_rollout_jobs_with_captured_tokens(
    report: Path, recipe: Recipe
) -> None:
    assert recipe.output_dir is not None
    sft_version = stage_done(recipe, "sft")["weights"]["version"]
    rl = stage_done(recipe, "rl")
    (step,) = rl["steps"]
    assert step["rollout_job"] and step["sampled"] == sft_version
    groups = read_groups(recipe.output_dir / "rl" / "groups.jsonl")
    assert groups, "the RL stage's rollout job emitted no group"
    scored = [
        t
        for g in groups
        for t in g.trajectories
        if t.reward.status == reward_pb2.REWARD_STATUS_SCORED
    ]
    assert scored and rl["rollouts"] == len({t.rollout_id for g in groups for t in g.trajectories})
    for trajectory in scored:
        assert trajectory.turns, "no call was captured"
        for turn in trajectory.turns:
            assert turn.input_token_ids and turn.output_token_ids
            assert len(turn.output_logprobs) == len(turn.output_token_ids)
            assert turn.weight_version == sft_version  # sampled by the SFT weights
    assert all(g.sampler.startswith("fixed_n:") and g.rollouts_run == 2 for g in groups)


def test_the_report_has_every_model_and_the_services_numbers(report: Path, recipe: Recipe) -> None:
    data = json.loads((report.parent / "report.json").read_text())
    models = {e["model"]: e for e in data["evaluations"]}
    assert set(models) == {"base", "sft", "rl"}
    evaluate = stage_done(recipe, "evaluate")["models"]
    held_out = {t.id for t in prepare_tasks(recipe, RunDir.open(recipe))["evaluate"]}
    assert recipe.output_dir is not None
    # The RL model is its own version, or the SFT model's weights handed on (and said so).
    rl_weights = stage_done(recipe, "rl")["weights"]["version"]
    assert evaluate["rl"]["weight_version"] == rl_weights
    if rl_weights == evaluate["sft"]["weight_version"]:
        assert evaluate["rl"]["same_weights_as"] == "sft"
        assert "the sft model's" in models["rl"]["weight_version"]
    for name, evaluation in models.items():
        assert evaluation["attempts"] == 5
        # Each model's held-out rollouts ran as a rollout job of its weight version.
        sampled = evaluate[name].get("same_weights_as", name)
        groups = read_groups(recipe.output_dir / "evaluate" / f"{sampled}.groups.jsonl")
        assert {g.task_id for g in groups} == held_out
        versions = {t.weight_version for g in groups for r in g.trajectories for t in r.turns}
        assert versions == {evaluate[name]["weight_version"]}
        low, high = evaluation["interval"]
        assert 0 <= low <= evaluation["rate"] <= high <= 1
    assert data["services"]["sandboxes_created"] >= 10
    assert data["services"]["execs"] > 0
    text = report.read_text()
    assert "Held-out resolve rate" in text and "sft loss" in text
    # Both SFT curves, and which step was handed on.
    curves = {c["name"]: c for c in data["curves"]}
    assert {"sft loss", "sft validation loss"} <= set(curves)
    sft = stage_done(recipe, "sft")
    assert curves["sft validation loss"]["steps"] == [
        p["step"] for p in sft["validation"]["points"]
    ]
    assert f"SFT handed on step {sft['validation']['best_step']} of {sft['steps']}" in text
    assert (report.parent / "resolve_rate.png").is_file()


def test_a_second_run_resumes_and_one_stage_runs_alone(
    report: Path, recipe: Recipe, services: Services
) -> None:
    said: list[str] = []
    run_recipe(recipe, services.endpoints, progress=False, say=said.append)
    assert sum("done already" in line for line in said) == 6
    before = stage_done(recipe, "curate")
    said.clear()
    run_recipe(recipe, services.endpoints, only=["curate"], progress=False, say=said.append)
    assert any(line.startswith("stage curate: done in") for line in said)
    assert stage_done(recipe, "curate")["kept"] == before["kept"]
