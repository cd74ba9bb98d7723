"""A reduced built-in SWE recipe with the rubric process reward on (`stages.rl.rubric`, the
reward service's scripted rubric grader), end to end against real services: etcd, orchard-env
(local runtime), orchard-reward, orchard-rollout and orchard-trainer as processes. Checks that
the RL stage had GradeRubric grade its own rollouts (the reward service's metrics count them,
and each grade names a rollout of the step's groups), that the steps log holds the rubric's
figures beside the outcome's, that training happened on the combined rewards, and that the
report says the rubric was on and with which stand-in judge."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchard.recipes.pipeline import run_recipe
from orchard.recipes.rubric import RUBRIC_LOG
from orchard.recipes.stages import read_groups
from orchard.recipes.trails import main_line
from orchard.recipes.workspace import StackEndpoints
from orchard.sdk.recipe import Recipe
from orchard.types.v1 import reward_pb2

from .conftest import free_port, recipe_stack, reduced_recipe, written_recipe

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(1200)]

WEIGHT = 0.5
RECIPE = reduced_recipe(
    "rubric",
    {
        "credit": {"enabled": False},
        "rl": {
            # The briefly trained student's rollouts all fail and make no tool call (every
            # rubric grade 0), so no group would differ for grpo: ppo trains on every scored
            # group, which shows the combined rewards reaching the trainer.
            "estimator": "ppo",
            "critic": {"pretrain_steps": 1},
            "steps": 2,
            "select": "last",
            "rubric": {"weight": WEIGHT, "judge": "builtin:scripted"},
        },
        "evaluate": {"enabled": False},
    },
)


@dataclass(frozen=True)
class Services:
    endpoints: StackEndpoints
    reward_metrics: str


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    metrics = f"127.0.0.1:{free_port()}"
    settings = {"reward": {"server": {"metrics_address": metrics}}}
    with recipe_stack(tmp_path_factory, settings) as env:
        yield Services(env.endpoints(), metrics)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Recipe:
    return written_recipe(tmp_path_factory, RECIPE)


@pytest.fixture(scope="module")
def report(services: Services, recipe: Recipe) -> Path:
    return run_recipe(recipe, services.endpoints, progress=False, workers=3, say=lambda _: None)


def _rubric_rewards_counted(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "orchard_reward_rewards_total"
                and sample.labels["scorer"] == "rubric"
            ):
                counts[sample.labels["status"]] = sample.value
    return counts


def test_rl_trains_on_outcome_and_rubric_graded_by_the_reward_service(
    report: Path, recipe: Recipe, services: Services
) -> None:
    assert recipe.output_dir is not None
    rl: dict[str, Any] = json.loads((recipe.output_dir / "rl" / "done.json").read_text())
    log = [
        json.loads(line)
        for line in (recipe.output_dir / "rl" / "steps.jsonl").read_text().splitlines()
    ]
    assert len(log) == len(rl["steps"]) == 2
    for entry in log:
        rubric = entry["rubric"]
        assert rubric["judge"] == "builtin:scripted" and rubric["weight"] == WEIGHT
        assert rubric["graded"] >= 1 and rubric["excluded"] == 0
        assert 0 <= rubric["rubric_mean"] <= 1
        # reward_mean stays the outcome's (ScoreTests: -1 or +1 per rollout).
        assert -1 <= entry["reward_mean"] <= 1
        assert rubric["groups_with_signal"] >= 0 and rubric["groups_with_signal_by_outcome"] >= 0

    # GradeRubric graded the RL stage's own rollouts, one call per graded rollout.
    grades = [
        json.loads(line)
        for line in (recipe.output_dir / "rl" / RUBRIC_LOG).read_text().splitlines()
    ]
    groups = read_groups(recipe.output_dir / "rl" / "groups.jsonl")
    rollouts = {t.rollout_id: t for g in groups for t in main_line(g)}
    assert grades and {g["rollout_id"] for g in grades} <= set(rollouts)
    assert sum(e["rubric"]["graded"] for e in log) == len(grades)
    for grade in grades:
        assert set(grade["components"]) == {f"R{i}" for i in range(1, 8)}
        outcome = rollouts[grade["rollout_id"]].reward
        # The groups log keeps the outcome: success and resolve counts are decided on it.
        assert outcome.status == reward_pb2.REWARD_STATUS_SCORED
        assert grade["outcome"] == outcome.value and outcome.value in (-1.0, 1.0)
    assert _rubric_rewards_counted(services.reward_metrics).get("scored") == len(grades)

    # Training happened, on the combined rewards.
    trained = [e for e in log if e.get("published")]
    assert trained, f"no RL step trained: {log}"
    assert all(e["samples"] >= 1 and e["loss"] is not None for e in trained)
    for entry in trained:
        # The trainer's reward mean is the combined one, not the outcome's.
        combined = entry["rubric"]["combined_mean"]
        assert entry["metrics"]["reward_mean"] == pytest.approx(combined)
        expected = (1 - WEIGHT) * entry["rubric"]["outcome_mean"]
        assert combined == pytest.approx(expected + WEIGHT * entry["rubric"]["rubric_mean"])
    assert rl["weights"]["version"] == trained[-1]["published"]

    text = report.read_text()
    assert "rubric process reward on, weight 0.5, judge builtin:scripted" in text
    assert "stand-in for a judge model" in text
    for entry in log:
        assert f"| rl | {entry['step']} | {entry['reward_mean']:.3f} |" in text
