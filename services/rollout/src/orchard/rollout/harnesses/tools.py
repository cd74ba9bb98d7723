"""Tools a harness offers the model, each executed in the rollout's sandbox.

A tool declares an OpenAI function schema and runs with the parsed arguments. What the model
did wrong (a missing file, an edit that does not match, a failing command) comes back as an
observation — a policy outcome. What the infrastructure did wrong (the sandbox or its agent
unreachable) raises, and the rollout is excluded.

- `BashTool`, `ViewTool`, `EditTool`, `CreateTool`, `SubmitTool`: the software-task set.
- `CommandTool`: a tool declared per task (name, description, JSON schema, argv); the
  arguments reach the command as JSON on stdin (`orchard.tasks.tools`, shared with recipes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from orchard.sdk import AsyncSandbox
from orchard.sdk import errors as sdk_errors
from orchard.tasks.tools import CommandTool, ToolOutput, exec_text

__all__ = [
    "INFRASTRUCTURE_ERRORS",
    "POLICY_ERRORS",
    "BashTool",
    "CommandTool",
    "CreateTool",
    "EditTool",
    "SubmitTool",
    "Tool",
    "ToolOutput",
    "ViewTool",
    "software_tools",
    "tools_by_name",
]

POLICY_ERRORS: tuple[type[Exception], ...] = (
    sdk_errors.FileNotFound,
    sdk_errors.InvalidArgument,
    sdk_errors.PermissionDenied,
    sdk_errors.AlreadyExists,
    sdk_errors.FailedPrecondition,
)
"""SDK errors a tool call of the model causes; they become observations. `SandboxNotReady`
subclasses FailedPrecondition and is the exception: it is infrastructure."""

INFRASTRUCTURE_ERRORS: tuple[type[Exception], ...] = (
    sdk_errors.SandboxNotReady,
    sdk_errors.SandboxNotFound,
    sdk_errors.Unavailable,
    sdk_errors.DeadlineExceeded,
    sdk_errors.Internal,
    sdk_errors.ResourceExhausted,
    sdk_errors.UnknownError,
)


class Tool(Protocol):
    @property
    def name(self) -> str: ...

    def schema(self) -> dict[str, Any]:
        """The OpenAI `tools` entry."""
        ...

    async def run(self, sandbox: AsyncSandbox, arguments: Mapping[str, Any]) -> ToolOutput: ...


def _function(
    name: str, description: str, properties: dict[str, Any], required: list[str]
) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _string_arg(arguments: Mapping[str, Any], key: str) -> str:
    value = arguments.get(key)
    if not isinstance(value, str):
        raise ValueError(f"argument {key!r} must be a string")
    return value


@dataclass(frozen=True, slots=True)
class BashTool:
    timeout_s: float = 60.0
    output_limit: int = 16_384
    cwd: str = ""
    name: str = "bash"

    def schema(self) -> dict[str, Any]:
        return _function(
            self.name,
            "Run a shell command in the task's machine and get its exit code and output.",
            {"command": {"type": "string", "description": "the command, run by /bin/sh -c"}},
            ["command"],
        )

    async def run(self, sandbox: AsyncSandbox, arguments: Mapping[str, Any]) -> ToolOutput:
        command = _string_arg(arguments, "command")
        result = await sandbox.exec(
            ["/bin/sh", "-c", command],
            timeout=self.timeout_s,
            output_limit=self.output_limit,
            cwd=self.cwd or None,
        )
        text = exec_text(result.exit_code, result.timed_out, result.stdout_text, result.stderr_text)
        return ToolOutput(text, result.exit_code)


@dataclass(frozen=True, slots=True)
class ViewTool:
    max_lines: int = 400
    name: str = "view"

    def schema(self) -> dict[str, Any]:
        return _function(
            self.name,
            "Show a file with line numbers, optionally only lines start_line..end_line.",
            {
                "path": {"type": "string"},
                "start_line": {"type": "integer", "minimum": 1},
                "end_line": {"type": "integer", "minimum": 1},
            },
            ["path"],
        )

    async def run(self, sandbox: AsyncSandbox, arguments: Mapping[str, Any]) -> ToolOutput:
        path = _string_arg(arguments, "path")
        lines = (await sandbox.read_file(path)).decode("utf-8", "replace").splitlines()
        start = int(arguments.get("start_line", 1))
        end = int(arguments.get("end_line", start + self.max_lines - 1))
        shown = lines[start - 1 : min(end, start - 1 + self.max_lines)]
        body = "\n".join(f"{start + i:6d}  {line}" for i, line in enumerate(shown))
        return ToolOutput(f"{path}: {len(lines)} lines\n{body}", 0)


@dataclass(frozen=True, slots=True)
class EditTool:
    name: str = "edit"

    def schema(self) -> dict[str, Any]:
        return _function(
            self.name,
            "Replace the one occurrence of old_text in a file with new_text.",
            {
                "path": {"type": "string"},
                "old_text": {"type": "string"},
                "new_text": {"type": "string"},
            },
            ["path", "old_text", "new_text"],
        )

    async def run(self, sandbox: AsyncSandbox, arguments: Mapping[str, Any]) -> ToolOutput:
        path = _string_arg(arguments, "path")
        old, new = _string_arg(arguments, "old_text"), _string_arg(arguments, "new_text")
        text = (await sandbox.read_file(path)).decode("utf-8")
        count = text.count(old) if old else 0
        if count != 1:
            return ToolOutput(
                f"old_text occurs {count} times in {path}; it must occur exactly once", 1
            )
        await sandbox.write_file(path, text.replace(old, new, 1))
        return ToolOutput(f"edited {path}", 0)


@dataclass(frozen=True, slots=True)
class CreateTool:
    name: str = "create"

    def schema(self) -> dict[str, Any]:
        return _function(
            self.name,
            "Write a file with the given content, replacing it when it exists.",
            {"path": {"type": "string"}, "content": {"type": "string"}},
            ["path", "content"],
        )

    async def run(self, sandbox: AsyncSandbox, arguments: Mapping[str, Any]) -> ToolOutput:
        path = _string_arg(arguments, "path")
        info = await sandbox.write_file(path, _string_arg(arguments, "content"))
        return ToolOutput(f"wrote {info.size} bytes to {path}", 0)


@dataclass(frozen=True, slots=True)
class SubmitTool:
    name: str = "submit"

    def schema(self) -> dict[str, Any]:
        return _function(
            self.name,
            "Finish the task: call it once the work is done.",
            {"summary": {"type": "string", "description": "what was done"}},
            [],
        )

    async def run(self, sandbox: AsyncSandbox, arguments: Mapping[str, Any]) -> ToolOutput:
        return ToolOutput("submitted", 0, submitted=True)


def software_tools(*, command_timeout_s: float = 60.0, cwd: str = "") -> list[Tool]:
    """The built-in set for software tasks: shell, file view/edit/create, submit."""
    return [
        BashTool(timeout_s=command_timeout_s, cwd=cwd),
        ViewTool(),
        EditTool(),
        CreateTool(),
        SubmitTool(),
    ]


def tools_by_name(tools: Sequence[Tool]) -> dict[str, Tool]:
    table: dict[str, Tool] = {}
    for tool in tools:
        if tool.name in table:
            raise ValueError(f"two tools are named {tool.name!r}")
        table[tool.name] = tool
    return table
