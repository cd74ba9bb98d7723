"""The built-in bash ReAct loop for software tasks: a shell, file view/edit/create and submit,
all run in the task's sandbox through the environment service."""

from __future__ import annotations

from orchard.rollout.harnesses.tool_loop import ToolCallingHarness
from orchard.rollout.harnesses.tools import software_tools

SYSTEM_PROMPT = """\
You are a software engineer working in a Linux machine through tools.
Think briefly, then call one tool per step: `bash` runs a shell command, `view` shows a file,
`edit` replaces one exact piece of text in a file, `create` writes a file. When the task is
done, call `submit`."""


def bash_react_harness(
    *, command_timeout_s: float = 60.0, cwd: str = "", name: str = "builtin:bash"
) -> ToolCallingHarness:
    return ToolCallingHarness(
        name=name,
        system_prompt=SYSTEM_PROMPT,
        tools=tuple(software_tools(command_timeout_s=command_timeout_s, cwd=cwd)),
    )


GENERIC_SYSTEM_PROMPT = """\
You solve the task with the tools you are given. Call tools as needed; when you are done,
answer with your final result without a tool call."""


def generic_tool_harness(name: str = "builtin:tools") -> ToolCallingHarness:
    """The generic loop: no tools of its own; each task declares its tools."""
    return ToolCallingHarness(name=name, system_prompt=GENERIC_SYSTEM_PROMPT)
