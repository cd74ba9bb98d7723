"""An experiment end to end against real services (etcd, orchard-env, orchard-reward,
orchard-rollout, orchard-trainer as processes): two arms of a reduced recipe that differ only in
RL's sampler. The second arm takes the first one's teacher collection, credit, curation and SFT
model (the same weights in the registry, so its RL starts from them) and their held-out
evaluations, runs its own RL and evaluates its own RL model; the report compares the two."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchard.recipes.experiment import run_experiment
from orchard.recipes.workspace import StackEndpoints
from orchard.sdk.experiment import load_experiment

from .conftest import recipe_stack, reduced_recipe

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(1200)]

RECIPE = reduced_recipe(
    "reduced", {"rl": {"select": "last", "sampler": {"kind": "bar", "n": 2, "n_max": 4}}}
)

EXPERIMENT = {
    "name": "pair",
    "recipe": "reduced.yaml",
    "seeds": [4],
    "arms": [
        {"name": "bar", "about": "BAR groups"},
        {"name": "fixed", "about": "fixed groups", "settings": {"stages.rl.sampler.kind": "fixed"}},
    ],
    "comparisons": [
        {"name": "BAR vs fixed-N, held out", "a": "bar/rl", "b": "fixed/rl"},
        {"name": "BAR vs fixed-N, groups", "a": "bar/rl", "b": "fixed/rl",
         "metric": "balanced-groups"},
        {"name": "SFT vs base", "a": "bar/sft", "b": "bar/base"},
    ],
    "output_dir": "out",
}  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackEndpoints]:
    with recipe_stack(tmp_path_factory) as env:
        yield env.endpoints()


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory, stack: StackEndpoints) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("experiment")
    (folder / "reduced.yaml").write_text(yaml.safe_dump(RECIPE))
    (folder / "pair.yaml").write_text(yaml.safe_dump(EXPERIMENT))
    experiment, out = load_experiment(folder / "pair.yaml")
    said: list[str] = []
    report = run_experiment(
        experiment,
        out,
        folder,
        stack,
        progress=False,
        workers=3,
        say=said.append,
        source="pair.yaml",
    )
    (out / "said.txt").write_text("\n".join(said))
    return out, report


def _done(run: Path, stage: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run / stage / "done.json").read_text())
    return data


def test_the_second_arm_trains_rl_from_the_first_arms_sft_model(ran: tuple[Path, Path]) -> None:
    out, _ = ran
    bar, fixed = out / "bar" / "seed-4", out / "fixed" / "seed-4"
    shared = json.loads((fixed / "shared.json").read_text())
    assert shared["stages"] == {s: "bar/seed-4" for s in ("collect", "credit", "curate", "sft")}
    assert shared["evaluations"] == {"base": "bar/seed-4", "sft": "bar/seed-4"}
    assert json.loads((bar / "shared.json").read_text()) == {"stages": {}, "evaluations": {}}
    sft = _done(bar, "sft")["weights"]
    assert _done(fixed, "sft")["weights"] == sft
    # Each arm ran its own RL from that SFT model, sampled as its sampler says.
    for run, sampler in ((bar, "bar"), (fixed, "fixed")):
        rl = _done(run, "rl")
        assert rl["steps"][0]["sampled"] == sft["version"]
        choices = {g["choice"] for g in rl["groups"]}
        assert choices and choices <= (
            {"all"} if sampler == "fixed" else {"mixed", "balanced", "relaxed", "top_ranked"}
        ), rl["groups"]
    assert _done(fixed, "rl")["job"] != _done(bar, "rl")["job"]
    # The copied evaluations are the first arm's numbers; each arm evaluated its own RL model
    # (an RL stage without an update hands on the SFT model, evaluated once as such).
    bar_eval = _done(bar, "evaluate")["models"]
    fixed_eval = _done(fixed, "evaluate")["models"]
    for model in ("base", "sft"):
        assert fixed_eval[model]["rollout_job"] == bar_eval[model]["rollout_job"]
    for run, evaluated in ((bar, bar_eval), (fixed, fixed_eval)):
        assert evaluated["rl"]["weight_version"] == _done(run, "rl")["weights"]["version"]


def test_the_report_compares_the_arms(ran: tuple[Path, Path]) -> None:
    out, report = ran
    assert report == out / "report" / "experiment.md"
    text = report.read_text()
    data = json.loads((out / "report" / "experiment.json").read_text())
    rows = {(m["arm"], m["model"]): m for m in data["models"]}
    assert {("bar", "base"), ("bar", "sft"), ("bar", "rl"), ("fixed", "rl")} <= set(rows)
    assert all(m["attempts"] == 5 for m in rows.values())  # five held-out tasks, one attempt
    comparisons = {c["name"]: c for c in data["comparisons"]}
    held_out = comparisons["BAR vs fixed-N, held out"]["result"]
    assert held_out["pairs"] == 5 and -1 <= held_out["difference"] <= 1
    groups = comparisons["BAR vs fixed-N, groups"]["result"]
    assert groups["a"]["rollouts"] > 0 and groups["b"]["rollouts"] > 0
    assert "orchard experiment run pair.yaml" in text
    assert "[fixed/seed-4](../fixed/seed-4/report/report.md)" in text
    assert "copied: collect from bar/seed-4" in text
    assert (out / "report" / "held-out.png").exists()
    assert "arm fixed, seed 4" in (out / "said.txt").read_text()
