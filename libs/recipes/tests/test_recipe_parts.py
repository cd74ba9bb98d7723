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


def test_a_run_folder_of_an_earlier_version_resumes(tmp_path: Path) -> None:
    # Saved before a stage's setting existed: the setting takes its default, the run resumes.
    base = {"name": "one", "tasks": {"builtin": {"count": 5}}, "output_dir": tmp_path / "run"}
    run = RunDir.open(Recipe.model_validate(base))
    saved = json.loads((run.root / "recipe.json").read_text())
    del saved["stages"]["rl"]["from_base"]
    (run.root / "recipe.json").write_text(json.dumps(saved))
    RunDir.open(Recipe.model_validate(base))
    # What the saved recipe does hold still has to match.
    changed = {**base, "stages": {"rl": {"steps": 9}}}
    with pytest.raises(RecipeMismatch, match="differs in: stages"):
        RunDir.open(Recipe.model_validate(changed))


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


def test_a_claw_recipe_s_tasks_are_ids_and_tool_archives_and_read_back_the_same(
    tmp_path: Path,
) -> None:
    """The Claw suite as a recipe prepares it: each task its id, split, family and the URLs of
    the tools' archive in the store; a resumed run reads the same tasks back, and each becomes
    the spec orchard-rollout drives (seeded apps, scored by ScoreTask)."""
    from orchard.core.artifacts import ArtifactStore
    from orchard.recipes.recipe_tasks import prepare_tasks, task_spec
    from orchard.tasks.spec import ServiceTaskCheck

    recipe = Recipe.model_validate(
        {"name": "claw", "tasks": {"claw": {"count": 24, "seed": 3}},
         "harnesses": ["program:codex"], "stages": {"credit": {"enabled": False}},
         "output_dir": tmp_path / "run"}
    )  # fmt: skip
    store = ArtifactStore((tmp_path / "store").as_uri())
    run = RunDir.open(recipe)
    first = prepare_tasks(recipe, run, store)
    assert {k: len(v) for k, v in first.items()} == {"sft": 12, "rl": 6, "evaluate": 6}
    again = prepare_tasks(recipe, RunDir.open(recipe), None)  # from the manifest: no store
    assert again == first
    task = first["evaluate"][0]
    assert task.id.startswith("claw/3/") and task.instance is None and task.files
    assert all(store.exists(f.url) for f in task.files)
    assert task.source == task.family and task.instruction
    spec = task_spec(task)
    assert spec.check == ServiceTaskCheck(task.id) and spec.files == task.files
    assert spec.instruction == task.instruction and spec.image == "host"
    # Two tasks per family: every family trains, the held-out ones come from six families.
    assert len({t.family for t in first["sft"]}) == 12
    assert len({t.family for t in first["evaluate"]}) == 6


def test_a_joint_recipe_s_tasks_are_both_suites_each_split_as_alone_and_one_teacher_plays_both(
    tmp_path: Path,
) -> None:
    """Software and Claw tasks in one run: each suite divided exactly as a run of it alone
    divides it (so held-out tasks pair with single-domain runs), the manifest reads back the
    same, and the scripted teacher has a plan for every task of both domains."""
    from orchard.core.artifacts import ArtifactStore
    from orchard.recipes.recipe_tasks import prepare_tasks
    from orchard.recipes.stages import StageContext, _teacher
    from orchard.recipes.workspace import StackEndpoints

    def recipe(name: str, tasks: dict[str, object]) -> Recipe:
        return Recipe.model_validate(
            {"name": name, "tasks": {**tasks, "split": {"sft": 0.5, "rl": 0.25, "evaluate": 0.25}},
             "output_dir": tmp_path / name}
        )  # fmt: skip

    swe, claw = {"builtin": {"count": 8, "seed": 2}}, {"claw": {"count": 24, "seed": 3}}
    store = ArtifactStore((tmp_path / "store").as_uri())
    joint = recipe("joint", {**swe, **claw})
    both = prepare_tasks(joint, RunDir.open(joint), store)
    assert prepare_tasks(joint, RunDir.open(joint), None) == both
    for name, tasks, domain in (("swe", swe, "swe"), ("claw", claw, "claw")):
        alone = prepare_tasks(recipe(name, tasks), RunDir.open(recipe(name, tasks)), store)
        for split, chosen in alone.items():
            assert [t.id for t in both[split] if t.domain == domain] == [t.id for t in chosen]
    assert {t.domain for t in both["evaluate"]} == {"swe", "claw"}

    stack = StackEndpoints("127.0.0.1:1", "", "127.0.0.1:2", "", "127.0.0.1:3", "127.0.0.1:4")
    ctx = StageContext(recipe=joint, run=RunDir.open(joint), stack=stack, tasks=both, seed=1)
    plans = _teacher(ctx, both["sft"]).scripted.plans
    assert len(plans) == len(both["sft"])
    for task in both["sft"]:
        matching = [p for p in plans if p.match in task.instruction]
        assert matching, f"no plan for {task.id}"


def test_a_gui_recipe_s_tasks_are_ids_and_read_back_the_same(tmp_path: Path) -> None:
    """The GUI suite as a recipe prepares it: each task its id, split, family and difficulty
    (no store needed: the rollout service serves the sites); a resumed run reads the same tasks
    back, and each becomes a browser episode scored by the built-in state judge."""
    from orchard.recipes.recipe_tasks import prepare_tasks, task_spec
    from orchard.tasks.gui.suite import task_by_id
    from orchard.tasks.spec import GUI_STATE_JUDGE, GuiCheck, TaskSpec

    recipe = Recipe.model_validate(
        {"name": "gui", "tasks": {"gui": {"count": 24, "seed": 5}},
         "harnesses": ["builtin:browser-text"], "stages": {"credit": {"enabled": False}},
         "output_dir": tmp_path / "run"}
    )  # fmt: skip
    first = prepare_tasks(recipe, RunDir.open(recipe), None)
    assert {k: len(v) for k, v in first.items()} == {"sft": 12, "rl": 6, "evaluate": 6}
    assert prepare_tasks(recipe, RunDir.open(recipe), None) == first
    ids = [t.id for split in first.values() for t in split]
    assert len(set(ids)) == 24 and all(i.startswith("gui/5/") for i in ids)
    task = first["evaluate"][0]
    assert task.instance is None and not task.files and task.difficulty in (1, 2, 3)
    assert task.instruction == task_by_id(task.id).intent and task.source == task.family
    spec = task_spec(task)
    assert spec.check == GuiCheck(task.id, GUI_STATE_JUDGE)
    assert (spec.instruction, spec.image, spec.setup, spec.files) == (
        task.instruction,
        "host",
        (),
        (),
    )
    sent = spec.to_proto()
    assert json.loads(sent.scorer_json)["gui"]["task_id"] == task.id
    assert TaskSpec.from_proto(sent).check == spec.check


def test_the_gui_teacher_is_the_rollout_service_s_own_policy(tmp_path: Path) -> None:
    """A GUI recipe's scripted teacher travels as `scripted.gui_teacher` (the suite and the
    mistake rate), not as a script: the rollout service plays it page by page."""
    from orchard.recipes.recipe_tasks import prepare_tasks
    from orchard.recipes.stages import StageContext, _teacher

    recipe = Recipe.model_validate(
        {"name": "gui", "tasks": {"gui": {"count": 24, "seed": 5}},
         "harnesses": ["builtin:browser-text"], "stages": {"credit": {"enabled": False}},
         "teacher": {"mistake_rate": 0.25}, "output_dir": tmp_path / "run"}
    )  # fmt: skip
    run = RunDir.open(recipe)
    tasks = prepare_tasks(recipe, run, None)
    stack = StackEndpoints("127.0.0.1:1", "", "127.0.0.1:2", "", "127.0.0.1:3", "127.0.0.1:4")
    ctx = StageContext(recipe, run, stack, tasks, seed=11)
    policy = _teacher(ctx, tasks["sft"])
    teacher = policy.scripted.gui_teacher
    assert (teacher.suite_seed, teacher.count, teacher.mistake_rate) == (5, 24, 0.25)
    assert policy.scripted.seed == 11 and not policy.scripted.plans
    line = ctx.line("from-base")
    assert (ctx.registry_model, line.registry_model) == ("gui-student", "gui-student-from-base")


def test_a_gui_report_says_how_the_student_saw_the_pages_and_what_judged_them() -> None:
    from orchard.recipes.pipeline import gui_notes

    base = {"name": "gui", "tasks": {"gui": {}}, "stages": {"credit": {"enabled": False}}}
    text = gui_notes(Recipe.model_validate({**base, "harnesses": ["builtin:browser-text"]}))
    assert len(text) == 2
    assert "as text" in text[0] and "in place of the screenshot" in text[0]
    assert "built-in state judge" in text[1] and "no model reads the screenshots" in text[1]
    both = gui_notes(
        Recipe.model_validate(
            {**base, "harnesses": ["builtin:browser-text"],
             "stages": {"credit": {"enabled": False},
                        "evaluate": {"harnesses": ["builtin:browser"]}}}
        )
    )  # fmt: skip
    assert any("as a screenshot" in n for n in both) and len(both) == 3
    assert gui_notes(Recipe.model_validate({"name": "swe", "tasks": {"builtin": {}}})) == []


def test_evaluation_counts_per_harness_give_each_task_its_attempts_and_successes() -> None:
    from orchard.recipes.stages import by_harness

    def group(
        task: str, harness: str, values: list[float | None]
    ) -> trajectory_pb2.TrajectoryGroup:
        out = trajectory_pb2.TrajectoryGroup(task_id=task, harness=harness)
        for i, value in enumerate(values):
            trajectory = out.trajectories.add(rollout_id=f"{task}-{harness}-{i}")
            if value is None:
                trajectory.reward.status = reward_pb2.REWARD_STATUS_EXCLUDED
            else:
                trajectory.reward.status = reward_pb2.REWARD_STATUS_SCORED
                trajectory.reward.value = value
        return out

    groups = [
        group("a", "program:codex", [0.8, 0.5, 1.0]),
        group("b", "program:codex", [0.74, None, 0.75]),
        group("a", "program:openclaw", [0.0, 0.0, 0.9]),
    ]
    counts = by_harness(
        groups, ["program:codex", "program:openclaw", "program:hermes"], {"program:codex"}, 0.75
    )
    assert counts["program:codex"] == {
        "held_out": False, "resolved": 3, "attempts": 5, "excluded": 1,
        "tasks": {"a": [3, 2], "b": [2, 1]},
    }  # fmt: skip
    assert counts["program:openclaw"]["held_out"] is True
    assert counts["program:openclaw"]["tasks"] == {"a": [3, 1]}
    assert counts["program:hermes"]["attempts"] == 0  # named, never run: a row of nothing


def test_the_base_model_of_rl_from_base_is_not_evaluated_twice() -> None:
    from orchard.recipes.stages import FROM_BASE, OPD_TEACHER, _same_weights

    # RL from the base model that never updated hands on version "base" of its own line:
    # the very weights the base line evaluated (built from the same seed).
    assert _same_weights(("base", ""), ("base", FROM_BASE))
    assert _same_weights(("v3", FROM_BASE), ("v3", FROM_BASE))
    assert _same_weights(("v3", ""), ("v3", ""))
    # Version numbers of different lines name different weights, and a teacher's base is
    # another model.
    assert not _same_weights(("v3", ""), ("v3", FROM_BASE))
    assert not _same_weights(("base", ""), ("base", OPD_TEACHER))
    assert not _same_weights(("base", ""), ("v1", ""))


def test_tasks_whose_preparation_was_interrupted_are_prepared_again(tmp_path: Path) -> None:
    """A run stopped while it materialized the built-in suite's repositories (before the
    manifest) resumes: the repositories left behind are made again, not refused."""
    from orchard.core.artifacts import ArtifactStore
    from orchard.recipes.recipe_tasks import prepare_tasks

    recipe = Recipe.model_validate(
        {"name": "cut", "tasks": {"builtin": {"count": 10, "seed": 2}},
         "harnesses": ["builtin:swe"], "output_dir": tmp_path / "run"}
    )  # fmt: skip
    store = ArtifactStore((tmp_path / "store").as_uri())
    run = RunDir.open(recipe)
    first = prepare_tasks(recipe, run, store)
    (run.root / "tasks" / "tasks.jsonl").unlink()  # as if stopped before the manifest
    leftover = next((run.root / "tasks" / "repos").iterdir())
    (leftover / "half-written").write_text("x")
    again = prepare_tasks(recipe, RunDir.open(recipe), store)
    # The same tasks (a repository's archive is packed anew: git's own files differ).
    assert {s: [t.id for t in ts] for s, ts in again.items()} == {
        s: [t.id for t in ts] for s, ts in first.items()
    }
    assert all(store.exists(t.archive_url) for ts in again.values() for t in ts)
    assert not (leftover / "half-written").exists()
