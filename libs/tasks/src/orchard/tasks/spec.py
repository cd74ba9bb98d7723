"""What a task is, as recipes write it and orchard-rollout reads it: `scorer_json`.

Both sides share this wire format, so it lives here, free of either side's runtime (the
rollout service runs and scores tasks). A task comes from `orchard.rollout.v1.RolloutTask`:
id, image, instruction and `scorer_json`, a JSON object with

- `files`: [{"url": artifact URL of a tar archive, "path": absolute folder}]: unpacked into the
  fresh sandbox before setup (`orchard.rollout.task_files`), so a task's repository travels by
  URL;
- `setup`: shell commands run in the fresh sandbox before the harness starts,
- `check`: {"command": shell command, "timeout_s": seconds}: exit code 0 scores 1, else 0,
  run in the sandbox through the environment service,
- or `tests`: a SWE-style test task (the fields of `orchard.reward.v1.TestTask`, plus
  `repo_path` and `timeout_s`): the reward service's ScoreTests scores the sandbox's changes
  to the repository as the candidate patch,
- or `score_task`: the id of a task in the reward service's task set, scored by its ScoreTask
  checks in the sandbox,
- or `gui`: {"task_id": a built-in GUI task id ("gui/<seed>/<family>/<n>"), "judge": the
  reward service's judge (empty: its built-in state judge, "builtin:gui-state")}: a browser
  episode (a site sandbox and a browser sandbox) in place of the one sandbox, driven by a
  browser harness and scored by the reward service's JudgeOutcome; such a task takes no
  `files`, `setup`, `tools`, `workdir` or `mcp_servers`,
- `tools`: tool declarations for the generic loop ({"name", "description", "parameters",
  "command": argv, "timeout_s"?}),
- `memory`: the sandbox's memory limit ("512M"); doubled once when setup runs out of memory,
- `workdir`: an absolute directory the harness's shell commands run in (e.g. "/testbed"),
- `mcp_servers`: [{"name", "command": argv}]: MCP servers over stdio that the sandbox can run
  (e.g. the Claw tools' ``claw-mcp``); an agent program with MCP support is configured to start
  them (`orchard.rollout.harnesses.sandboxed`), a shell-only harness ignores them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from orchard.reward.v1 import reward_service_pb2
from orchard.rollout.v1 import rollout_service_pb2
from orchard.tasks.tools import CommandTool

__all__ = [
    "GUI_STATE_JUDGE",
    "Check",
    "CommandCheck",
    "GuiCheck",
    "McpServer",
    "ServiceTaskCheck",
    "TaskFile",
    "TaskSpec",
    "TestsCheck",
]


@dataclass(frozen=True, slots=True)
class CommandCheck:
    """Scored by `command`'s exit code in the sandbox: 0 scores 1, anything else 0."""

    command: str
    timeout_s: float = 120.0


@dataclass(frozen=True, slots=True)
class TestsCheck:
    """Scored by the reward service's ScoreTests: what the rollout changed in `repo_path` (its
    diff against the base commit) is the candidate patch."""

    __test__ = False  # not a pytest test class

    task: reward_service_pb2.TestTask
    repo_path: str = "/testbed"
    timeout_s: float = 0.0
    """0: the reward service's default."""


@dataclass(frozen=True, slots=True)
class ServiceTaskCheck:
    """Scored by the reward service's ScoreTask: the checks of `task_id` in its task set."""

    task_id: str


GUI_STATE_JUDGE = "builtin:gui-state"
"""The reward service's judge that reads a built-in GUI task's site state (no model)."""


@dataclass(frozen=True, slots=True)
class GuiCheck:
    """A browser episode of the built-in GUI task `task_id`, scored by the reward service's
    JudgeOutcome with `judge` (the built-in state judge, or a vision model judge by name)."""

    task_id: str
    judge: str = GUI_STATE_JUDGE


Check = CommandCheck | TestsCheck | ServiceTaskCheck | GuiCheck


@dataclass(frozen=True, slots=True)
class TaskFile:
    """An archive in the artifact store (tar, plain or compressed) unpacked at ``path`` in the
    sandbox before setup (`orchard.rollout.task_files`)."""

    url: str
    path: str

    def declaration(self) -> dict[str, str]:
        return {"url": self.url, "path": self.path}


@dataclass(frozen=True, slots=True)
class McpServer:
    """An MCP server over stdio in the sandbox: `command` is its argv there."""

    name: str
    command: tuple[str, ...]

    def declaration(self) -> dict[str, Any]:
        return {"name": self.name, "command": list(self.command)}


_MCP_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def _mcp_servers(task_id: str, settings: Mapping[str, Any]) -> tuple[McpServer, ...]:
    raw = settings.get("mcp_servers", [])
    if not isinstance(raw, list):
        raise ValueError(f'task {task_id!r}: "mcp_servers" must be a list of {{"name", "command"}}')
    out: list[McpServer] = []
    for item in raw:
        name = item.get("name") if isinstance(item, dict) else None
        command = item.get("command") if isinstance(item, dict) else None
        if (
            not isinstance(item, dict)
            or set(item) != {"name", "command"}
            or not isinstance(name, str)
            or not 0 < len(name) <= 64
            or not set(name) <= _MCP_NAME_CHARS
            or not isinstance(command, list)
            or not command
            or not all(isinstance(part, str) and part for part in command)
        ):
            raise ValueError(
                f'task {task_id!r}: each of "mcp_servers" must be {{"name": letters, digits, '
                f'"_" or "-" (at most 64), "command": ["argv", "in", "the", "sandbox"]}}, '
                f"got {item!r}"
            )
        if any(server.name == name for server in out):
            raise ValueError(f"task {task_id!r}: mcp_servers names {name!r} twice")
        out.append(McpServer(name, tuple(command)))
    return tuple(out)


def _files(task_id: str, settings: Mapping[str, Any]) -> tuple[TaskFile, ...]:
    raw = settings.get("files", [])
    if not isinstance(raw, list):
        raise ValueError(f'task {task_id!r}: "files" must be a list of {{"url", "path"}}')
    out = []
    for item in raw:
        if not isinstance(item, dict) or set(item) != {"url", "path"}:
            raise ValueError(
                f'task {task_id!r}: each of "files" must be {{"url": "<artifact URL of a tar '
                f'archive>", "path": "/absolute/folder"}}, got {item!r}'
            )
        url, path = item["url"], item["path"]
        if not isinstance(url, str) or "://" not in url:
            raise ValueError(f"task {task_id!r}: files url {url!r} must be an artifact URL")
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"task {task_id!r}: files path {path!r} must be absolute")
        out.append(TaskFile(url, path))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class TaskSpec:
    id: str
    instruction: str
    check: Check
    image: str = "host"
    setup: tuple[str, ...] = ()
    tools: tuple[CommandTool, ...] = ()
    memory: str = ""
    workdir: str = ""
    """Where the harness's shell commands run; empty: the sandbox's working directory."""
    files: tuple[TaskFile, ...] = ()
    """Archives unpacked into the sandbox before `setup` runs."""
    mcp_servers: tuple[McpServer, ...] = ()
    """MCP servers the sandbox can run, for agent programs that take them."""

    def to_proto(self) -> rollout_service_pb2.RolloutTask:
        """The task as a rollout job takes it (`from_proto` gives it back)."""
        settings: dict[str, Any] = {}
        check = self.check
        if isinstance(check, CommandCheck):
            settings["check"] = {"command": check.command, "timeout_s": check.timeout_s}
        elif isinstance(check, TestsCheck):
            tests = json_format.MessageToDict(check.task, preserving_proto_field_name=True)
            paths = {"repo_path": check.repo_path, "timeout_s": check.timeout_s}
            settings["tests"] = {**tests, **paths}
        elif isinstance(check, GuiCheck):
            settings["gui"] = {"task_id": check.task_id, "judge": check.judge}
        else:
            settings["score_task"] = check.task_id
        if self.setup:
            settings["setup"] = list(self.setup)
        if self.files:
            settings["files"] = [item.declaration() for item in self.files]
        if self.tools:
            settings["tools"] = [tool.declaration() for tool in self.tools]
        if self.memory:
            settings["memory"] = self.memory
        if self.workdir:
            settings["workdir"] = self.workdir
        if self.mcp_servers:
            settings["mcp_servers"] = [server.declaration() for server in self.mcp_servers]
        return rollout_service_pb2.RolloutTask(
            id=self.id,
            image=self.image,
            instruction=self.instruction,
            scorer_json=json.dumps(settings, sort_keys=True),
        )

    @classmethod
    def from_proto(cls, task: rollout_service_pb2.RolloutTask) -> TaskSpec:
        """Raises ValueError with what is wrong."""
        if not task.id:
            raise ValueError("a task has no id")
        if not task.instruction:
            raise ValueError(f"task {task.id!r} has no instruction")
        try:
            settings = json.loads(task.scorer_json or "{}")
        except ValueError as exc:
            raise ValueError(f"task {task.id!r}: scorer_json is not JSON: {exc}") from exc
        if not isinstance(settings, dict):
            raise ValueError(f"task {task.id!r}: scorer_json must be a JSON object")
        return cls.from_settings(task.id, task.instruction, settings, image=task.image or "host")

    @classmethod
    def from_settings(
        cls, task_id: str, instruction: str, settings: Mapping[str, Any], *, image: str = "host"
    ) -> TaskSpec:
        scorers = [k for k in ("check", "tests", "score_task", "gui") if k in settings]
        if len(scorers) != 1:
            raise ValueError(
                f'task {task_id!r}: scorer_json needs exactly one of "check": {{"command": '
                f'"..."}}, "tests": {{SWE test task}}, "score_task": "<reward task id>" or '
                '"gui": {"task_id": "<GUI task id>"}'
                + (f", got {' and '.join(scorers)}" if scorers else "")
            )
        checker = _check(task_id, settings)
        if isinstance(checker, GuiCheck):
            extra = [
                k for k in ("files", "setup", "tools", "workdir", "mcp_servers") if settings.get(k)
            ]
            if extra:
                raise ValueError(
                    f"task {task_id!r} is a GUI task (its sandboxes are a browser episode's): "
                    f"it takes no {', '.join(extra)}"
                )
        setup = settings.get("setup", [])
        if not isinstance(setup, list) or not all(isinstance(s, str) for s in setup):
            raise ValueError(f'task {task_id!r}: "setup" must be a list of shell commands')
        try:
            tools = tuple(CommandTool.from_declaration(d) for d in settings.get("tools", []))
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"task {task_id!r}: {exc}") from exc
        workdir = settings.get("workdir", "")
        if not isinstance(workdir, str) or (workdir and not workdir.startswith("/")):
            raise ValueError(f'task {task_id!r}: "workdir" must be an absolute path')
        return cls(
            id=task_id,
            instruction=instruction,
            check=checker,
            image=image,
            setup=tuple(setup),
            tools=tools,
            memory=str(settings.get("memory", "")),
            workdir=workdir,
            files=_files(task_id, settings),
            mcp_servers=_mcp_servers(task_id, settings),
        )


def _check(task_id: str, settings: Mapping[str, Any]) -> Check:
    if "gui" in settings:
        gui = settings["gui"]
        if not isinstance(gui, dict) or not isinstance(gui.get("task_id"), str):
            raise ValueError(
                f'task {task_id!r}: "gui" must be {{"task_id": "gui/<seed>/<family>/<n>", '
                '"judge": "<reward judge>"}'
            )
        unknown = sorted(set(gui) - {"task_id", "judge"})
        if unknown:
            raise ValueError(f'task {task_id!r}: "gui" has unknown fields {", ".join(unknown)}')
        judge = gui.get("judge") or GUI_STATE_JUDGE
        if not isinstance(judge, str):
            raise ValueError(f'task {task_id!r}: "gui.judge" must name a reward service judge')
        return GuiCheck(gui["task_id"], judge)
    if "score_task" in settings:
        name = settings["score_task"]
        if not isinstance(name, str) or not name:
            raise ValueError(f'task {task_id!r}: "score_task" must name a reward service task')
        return ServiceTaskCheck(name)
    if "tests" in settings:
        tests = settings["tests"]
        if not isinstance(tests, dict):
            raise ValueError(f'task {task_id!r}: "tests" must be a JSON object (a TestTask)')
        fields = dict(tests)
        repo_path = str(fields.pop("repo_path", "/testbed"))
        timeout_s = fields.pop("timeout_s", 0.0)
        try:
            task = json_format.ParseDict(fields, reward_service_pb2.TestTask())
        except json_format.ParseError as exc:
            raise ValueError(f'task {task_id!r}: "tests" is not a TestTask: {exc}') from None
        if not task.fail_to_pass:
            raise ValueError(f'task {task_id!r}: "tests" needs a non-empty fail_to_pass list')
        if not repo_path.startswith("/"):
            raise ValueError(f'task {task_id!r}: "tests.repo_path" must be absolute')
        if not isinstance(timeout_s, int | float) or timeout_s < 0:
            raise ValueError(f'task {task_id!r}: "tests.timeout_s" must be a number >= 0')
        return TestsCheck(task, repo_path, float(timeout_s))
    check = settings["check"]
    if not isinstance(check, dict) or not isinstance(check.get("command"), str):
        raise ValueError(f'task {task_id!r}: scorer_json needs "check": {{"command": "..."}}')
    return CommandCheck(check["command"], float(check.get("timeout_s", 120.0)))
