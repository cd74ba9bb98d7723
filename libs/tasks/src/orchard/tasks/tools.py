"""Tools a task declares (`tools` of `scorer_json`): name, description, JSON schema, argv.

The model's arguments reach the command as JSON on stdin; its exit code and output come back
as the observation. The declaration and its run live together, so a tool a recipe writes is
exactly the tool orchard-rollout's harnesses offer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchard.sdk import AsyncSandbox

__all__ = ["CommandTool", "ToolOutput", "exec_text"]


@dataclass(frozen=True, slots=True)
class ToolOutput:
    text: str
    exit_code: int | None = None
    submitted: bool = False


def exec_text(exit_code: int | None, timed_out: bool, stdout: str, stderr: str) -> str:
    """A command's result as the model reads it: status line, stdout, stderr."""
    head = "timed out" if timed_out else f"exit code {exit_code}"
    parts = [head]
    if stdout:
        parts.append(stdout.rstrip("\n"))
    if stderr:
        parts.append("stderr:\n" + stderr.rstrip("\n"))
    return "\n".join(parts)


@dataclass(frozen=True, slots=True)
class CommandTool:
    """A tool declared by a task: the model's arguments go to `argv` as JSON on stdin; the
    command's exit code and output come back."""

    name: str
    description: str
    parameters: dict[str, Any]
    argv: tuple[str, ...]
    timeout_s: float = 60.0
    output_limit: int = 16_384
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_declaration(cls, declaration: Mapping[str, Any]) -> CommandTool:
        """From {"name", "description", "parameters", "command": [argv...], "timeout_s"?}."""
        missing = [k for k in ("name", "parameters", "command") if k not in declaration]
        if missing:
            raise ValueError(f"tool declaration lacks {', '.join(missing)}")
        argv = declaration["command"]
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"tool {declaration['name']!r}: command must be a non-empty argv list")
        return cls(
            name=str(declaration["name"]),
            description=str(declaration.get("description", "")),
            parameters=dict(declaration["parameters"]),
            argv=tuple(argv),
            timeout_s=float(declaration.get("timeout_s", 60.0)),
        )

    def declaration(self) -> dict[str, Any]:
        """What `from_declaration` reads back."""
        return {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "command": list(self.argv),
            "timeout_s": self.timeout_s,
        }

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    async def run(self, sandbox: AsyncSandbox, arguments: Mapping[str, Any]) -> ToolOutput:
        result = await sandbox.exec(
            list(self.argv),
            stdin=json.dumps(dict(arguments)),
            timeout=self.timeout_s,
            output_limit=self.output_limit,
            env=self.env or None,
        )
        text = exec_text(result.exit_code, result.timed_out, result.stdout_text, result.stderr_text)
        return ToolOutput(text, result.exit_code)
