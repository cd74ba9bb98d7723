"""The task spec on the wire, its refusals, and that the package stays free of service code."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from orchard.reward.v1 import reward_service_pb2
from orchard.rollout.v1 import rollout_service_pb2
from orchard.tasks.commands import JUNIT_ENV, pytest_command
from orchard.tasks.spec import (
    CommandCheck,
    McpServer,
    ServiceTaskCheck,
    TaskFile,
    TaskSpec,
    TestsCheck,
)
from orchard.tasks.tools import CommandTool, exec_text

TOOL = {
    "name": "lookup",
    "description": "look a word up",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
    "command": ["/bin/cat"],
    "timeout_s": 5.0,
}


def _tasks() -> list[TaskSpec]:
    tests = TestsCheck(
        reward_service_pb2.TestTask(instance_id="x", base_commit="abc", fail_to_pass=["t::a"]),
        repo_path="/testbed",
        timeout_s=30.0,
    )
    return [
        TaskSpec("c", "check it", CommandCheck("true", 9.0), setup=("mkdir /w",), memory="256M"),
        TaskSpec(
            "t",
            "fix it",
            tests,
            image="img:1",
            workdir="/testbed",
            files=(TaskFile("file:///store/repos/abc.tar", "/testbed"),),
        ),
        TaskSpec("s", "score it", ServiceTaskCheck("calc-1")),
        TaskSpec(
            "m",
            "mail it",
            ServiceTaskCheck("claw/0/reply_mail/0"),
            mcp_servers=(McpServer("claw", ("/opt/claw/bin/claw-mcp", "--apps", "mail")),),
        ),
        TaskSpec("g", "use the tool", tests, tools=(CommandTool.from_declaration(TOOL),)),
    ]


@pytest.mark.parametrize("task", _tasks(), ids=lambda t: t.id)
def test_every_kind_of_task_goes_to_a_rollout_task_and_back_unchanged(task: TaskSpec) -> None:
    wire = task.to_proto()
    assert isinstance(wire, rollout_service_pb2.RolloutTask)
    assert json.loads(wire.scorer_json)  # a JSON object a service in any language can read
    assert TaskSpec.from_proto(wire) == task


def test_a_declared_tool_reads_back_as_declared() -> None:
    tool = CommandTool.from_declaration(TOOL)
    assert tool.declaration() == TOOL
    assert tool.schema()["function"]["name"] == "lookup"
    assert exec_text(1, False, "out\n", "err\n") == "exit code 1\nout\nstderr:\nerr"
    assert exec_text(None, True, "", "") == "timed out"


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({}, "exactly one of"),
        ({"check": {"command": "true"}, "score_task": "x"}, "got check and score_task"),
        ({"check": "true"}, '"check": {"command"'),
        ({"tests": {"instance_id": "x"}}, "non-empty fail_to_pass"),
        ({"tests": {"fail_to_pass": ["a"], "nonsense": 1}}, "is not a TestTask"),
        ({"tests": {"fail_to_pass": ["a"], "repo_path": "repo"}}, "must be absolute"),
        ({"score_task": ""}, "must name a reward service task"),
        ({"score_task": "x", "setup": "make"}, "list of shell commands"),
        ({"score_task": "x", "workdir": "rel"}, "absolute path"),
        ({"score_task": "x", "files": [{"url": "/local/path.tar", "path": "/t"}]}, "artifact URL"),
        ({"score_task": "x", "files": [{"url": "file:///a.tar", "path": "t"}]}, "absolute"),
        ({"score_task": "x", "tools": [{"name": "n"}]}, "lacks parameters, command"),
        ({"score_task": "x", "mcp_servers": {"claw": ["c"]}}, "must be a list"),
        ({"score_task": "x", "mcp_servers": [{"name": "c", "command": []}]}, '"command": ["argv"'),
        ({"score_task": "x", "mcp_servers": [{"name": "a b", "command": ["c"]}]}, "letters"),
        ({"score_task": "x", "mcp_servers": [{"name": "c", "command": "c"}]}, "got {"),
        (
            {"score_task": "x", "mcp_servers": [{"name": "c", "command": ["c"]}] * 2},
            "names 'c' twice",
        ),
    ],
)
def test_bad_settings_are_refused_saying_what_to_fix(settings: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match="task 'id'") as info:
        TaskSpec.from_settings("id", "do it", settings)
    assert words in str(info.value)


def test_a_rollout_task_that_is_not_json_is_refused() -> None:
    wire = rollout_service_pb2.RolloutTask(id="x", instruction="i", scorer_json="{oops")
    with pytest.raises(ValueError, match="not JSON"):
        TaskSpec.from_proto(wire)


def test_the_test_command_runs_the_files_its_ids_name() -> None:
    command = pytest_command("python3", ["tests/test_a.py::t1", "tests/test_b.py::t2[x]", "q"])
    assert command.endswith("tests/test_a.py tests/test_b.py")
    assert f'--junitxml="${JUNIT_ENV}"' in command


def test_importing_the_package_loads_no_service_code_and_no_torch() -> None:
    code = (
        "import sys, orchard.tasks.spec, orchard.tasks.tools, orchard.tasks.swe_instances, "
        "orchard.tasks.swe_tasks, orchard.tasks.commands; print(' '.join(sorted(sys.modules)))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    services = ("orchard.rollout.", "orchard.reward.", "orchard.trainer.", "orchard.env.")
    leaked = [
        name
        for name in loaded
        if name.split(".")[0] in {"torch", "transformers", "deepspeed", "ray", "vllm"}
        or name.startswith("orchard.lm")
        or (name.startswith(services) and ".v1" not in name)
    ]
    assert leaked == []
