"""The recipe runner's parts that need no service: the scripted teacher's script as the rollout
service takes it, the run folder's guard against mixing recipes, and how the RL stage picks the
weights it hands on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchard.recipes.stages import _scripted_policy, group_counts, pick_validated
from orchard.recipes.swe_suite import generate_suite, teacher_script
from orchard.recipes.workspace import RecipeMismatch, RunDir, StackEndpoints
from orchard.sdk.connection import Profile, write_profile
from orchard.sdk.recipe import Recipe
from orchard.types.v1 import reward_pb2, trajectory_pb2


def test_the_scripted_teacher_travels_as_a_scripted_policy_spec() -> None:
    suite = generate_suite(6, seed=7)
    script = teacher_script(suite, model="teacher-x")
    message = _scripted_policy(script, seed=3)
    assert (message.model, message.seed, len(message.plans)) == ("teacher-x", 3, len(suite))
    for plan, sent in zip(script["plans"], message.plans, strict=True):
        assert (sent.match, sent.solve_rate) == (plan["match"], plan["solve_rate"])
        for steps, sent_steps in (
            (plan["solution"], sent.solution),
            (plan["failure"], sent.failure),
        ):
            assert [s["thought"] for s in steps] == [s.thought for s in sent_steps]
            assert [s.get("tool", "") for s in steps] == [s.tool for s in sent_steps]
            assert [s.get("arguments", {}) for s in steps] == [
                json.loads(s.arguments_json or "{}") for s in sent_steps
            ]


def test_a_run_folder_refuses_another_recipe(tmp_path: Path) -> None:
    base = {"name": "one", "tasks": {"builtin": {"count": 5}}, "output_dir": tmp_path / "run"}
    RunDir.open(Recipe.model_validate(base))
    RunDir.open(Recipe.model_validate(base))  # the same recipe resumes
    other = {**base, "tasks": {"builtin": {"count": 6}}}
    with pytest.raises(RecipeMismatch, match="differs in: tasks"):
        RunDir.open(Recipe.model_validate(other))


def _orchard(*args: str, state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "orchard"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "ORCHARD_STATE_DIR": str(state)},
    )


def test_recipe_run_says_what_to_do_when_nothing_runs(tmp_path: Path) -> None:
    done = _orchard("recipe", "run", "--no-progress", state=tmp_path / "state")
    assert done.returncode == 2
    assert "orchard up --detach" in done.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: Bad Name\ntasks: {builtin: {count: 1}}\n")
    done = _orchard("recipe", "run", str(bad), state=tmp_path / "state")
    assert done.returncode == 2
    assert "not a valid recipe" in done.stderr and "name" in done.stderr


@pytest.mark.parametrize(
    ("resolved", "picked"),
    [
        ([7, 8, 6, 6], 1),  # the best RL version
        ([7, 7, 7, 7], 3),  # ties go to the latest RL version
        ([7, 8, 8, 5], 2),
        ([9, 8, 8, 5], 0),  # the start only when every RL version is worse
        ([0, 0], 1),
        ([3], 0),
    ],
)
def test_rl_hands_on_the_best_validated_version(resolved: list[int], picked: int) -> None:
    assert pick_validated(resolved) == picked


def test_rl_validation_needs_a_candidate() -> None:
    with pytest.raises(ValueError, match="no candidate"):
        pick_validated([])


def test_the_stack_is_read_from_orchard_up_and_needs_rollout_and_trainer(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="orchard up --detach"):
        StackEndpoints.from_state_dir(tmp_path)
    write_profile(Profile(endpoint="127.0.0.1:7100", token="t0ken"), tmp_path / "profile.json")
    components = [
        {"name": "etcd", "address": "http://127.0.0.1:2379"},
        {"name": "orchard-env", "address": "127.0.0.1:7100"},
        {"name": "orchard-reward", "address": "127.0.0.1:7200"},
    ]
    (tmp_path / "up.json").write_text(json.dumps({"pid": 1, "components": components}))
    with pytest.raises(FileNotFoundError, match="without orchard-rollout, orchard-trainer"):
        StackEndpoints.from_state_dir(tmp_path)
    components.append({"name": "orchard-trainer", "address": "127.0.0.1:7400"})
    (tmp_path / "up.json").write_text(json.dumps({"pid": 1, "components": components}))
    with pytest.raises(FileNotFoundError, match="without orchard-rollout;"):
        StackEndpoints.from_state_dir(tmp_path)
    components.append({"name": "orchard-rollout", "address": "127.0.0.1:7300"})
    (tmp_path / "up.json").write_text(json.dumps({"pid": 1, "components": components}))
    stack = StackEndpoints.from_state_dir(tmp_path)
    assert (stack.env, stack.env_token, stack.reward, stack.rollout, stack.trainer, stack.etcd) == (
        "127.0.0.1:7100", "t0ken", "127.0.0.1:7200", "127.0.0.1:7300", "127.0.0.1:7400",
        "http://127.0.0.1:2379",
    )  # fmt: skip


def _group(
    *rewards: float | None, branch_of: int | None = None, fork_of: int | None = None
) -> trajectory_pb2.TrajectoryGroup:
    """A group as orchard-rollout streams it: None is an aborted (excluded) rollout."""
    group = trajectory_pb2.TrajectoryGroup(task_id="t1", harness="builtin:swe")
    for i, value in enumerate(rewards):
        trajectory = group.trajectories.add(id=f"r{i}/0", rollout_id=f"r{i}")
        if value is None:
            trajectory.reward.status = reward_pb2.REWARD_STATUS_EXCLUDED
            trajectory.metadata["failure_layer"] = "sandbox_create"
        else:
            trajectory.reward.status = reward_pb2.REWARD_STATUS_SCORED
            trajectory.reward.value = value
    if branch_of is not None:
        # A branch of a rewritten history is not a rollout of its own.
        branch = group.trajectories.add()
        branch.CopyFrom(group.trajectories[branch_of])
        branch.metadata["branch"] = "compaction"
    if fork_of is not None:
        # A second main-line path of one rollout (its history forked): the same rollout.
        fork = group.trajectories.add()
        fork.CopyFrom(group.trajectories[fork_of])
        fork.id = f"{fork.rollout_id}/1"
    return group


def test_groups_count_rollouts_once_and_excluded_ones_by_layer() -> None:
    groups = [_group(1.0, -1.0, None, branch_of=0), _group(-1.0, -1.0, fork_of=1)]
    assert group_counts(groups) == {
        "rollouts": 5,
        "resolved": 1,
        "unresolved": 3,
        "excluded": {"sandbox_create": 1},
    }
