"""A reduced GUI recipe end to end against real services: etcd, orchard-env (local runtime; its
tenant may give sandboxes user namespaces, for Chromium's own sandbox), orchard-reward,
orchard-rollout (the browser folder from `make gui-browser`) and orchard-trainer as processes.
The scripted GUI teacher works through real sites in real browser sandboxes, the state judge
scores each site's server-side state, the long-context student is trained by SFT and then by RL
under the step-budget curriculum, from the SFT model and from the base model, and every model is
evaluated on the held-out tasks with the curriculum's last budget; the report links screenshot
trails of held-out episodes."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchard.recipes.pipeline import run_recipe
from orchard.recipes.stages import read_groups
from orchard.sdk.recipe import Recipe, builtin_recipe, load_recipe
from orchard.tasks.gui.browser_dir import LAUNCHER, build_browser_dir
from orchard.types.v1 import reward_pb2

from .conftest import EnvStack, free_port, private_stack

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
HARNESS = "builtin:browser-text"
BUDGETS = [2, 4]
"""The curriculum's step budgets: short, so the untrained student's episodes end quickly."""


def _recipe() -> dict[str, Any]:
    """The built-in GUI recipe, reduced: 12 tasks (6 to collect on, 3 for RL, 3 held out)."""
    data: dict[str, Any] = yaml.safe_load(builtin_recipe("gui").read_text())
    data["name"] = "gui-reduced"
    data["tasks"]["gui"] = {"count": 12, "seed": 3}
    stages = data["stages"]
    stages["collect"]["attempts_per_task"] = 1
    stages["sft"].update(epochs=1, warmup_steps=1)
    stages["rl"].update(steps=2, groups_per_step=1, curriculum={"max_steps": BUDGETS})
    return data


@dataclass(frozen=True)
class Run:
    recipe: Recipe
    report: Path

    def done(self, stage: str) -> dict[str, Any]:
        assert self.recipe.output_dir is not None
        data: dict[str, Any] = json.loads(
            (self.recipe.output_dir / stage / "done.json").read_text()
        )
        return data

    def path(self, *parts: str) -> Path:
        assert self.recipe.output_dir is not None
        return self.recipe.output_dir.joinpath(*parts)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvStack]:
    folder = Path(os.environ.get("ORCHARD_GUI_BROWSER") or ROOT / ".cache" / "gui-browser")
    if not (folder / LAUNCHER).exists():
        build_browser_dir(folder)
    services = {name: f"127.0.0.1:{free_port()}" for name in ("reward", "rollout", "trainer")}
    rollout = {"gui": {"browser_dir": str(folder.absolute())}}
    with private_stack(
        tmp_path_factory,
        services,
        {"rollout": rollout},
        settings=['privileges.user_namespaces=["*"]'],
    ) as env:
        yield env


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, stack: EnvStack) -> Run:
    folder = tmp_path_factory.mktemp("gui-recipe")
    (folder / "gui.yaml").write_text(yaml.safe_dump(_recipe()))
    recipe = load_recipe(folder / "gui.yaml", workdir=folder)
    report = run_recipe(recipe, stack.endpoints(), progress=False, workers=3, say=lambda _: None)
    return Run(recipe, report)


def test_the_teacher_s_browser_episodes_are_judged_and_rendered_for_sft(run: Run) -> None:
    collect = run.done("collect")
    assert collect["rollouts"] == 6 and not collect["excluded"], collect
    assert collect["resolved"] >= 3, collect  # the teacher mostly corrects its mistakes
    groups = read_groups(run.path("collect", "groups.jsonl"))
    for trajectory in (t for g in groups for t in g.trajectories):
        assert trajectory.harness == HARNESS
        assert trajectory.reward.scorer == "gui_state_judge", trajectory.reward
        messages = json.loads(trajectory.conversation_json)
        calls = [c["function"]["name"] for m in messages for c in m.get("tool_calls") or []]
        assert calls and set(calls) <= {"click", "write", "press_keys", "scroll", "wait",
            "drag", "hover", "goto_url", "go_back", "new_tab", "switch_tab", "close_tab",
            "done"}  # fmt: skip
    assert collect["trajectories"] >= collect["resolved"]
    assert run.done("sft")["steps"] >= 1


def test_rl_runs_each_step_at_its_curriculum_budget_from_sft_and_from_base(run: Run) -> None:
    rl = run.done("rl")
    for line, folder in ((rl, run.path("rl")), (rl["from_base"], run.path("rl", "from-base"))):
        steps = line["steps"]
        assert len(steps) == 2
        for step in steps:
            # The untrained student does not saturate the reward: the budget stays at the first.
            assert step["max_steps"] == BUDGETS[0], step
            assert step["success_share"] is not None and step["success_share"] < 0.8
        for group in read_groups(folder / "groups.jsonl"):
            for trajectory in group.trajectories:
                assert int(trajectory.metadata["steps"]) <= BUDGETS[0]
    # RL from base starts at the base version of a registry model of its own.
    assert rl["from_base"]["steps"][0]["sampled"] == "base"
    assert rl["steps"][0]["sampled"] == run.done("sft")["weights"]["version"]


def test_every_model_is_evaluated_at_the_last_budget_and_the_report_shows_trails(
    run: Run,
) -> None:
    models = run.done("evaluate")["models"]
    assert set(models) == {"base", "sft", "rl", "rl-base"}
    for name, result in models.items():
        assert result["attempts"] + sum(result["excluded"].values()) == 3, (name, result)
        if result.get("same_weights_as"):
            continue
        for group in read_groups(run.path("evaluate", f"{name}.groups.jsonl")):
            for trajectory in group.trajectories:
                assert int(trajectory.metadata["steps"]) <= BUDGETS[-1]
                if trajectory.reward.status == reward_pb2.REWARD_STATUS_SCORED:
                    assert trajectory.metadata["gui_trail"].endswith("trail.json")
    assert models["rl-base"]["line"] == "from-base"
    text = run.report.read_text()
    assert "rl-base" in text and "screenshot trails" in text
    index = run.report.parent / "trails" / "index.html"
    assert index.is_file()
    pages = sorted((run.report.parent / "trails").glob("*/*.html"))
    assert pages and all(p.parent.name in models for p in pages)
