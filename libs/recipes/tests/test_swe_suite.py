"""The built-in suite: every generated bug is real (its new tests fail at the base commit), the
teacher's solution fixes it and its failure does not, and the split keeps families together."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from orchard.recipes.swe_suite import (
    FAMILIES,
    SuiteTask,
    generate_suite,
    split_suite,
    teacher_script,
)
from orchard.rollout.scripted_policy import PolicyScript
from orchard.tasks.swe_tasks import materialize


def _pytest(repo: Path, tests: tuple[str, ...]) -> int:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=repo, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    return done.returncode


def _apply(repo: Path, task: SuiteTask, which: str) -> None:
    for edit in task.fix if which == "fix" else task.wrong_fix:
        path = repo / edit.path
        text = path.read_text()
        assert text.count(edit.old_text) == 1, f"{task.instance_id}: edit target not unique"
        path.write_text(text.replace(edit.old_text, edit.new_text))


def _shell(repo: Path, command: str) -> None:
    done = subprocess.run(
        ["/bin/sh", "-c", command],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"{command!r}: {done.stderr}"


def test_same_seed_same_suite_and_difficulties_are_balanced() -> None:
    a, b = generate_suite(15, seed=3), generate_suite(15, seed=3)
    assert [t.blueprint for t in a] == [t.blueprint for t in b]
    assert [t.blueprint for t in generate_suite(15, seed=4)] != [t.blueprint for t in a]
    assert Counter(t.family for t in a) == {family: 3 for family in FAMILIES}
    assert Counter(t.difficulty for t in a) == {1: 6, 2: 6, 3: 3}
    assert len({t.instance_id for t in a}) == 15


@pytest.mark.slow
def test_every_bug_is_real_and_the_teachers_paths_do_what_they_say(tmp_path: Path) -> None:
    tasks = generate_suite(len(FAMILIES), seed=11)  # one of each family
    for task in tasks:
        instance = materialize(task.blueprint, tmp_path)
        repo = Path(instance.repo_path)
        f2p, p2p = task.blueprint.fail_to_pass, task.blueprint.pass_to_pass
        for relative, content in task.blueprint.tests.items():  # the test patch
            (repo / relative).write_text(content)
        assert _pytest(repo, p2p) == 0, f"{task.instance_id}: PASS_TO_PASS fails at base"
        assert _pytest(repo, f2p) != 0, f"{task.instance_id}: FAIL_TO_PASS passes at base"

        _apply(repo, task, "fix")
        fixed = {path: (repo / path).read_text() for path in task.blueprint.fix}
        assert fixed == dict(task.blueprint.fix), f"{task.instance_id}: edits != gold patch"
        assert _pytest(repo, (*f2p, *p2p)) == 0, f"{task.instance_id}: the fix does not fix"

        subprocess.run(["git", "checkout", "-q", "--", "src"], cwd=repo, check=True)
        _apply(repo, task, "wrong")
        assert _pytest(repo, (*f2p, *p2p)) != 0, f"{task.instance_id}: the wrong fix passes"

        # The teacher's shell commands: the fix gives exactly the gold files, the wrong one
        # leaves a failing test.
        subprocess.run(["git", "checkout", "-q", "--", "src"], cwd=repo, check=True)
        _shell(repo, task.shell.look)
        _shell(repo, task.shell.fix)
        fixed = {path: (repo / path).read_text() for path in task.blueprint.fix}
        assert fixed == dict(task.blueprint.fix), f"{task.instance_id}: shell fix != gold patch"
        subprocess.run(["git", "checkout", "-q", "--", "src"], cwd=repo, check=True)
        _shell(repo, task.shell.wrong)
        assert _pytest(repo, (*f2p, *p2p)) != 0, f"{task.instance_id}: the wrong command passes"
        assert subprocess.run(["git", "diff", "--quiet"], cwd=repo, check=False).returncode == 1


def test_family_commands_name_nothing_task_specific() -> None:
    tasks = generate_suite(3 * len(FAMILIES), seed=2)
    for family in FAMILIES:
        members = [t for t in tasks if t.family == family]
        assert len({t.shell for t in members}) == 1  # one command set per family
        assert all(t.blueprint.repo.split("/")[1] not in t.shell.fix for t in members)


def test_split_is_stratified_and_disjoint() -> None:
    tasks = generate_suite(20, seed=0)
    splits = split_suite(tasks, {"sft": 0.5, "rl": 0.25, "evaluate": 0.25}, seed=0)
    ids = [t.instance_id for split in splits.values() for t in split]
    assert sorted(ids) == sorted(t.instance_id for t in tasks)  # each task exactly once
    assert [len(splits[s]) for s in ("sft", "rl", "evaluate")] == [10, 5, 5]
    for split in splits.values():
        assert {t.family for t in split} == set(FAMILIES)
    with pytest.raises(ValueError, match="sum to 1"):
        split_suite(tasks, {"sft": 0.5, "rl": 0.5, "evaluate": 0.5})


def test_small_suites_still_hold_out_every_family() -> None:
    splits = split_suite(generate_suite(10, seed=1), {"sft": 0.7, "rl": 0.2, "evaluate": 0.1})
    assert {t.family for t in splits["evaluate"]} == set(FAMILIES)


def test_the_teacher_script_selects_each_tasks_own_plan() -> None:
    tasks = generate_suite(12, seed=5)
    script = PolicyScript.from_json(teacher_script(tasks))
    for task in tasks:
        plan = script.plan_for(task.blueprint.problem_statement)
        assert plan is not None and plan.match == task.marker
        commands = [s.arguments.get("command") for s in plan.solution if s.tool == "bash"]
        assert commands[0] == task.shell.look and commands[2] == task.shell.fix
        assert task.shell.wrong in [s.arguments.get("command") for s in plan.failure]
        assert plan.solution[-1].tool == "submit" and plan.failure[-1].tool == "submit"
    rates = {t.difficulty: script.plan_for(t.blueprint.problem_statement).solve_rate for t in tasks}  # type: ignore[union-attr]
    assert rates[1] > rates[2] > rates[3]


def test_a_suite_repository_runs_its_tests_without_the_interpreters_plugins(
    tmp_path: Path,
) -> None:
    # The interpreter the sandboxes run has pytest plugins installed (hypothesis, anyio, ...);
    # loading them made each test run cost about six times what the tests themselves do.
    task = generate_suite(5, seed=3)[0]
    repo = Path(materialize(task.blueprint, tmp_path).repo_path)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"],
        cwd=repo, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert "collected" in done.stdout, done.stdout + done.stderr
    plugins = [line for line in done.stdout.splitlines() if line.startswith("plugins:")]
    assert plugins == [], plugins
    # Without the setting the same interpreter does load them: the check above can fail.
    (repo / "pyproject.toml").write_text(
        (repo / "pyproject.toml").read_text().replace("--disable-plugin-autoload", "")
    )
    again = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"],
        cwd=repo, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert any(line.startswith("plugins:") for line in again.stdout.splitlines())
