"""One student trained on two domains at once: a reduced recipe of the built-in software suite
and the Claw suite together (`tasks: {builtin, claw}`), end to end against real services
(etcd, orchard-env on the local runtime, orchard-reward, orchard-rollout and orchard-trainer as
processes), in the built-in shell loop. The scripted teacher solves tasks of both domains in
one collection job, the curated dataset and the SFT model hold both, RL samples both, and the
held-out evaluation and the report give every model's result per domain beside the whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchard.recipes.stages import read_groups
from orchard.sdk.recipe import Recipe

from .conftest import reduced_recipe, stage_done, written_recipe

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(1500)]

RECIPE: dict[str, Any] = {
    **reduced_recipe("joint", {"rl": {"select": "last"}}),
    # 9 software tasks and 12 Claw tasks (one per family), each suite split alone.
    "tasks": {
        "builtin": {"count": 9, "seed": 3},
        "claw": {"count": 12, "seed": 4},
        "split": {"sft": 0.34, "rl": 0.33, "evaluate": 0.33},
    },
}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Recipe:
    return written_recipe(tmp_path_factory, RECIPE)


def _domain(task_id: str) -> str:
    return "claw" if task_id.startswith("claw/") else "swe"


def test_the_teacher_solves_both_domains_in_one_collection(report: Path, recipe: Recipe) -> None:
    groups = read_groups(recipe.output_dir / "collect" / "groups.jsonl")
    resolved: dict[str, int] = {"swe": 0, "claw": 0}
    for group in groups:
        for trajectory in group.trajectories:
            resolved[_domain(group.task_id)] += int(trajectory.reward.value >= recipe.pass_mark)
    assert resolved["swe"] >= 1 and resolved["claw"] >= 1, resolved
    sft = stage_done(recipe, "sft")
    assert sft["steps"] >= 1 and sft["samples"] >= 2


def test_rl_samples_tasks_of_the_run_s_rl_split(report: Path, recipe: Recipe) -> None:
    rl = stage_done(recipe, "rl")
    assert rl["steps"] and rl["steps"][0]["sampled"], rl


def test_every_model_is_evaluated_per_domain_on_each_domain_s_held_out_tasks(
    report: Path, recipe: Recipe
) -> None:
    manifest = [
        json.loads(line)
        for line in (recipe.output_dir / "tasks" / "tasks.jsonl").read_text().splitlines()
    ]
    held_out = {"swe": 0, "claw": 0}
    for task in manifest:
        if task["orchard_split"] == "evaluate":
            held_out["claw" if "orchard_claw_id" in task else "swe"] += 1
    assert held_out["swe"] >= 2 and held_out["claw"] >= 3, held_out
    models = stage_done(recipe, "evaluate")["models"]
    assert set(models) >= {"base", "sft", "rl"}, models
    for name, result in models.items():
        domains = result["by_domain"]
        scored = {d: domains.get(d, {"attempts": 0})["attempts"] for d in held_out}
        excluded = sum(result["excluded"].values())
        # One attempt per held-out task; an excluded attempt is in neither domain's count.
        assert sum(scored.values()) + excluded == sum(held_out.values()), (name, result)
        assert sum(d["resolved"] for d in domains.values()) == result["resolved"], name

    text = report.read_text()
    assert "### By domain" in text
    data = json.loads((report.parent / "report.json").read_text())
    for evaluation in data["evaluations"]:
        assert set(evaluation["domains"]) == {"swe", "claw"}, evaluation["model"]
