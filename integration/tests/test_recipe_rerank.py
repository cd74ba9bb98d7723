"""The rerank stage end to end against real services (etcd, orchard-env with the local runtime,
orchard-reward, orchard-rollout, orchard-trainer): a reduced built-in SWE recipe whose RL model
makes k = 3 attempts at each held-out task through the evaluate stage's rollout path; a value
model trained on the run's earlier policies (the scripted teacher's collect rollouts, the RL
step's groups) scores them; the report sets pass@1, random-of-k, value-reranked and oracle
pass@k side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchard.recipes.pipeline import run_recipe
from orchard.recipes.recipe_tasks import prepare_tasks
from orchard.recipes.stages import read_groups
from orchard.recipes.workspace import RunDir, StackEndpoints
from orchard.sdk.recipe import Recipe
from orchard.types.v1 import reward_pb2

from .conftest import reduced_recipe, stage_done, written_recipe

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(1200)]

K = 3
RECIPE = reduced_recipe(
    "rerank-reduced",
    {
        "credit": {"enabled": False},
        # One attempt each: the rerank stage samples its k itself, at this temperature.
        "evaluate": {"attempts_per_task": 1, "temperature": 1.0},
        "rerank": {"enabled": True, "k": K},
    },
)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Recipe:
    return written_recipe(tmp_path_factory, RECIPE)


def test_the_rl_model_makes_k_attempts_and_is_reranked_by_a_value_model_of_earlier_policies(
    report: Path, recipe: Recipe, endpoints: StackEndpoints
) -> None:
    assert recipe.output_dir is not None
    rerank = stage_done(recipe, "rerank")
    rl_version = stage_done(recipe, "rl")["weights"]["version"]
    assert (rerank["model"], rerank["weight_version"], rerank["k"]) == ("rl", rl_version, K)
    # evaluate made one attempt per task, so the stage sampled k through the same rollout
    # path (a rollout job of the RL weights on the held-out tasks).
    assert rerank["attempts_from"] == "rerank"
    groups = read_groups(recipe.output_dir / "rerank" / "rl.groups.jsonl")
    held_out = {t.id for t in prepare_tasks(recipe, RunDir.open(recipe))["evaluate"]}
    assert {g.task_id for g in groups} == held_out
    assert all(len(g.trajectories) == K for g in groups)
    versions = {t.weight_version for g in groups for r in g.trajectories for t in r.turns}
    assert versions == {rl_version}

    # The history: the teacher's collect rollouts and the RL stage's rollouts (its step's
    # groups, its validation runs) sampled by other weights than the RL model's, and none on
    # the held-out tasks. (When RL validation handed on the SFT weights, the RL step's groups
    # were sampled by the reranked weights themselves: none of them is used.)
    history = rerank["history"]
    collect = stage_done(recipe, "collect")
    assert history["sources"]["this run: collect"]["trajectories"] == (
        collect["resolved"] + collect["unresolved"]
    )
    assert history["sources"]["this run: collect"]["successes"] == collect["resolved"]
    rl_folder = recipe.output_dir / "rl"
    earlier = {
        r.id
        for path in [rl_folder / "groups.jsonl", *rl_folder.glob("validation/*.groups.jsonl")]
        for g in read_groups(path)
        for r in g.trajectories
        if r.reward.status == reward_pb2.REWARD_STATUS_SCORED
        and rl_version not in {t.weight_version for t in r.turns}
    }
    used = history["sources"].get("this run: rl", {"trajectories": 0})["trajectories"]
    assert used == len(earlier)
    assert history["on_held_out_tasks"] == 0
    assert history["successes"] + history["failures"] == history["trajectories"]

    # The scripted teacher both succeeds and fails: a value model was trained and measured.
    model = rerank["value_model"]
    assert history["successes"] > 0 and history["failures"] > 0
    assert model["trained"] is True
    assert (recipe.output_dir / "rerank" / "value_model.npz").is_file()
    scores = [json.loads(line) for line in (recipe.output_dir / "rerank" / "scores.jsonl").open()]
    assert len(scores) == rerank["evaluation"]["attempts"] == len(held_out) * K
    assert all(0 < s["score"] < 1 for s in scores)

    # The four figures, on the same pairs, ordered as they must be.
    figures = rerank["figures"]
    n = rerank["tasks"]
    assert n == len(held_out) and rerank["tasks_short"] == 0
    assert {f["tasks"] for f in figures.values()} == {n}
    rate = {name: f["successes"] / n for name, f in figures.items()}
    assert rate["random-of-k"] <= rate["oracle pass@k"]
    assert rate["value-reranked"] <= rate["oracle pass@k"]
    assert rate["pass@1"] <= rate["oracle pass@k"]
    successes = rerank["evaluation"]["successes"]
    assert figures["random-of-k"]["successes"] == pytest.approx(successes / K)
    assert rerank["verdict"]


def test_the_report_explains_the_four_numbers(report: Path, recipe: Recipe) -> None:
    data = json.loads((report.parent / "report.json").read_text())
    section = data["rerank"]
    assert section["model"] == "rl" and section["k"] == K
    names = [f["name"] for f in section["figures"]]
    assert names == ["pass@1", "random-of-k", "value-reranked", "oracle pass@k"]
    done = stage_done(recipe, "rerank")
    for figure in section["figures"]:
        low, high = figure["interval"]
        assert 0 <= low <= figure["rate"] <= high <= 1
        assert figure["successes"] == done["figures"][figure["name"]]["successes"]
    assert section["verdict"] == done["verdict"]
    text = report.read_text()
    assert f"## Best-of-{K} by a value model (rl)" in text
    for name in names:
        assert f"| {name} |" in text
    assert "earlier policies" in text and done["verdict"] in text


def test_a_second_run_resumes_the_rerank_stage(
    report: Path, recipe: Recipe, endpoints: StackEndpoints
) -> None:
    said: list[str] = []
    run_recipe(recipe, endpoints, progress=False, say=said.append)
    assert any(line.startswith("stage rerank: done already") for line in said)
