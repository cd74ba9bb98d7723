"""Checks of a recipe against the services it will drive, before any stage runs: the harnesses
it names are ones orchard-rollout drives (ListHarnesses), and its built-in tasks are a suite
orchard-reward knows, in the number of tasks one seed makes (ListTaskSuites). A mistake then
fails in a second with what to change, never an hour into a run."""

from __future__ import annotations

import asyncio

from orchard.recipes.reward_client import RewardCatalog
from orchard.recipes.rollout_client import RolloutJobs
from orchard.recipes.workspace import StackEndpoints
from orchard.sdk.recipe import Recipe

__all__ = ["BUILTIN_SUITE", "ServiceMismatch", "check_recipe"]

BUILTIN_SUITE = "builtin:swe"
"""The task suite `tasks.builtin` generates (orchard-reward's name for it)."""


class ServiceMismatch(ValueError):
    """The recipe asks for something the services do not offer; the message says what."""


async def _check(recipe: Recipe, stack: StackEndpoints) -> None:
    async with RolloutJobs(stack.rollout) as rollouts:
        harnesses = await rollouts.harnesses()
    for name in recipe.harnesses:
        if name not in harnesses:
            raise ServiceMismatch(
                f"harnesses: {name!r} is not one orchard-rollout at {stack.rollout} drives; it "
                f"drives {', '.join(sorted(harnesses)) or 'none'}"
            )
    spec = recipe.tasks.builtin
    if spec is None:
        return
    async with RewardCatalog(stack.reward) as reward:
        suites = await reward.task_suites()
    suite = suites.get(BUILTIN_SUITE)
    if suite is None:
        raise ServiceMismatch(
            f"tasks.builtin: orchard-reward at {stack.reward} knows no suite {BUILTIN_SUITE!r} "
            f"(it knows {', '.join(sorted(suites)) or 'none'}); give tasks.jsonl instead"
        )
    if not suite.min_tasks <= spec.count <= suite.max_tasks:
        raise ServiceMismatch(
            f"tasks.builtin.count {spec.count}: the {suite.name} suite makes "
            f"{suite.min_tasks} to {suite.max_tasks} tasks from one seed"
        )


def check_recipe(recipe: Recipe, stack: StackEndpoints) -> None:
    """Raise ServiceMismatch when the recipe asks the services for something they lack."""
    asyncio.run(_check(recipe, stack))
