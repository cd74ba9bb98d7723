"""A reduced built-in SWE recipe whose RL stage is on-policy distillation, end to end against
real services (etcd, orchard-env with the local runtime, orchard-reward, orchard-rollout,
orchard-trainer as processes): the rl stage first trains its teacher (builtin:small, SFT on the
curated teacher trajectories the student's SFT used) and publishes it under its own registry
model, then runs RL steps whose student rollouts are orchard-rollout jobs and whose trainer job
takes per-token advantages from that teacher; the evaluate stage runs the teacher too, and the
report names the estimator, the teacher and the per-step reverse KL."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest

from orchard.recipes.pipeline import run_recipe
from orchard.recipes.stages import read_groups
from orchard.recipes.trainer_client import TrainerJobs
from orchard.recipes.weights_client import WeightVersions
from orchard.sdk.recipe import Recipe
from orchard.trainer.v1 import trainer_service_pb2 as trainer_api

from .conftest import recipe_stack, reduced_recipe, stage_done, written_recipe
from .test_recipe_run import Services

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(900)]

OPD_RECIPE = reduced_recipe(
    "opd",
    {
        "credit": {"enabled": False},
        "rl": {
            "steps": 2,
            "estimator": "opd",
            "distillation": {"teacher": {"train": "builtin:small", "epochs": 2}, "coef": 1.0},
            "select": "last",
        },
    },
)


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    with recipe_stack(tmp_path_factory) as env:
        yield Services(env, env.endpoints())


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Recipe:
    return written_recipe(tmp_path_factory, OPD_RECIPE)


def test_opd_trains_its_teacher_distills_from_it_and_reports_both(
    services: Services, recipe: Recipe
) -> None:
    report = run_recipe(recipe, services.endpoints, progress=False, workers=3, say=lambda _: None)
    assert recipe.output_dir is not None
    rl = stage_done(recipe, "rl")
    assert rl["estimator"] == "opd"
    teacher = rl["distillation"]["teacher"]
    assert teacher["model"] == "builtin:small" and teacher["epochs"] == 2
    assert teacher["registry_model"] == "opd-opd-teacher"
    assert teacher["steps"] >= 1 and teacher["first_loss"] is not None
    assert (recipe.output_dir / "rl" / "opd-teacher" / "run.jsonl").is_file()

    async def published() -> tuple[trainer_api.WeightVersion, trainer_api.TrainingJob]:
        async with WeightVersions(services.endpoints.trainer) as registry:
            version = await registry.get("opd-opd-teacher", teacher["weights"]["version"])
        async with TrainerJobs(services.endpoints.trainer) as trainer:
            job = await trainer.get(rl["job"])
        assert version is not None
        return version, job

    version, job = asyncio.run(published())
    # The teacher: an SFT job of its own, published under its own model in the registry.
    assert version.metadata["mode"] == "sft" and version.metadata["job"] == teacher["job"]
    assert version.location == teacher["weights"]["location"]
    # The RL job distilled from that published teacher.
    spec = job.spec
    assert spec.advantage_estimator == trainer_api.ADVANTAGE_ESTIMATOR_ON_POLICY_DISTILLATION
    assert spec.distillation.teacher == version.location and spec.distillation.coef == 1.0

    steps = rl["steps"]
    assert len(steps) == 2
    # Every group trains under OPD, whatever its rewards: each step took its one group.
    assert all(s["groups_kept"] == 1 and s["groups_dropped"] == 0 for s in steps)
    updated = [s for s in steps if s["published"]]
    assert updated, steps
    for step in updated:
        assert step["metrics"]["distill_tokens"] > 0
        assert math.isfinite(step["metrics"]["distill_reverse_kl"])
    budget = rl["rollout_budget"]
    assert budget["steps"] == 2
    assert budget["run_per_step"] == [s["rollouts_run_by_job"] for s in steps]
    assert budget["run"] == sum(budget["run_per_step"]) >= 4  # two steps of n = 2
    groups = read_groups(recipe.output_dir / "rl" / "groups.jsonl")
    assert {t.weight_version for g in groups for r in g.trajectories for t in r.turns} <= {
        stage_done(recipe, "sft")["weights"]["version"],
        *(s["published"] for s in updated),
    }

    # The teacher is evaluated beside the student, on its own registry model's weights.
    models = stage_done(recipe, "evaluate")["models"]
    assert set(models) == {"base", "sft", "rl", "opd-teacher"}
    assert models["opd-teacher"]["weight_version"] == teacher["weights"]["version"]
    held_out = read_groups(recipe.output_dir / "evaluate" / "opd-teacher.groups.jsonl")
    assert {t.weight_version for g in held_out for r in g.trajectories for t in r.turns} == {
        teacher["weights"]["version"]
    }

    text = report.read_text()
    assert "## Reinforcement learning" in text
    assert "estimator: opd (on-policy distillation" in text
    assert "- teacher: builtin:small, SFT, 2 epochs" in text
    assert "held-out resolve rate (as opd-teacher)" in text
    assert "distill reverse KL" in text
    assert "| opd-teacher |" in text
    assert (
        ("OPD raised" in text)
        or ("OPD lowered" in text)
        or ("OPD left" in text)
        or ("OPD handed on" in text)
    )
    assert "the teacher resolves" in text
