"""SWE-bench JSONL loading, and the in-repo task instances checked with real git and pytest."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from orchard.reward.sandbox_tests import JUNIT_ENV, patched_paths, pytest_command
from orchard.reward.swe_instances import (
    InstanceFormatError,
    SweInstance,
    load_instances,
    read_instances,
    write_instances,
)
from orchard.reward.swe_tasks import BUILTIN_BLUEPRINTS, build_instances, diff_against_base
from orchard.reward.test_output import parse_junit_xml, parse_pytest_output
from orchard.reward.tests_score import judge_outcomes

LINE = {
    "instance_id": "astropy__astropy-12907",
    "repo": "astropy/astropy",
    "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
    "patch": "diff --git a/x.py b/x.py\n",
    "test_patch": "diff --git a/tests/test_x.py b/tests/test_x.py\n",
    "FAIL_TO_PASS": '["tests/test_x.py::test_a", "tests/test_x.py::test_b[1-2]"]',
    "PASS_TO_PASS": "[]",
    "image": "docker-archive:/images/astropy.tar",
    "version": "4.3",
}


def test_a_real_dataset_line_with_json_encoded_lists() -> None:
    [instance] = read_instances([json.dumps(LINE)])
    assert instance.fail_to_pass == ("tests/test_x.py::test_a", "tests/test_x.py::test_b[1-2]")
    assert instance.pass_to_pass == ()
    assert instance.repo_path == "/testbed"
    assert instance.extra == {"version": "4.3"}
    task = instance.to_task()
    assert (task.image, list(task.fail_to_pass)) == (LINE["image"], list(instance.fail_to_pass))


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"base_commit": None}, "2: base_commit: missing"),
        ({"patch": 7}, "2: patch: expected a string, got 7"),
        ({"FAIL_TO_PASS": "[not json"}, "2: FAIL_TO_PASS: a JSON-encoded list"),
        ({"FAIL_TO_PASS": "[]"}, "2: FAIL_TO_PASS: empty"),
        ({"PASS_TO_PASS": {"a": 1}}, "2: PASS_TO_PASS: expected a list"),
        ({"PASS_TO_PASS": ["ok", ""]}, "2: PASS_TO_PASS: expected a list of non-empty"),
        ({"instance_id": " "}, "2: instance_id: empty"),
        ({"repo_path": "testbed"}, "2: repo_path: must be absolute"),
        ({"image": ["host"]}, "2: image: expected a string"),
    ],
)
def test_errors_name_the_line_and_the_field(change: dict[str, object], where: str) -> None:
    record = {k: v for k, v in {**LINE, **change}.items() if v is not None}
    lines = ["", json.dumps(record)]  # a blank first line is skipped but counted
    with pytest.raises(InstanceFormatError) as caught:
        list(read_instances(lines, source="set.jsonl"))
    assert str(caught.value).startswith("set.jsonl:")
    assert where in str(caught.value)
    assert caught.value.line == 2


def test_bad_lines_and_duplicate_ids() -> None:
    with pytest.raises(InstanceFormatError, match=r"x:1: not JSON"):
        list(read_instances(["{oops"], source="x"))
    with pytest.raises(InstanceFormatError, match=r"x:1: expected a JSON object"):
        list(read_instances(["[1]"], source="x"))
    with pytest.raises(InstanceFormatError, match=r"x:2: instance_id: .* already on line 1"):
        list(read_instances([json.dumps(LINE)] * 2, source="x"))


def test_patched_paths_and_the_default_command() -> None:
    diff = (
        "diff --git a/src/a.py b/src/a.py\n--- a/src/a.py\n+++ b/src/a.py\n"
        "diff --git a/tests/new.py b/tests/new.py\nnew file mode 100644\n--- /dev/null\n"
        "+++ b/tests/new.py\n"
    )
    assert patched_paths(diff) == ["src/a.py", "tests/new.py"]
    command = pytest_command("python3", ["t/a.py::x", "t/b.py::y[1]", "t/a.py::z", "pkg.mod.T.t"])
    assert command == (
        f'python3 -m pytest -rA -p no:cacheprovider --junitxml="${JUNIT_ENV}" t/a.py t/b.py'
    )


def _run_tests(instance: SweInstance, patches: list[str], tmp_path: Path) -> float:
    """Apply ``patches`` with git, run the instance's own test command here, judge it."""
    repo = instance.repo_path
    for patch in patches:
        subprocess.run(["git", "apply", "-"], input=patch, text=True, cwd=repo, check=True)
    junit = tmp_path / f"{instance.instance_id}.xml"
    done = subprocess.run(
        instance.test_command, shell=True, cwd=repo, capture_output=True, text=True,
        env={**os.environ, JUNIT_ENV: str(junit)}, timeout=120, check=False,
    )  # fmt: skip
    outcomes = {**parse_pytest_output(done.stdout), **parse_junit_xml(junit.read_text())}
    verdict = judge_outcomes(outcomes, instance.fail_to_pass, instance.pass_to_pass)
    subprocess.run(["git", "checkout", "-q", "--", "."], cwd=repo, check=True)
    # Every listed test must be in the reports, or the lists are wrong.
    seen = {**verdict.fail_to_pass, **verdict.pass_to_pass}
    assert None not in seen.values(), (seen, done.stdout)
    return verdict.result.value


@pytest.mark.slow
def test_builtin_instances_have_a_real_bug_and_real_tests(tmp_path: Path) -> None:
    instances = build_instances(tmp_path / "a")
    again = build_instances(tmp_path / "b")
    assert [i.base_commit for i in instances] == [i.base_commit for i in again]  # deterministic
    assert len(instances) == len(BUILTIN_BLUEPRINTS) >= 3
    for instance in instances:
        assert instance.patch.startswith("diff --git") and instance.test_patch
        assert instance.image == "host" and Path(instance.repo_path).is_absolute()
        log = subprocess.run(
            ["git", "log", "--format=%H"], cwd=instance.repo_path, capture_output=True,
            text=True, check=True,
        ).stdout.split()  # fmt: skip
        assert log == [instance.base_commit]
        # The bug is real (the new tests fail at base, the old ones pass), and the gold fixes it.
        assert _run_tests(instance, [instance.test_patch], tmp_path) == -1.0
        assert _run_tests(instance, [instance.patch, instance.test_patch], tmp_path) == 1.0


def test_instances_round_trip_through_jsonl(tmp_path: Path) -> None:
    instances = build_instances(tmp_path / "repos")
    path = tmp_path / "tasks.jsonl"
    write_instances(instances, path)
    line = json.loads(path.read_text().splitlines()[0])
    assert isinstance(line["FAIL_TO_PASS"], str)  # as the published datasets write them
    assert load_instances(path) == instances


def test_diff_against_base_leaves_the_repository_as_it_was(tmp_path: Path) -> None:
    [instance] = build_instances(tmp_path, BUILTIN_BLUEPRINTS[1:2])
    repo = Path(instance.repo_path)
    before = (repo / "textkit.py").read_text()
    diff = diff_against_base(repo, {"textkit.py": before + "\n# note\n", "NEW.md": "hi\n"})
    assert "+# note" in diff and "b/NEW.md" in diff
    assert (repo / "textkit.py").read_text() == before
    assert not (repo / "NEW.md").exists()
