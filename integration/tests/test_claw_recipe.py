"""A reduced Claw recipe end to end against real services, through REAL agent programs: etcd,
orchard-env (local runtime), orchard-reward, orchard-rollout and orchard-trainer as processes,
the programs from the harness cache (`make harnesses`). The scripted teacher (a job's scripted
policy, served behind the rollout service's capture proxy) solves Claw tasks inside Claude Code
and Codex; their captured calls become SFT rows in the student's tokens; the long-context
student then samples through both programs at once (groups per task and program) and RL trains
on its captured tokens; every model is evaluated in both programs and in OpenClaw, which it
never trained in, with pass@k and pass^k per program in the report."""

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
from orchard.rollout.harnesses.sandboxed import MANIFEST, host_address
from orchard.sdk.recipe import Recipe, builtin_recipe, load_recipe
from orchard.trainer.datasets import read_trajectories
from orchard.types.v1 import reward_pb2

from .conftest import EnvStack, free_port, private_stack

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
TRAINED = ["program:claude-code", "program:codex"]
HELD_OUT = "program:openclaw"
K = 2


def _recipe(student: str) -> dict[str, Any]:
    """The built-in Claw recipe, reduced: 12 tasks (8 to collect on, 2 for RL, 2 held out)."""
    data: dict[str, Any] = yaml.safe_load(builtin_recipe("claw").read_text())
    data["name"] = "claw-reduced"
    data["tasks"] = {
        "claw": {"count": 12, "seed": 5},
        "split": {"sft": 0.6, "rl": 0.2, "evaluate": 0.2},
    }
    data["student"]["model"] = student
    stages = data["stages"]
    stages["sft"].update(epochs=1, warmup_steps=1)
    # PPO here (the software recipe's test trains GRPO): a value model pretrained on the first
    # step's rollouts, through both programs' captured tokens.
    # Four groups a step: both RL tasks in both programs, so the one step is mixed. Each
    # trajectory trains on its last 2,048 tokens: an untrained student's answers run to the cap,
    # Claude Code asks again three times (each call a trajectory of ~23k tokens), and the whole
    # prompts would cost PPO minutes of CPU per trajectory.
    stages["rl"].update(
        steps=1,
        groups_per_step=4,
        estimator="ppo",
        critic={"pretrain_steps": 2},
        max_sequence_tokens=2048,
    )
    stages["evaluate"].update(attempts_per_task=K)
    return data


@dataclass(frozen=True)
class Run:
    recipe: Recipe
    report: Path


@pytest.fixture(scope="module")
def harness_cache() -> Path:
    path = Path(os.environ.get("ORCHARD_HARNESS_CACHE") or ROOT / ".cache" / "harnesses")
    if not (path / MANIFEST).is_file():
        pytest.fail(f"no harness cache at {path}: run `make harnesses`")
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, harness_cache: Path) -> Iterator[EnvStack]:
    address = host_address()
    if address.startswith("127."):
        pytest.fail("this host has no IPv4 address besides loopback for sandboxes to reach")
    services = {name: f"127.0.0.1:{free_port()}" for name in ("reward", "rollout", "trainer")}
    # The programs reach the proxy at this host's address (an egress rule of their sandbox).
    rollout = {"proxy": {"host": address}, "harnesses": {"cache_dir": str(harness_cache)}}
    with private_stack(tmp_path_factory, services, {"rollout": rollout}) as env:
        yield env


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, stack: EnvStack) -> Run:
    from orchard.trainer.policy import BUILTIN_SIZES

    long = [n for n, s in BUILTIN_SIZES.items() if s.context >= 32768]
    assert long, "no built-in size holds an agent program's prompt (32k tokens)"
    folder = tmp_path_factory.mktemp("claw-recipe")
    (folder / "claw.yaml").write_text(yaml.safe_dump(_recipe(f"builtin:{long[0]}")))
    recipe = load_recipe(folder / "claw.yaml", workdir=folder)
    report = run_recipe(recipe, stack.endpoints(), progress=False, workers=3, say=lambda _: None)
    return Run(recipe, report)


def _done(run: Run, stage: str) -> dict[str, Any]:
    assert run.recipe.output_dir is not None
    data: dict[str, Any] = json.loads((run.recipe.output_dir / stage / "done.json").read_text())
    return data


def test_the_teacher_solves_claw_tasks_inside_both_programs_captured_in_tokens(run: Run) -> None:
    assert run.recipe.output_dir is not None
    collect = _done(run, "collect")
    assert collect["rollouts"] == 8 * len(TRAINED)
    assert not collect["excluded"], collect
    groups = read_groups(run.recipe.output_dir / "collect" / "groups.jsonl")
    assert {g.harness for g in groups} == set(TRAINED)
    assert collect["resolved"] >= 4  # the teacher takes its solution path most of the time
    for trajectory in (t for g in groups for t in g.trajectories):
        assert trajectory.reward.status == reward_pb2.REWARD_STATUS_SCORED
        assert trajectory.turns and not trajectory.conversation_json
        assert all(t.weight_version.startswith("scripted:") for t in trajectory.turns)
        # A program's own prompt: thousands of tokens of instructions and tool schemas.
        assert len(trajectory.turns[0].input_token_ids) > 8000
    # The captured rows went to the trainer as they were (no rendering), then curated.
    rows = list(read_trajectories(run.recipe.output_dir / "collect" / "trajectories.jsonl"))
    assert rows
    for row in rows:
        assert any(any(t.output_loss_mask) for t in row.turns)
        assert all(t.weight_version.startswith("scripted:") for t in row.turns)
    assert _done(run, "sft")["steps"] >= 1


def test_rl_trains_on_mixed_program_groups_of_the_student_s_captured_tokens(run: Run) -> None:
    assert run.recipe.output_dir is not None
    rl = _done(run, "rl")
    groups = read_groups(run.recipe.output_dir / "rl" / "groups.jsonl")
    assert {g.harness for g in groups} == set(TRAINED)  # every task in both programs
    for group in groups:
        for trajectory in group.trajectories:
            if trajectory.reward.status != reward_pb2.REWARD_STATUS_SCORED:
                continue
            assert trajectory.turns
            assert all(not t.weight_version.startswith("scripted:") for t in trajectory.turns)
    # PPO trains on a group whose rewards agree (the value model gives each its advantage).
    [step] = rl["steps"]
    assert step["published"], step
    metrics = step["metrics"]
    assert metrics["value_pretrain_steps"] == 2
    assert "value_loss" in metrics and "value_pretrain_loss_first" in metrics


def test_every_model_is_evaluated_in_each_program_and_the_held_out_one(run: Run) -> None:
    evaluate = _done(run, "evaluate")
    for name, result in evaluate["models"].items():
        by_harness = result["by_harness"]
        assert set(by_harness) == {*TRAINED, HELD_OUT}, name
        assert by_harness[HELD_OUT]["held_out"] is True
        assert not any(by_harness[h]["held_out"] for h in TRAINED)
        for harness, row in by_harness.items():
            assert row["attempts"] + row["excluded"] == 2 * K, (name, harness, row)
            assert all(n <= K for n, _ in row["tasks"].values())
    report = json.loads((run.report.parent / "report.json").read_text())
    rows = [r for e in report["evaluations"] for r in e.get("harnesses", [])]
    assert {r["harness"] for r in rows} == {*TRAINED, HELD_OUT}
    assert all(r["k"] == K for r in rows)
    text = run.report.read_text()
    assert "pass@2" in text and "pass^2" in text and "held out" in text
