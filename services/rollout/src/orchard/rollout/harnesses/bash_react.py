"""The built-in bash ReAct loop for software tasks: a shell, file view/edit/create and submit,
all run in the task's sandbox through the environment service."""

from __future__ import annotations

from orchard.rollout.harnesses.tool_loop import ToolCallingHarness
from orchard.rollout.harnesses.tools import BashTool, SubmitTool, software_tools

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
        description="The full software loop: a shell, view, edit and create a file, submit.",
        tools=tuple(software_tools(command_timeout_s=command_timeout_s, cwd=cwd)),
    )


SHELL_SYSTEM_PROMPT = """\
You fix a bug in the repository you are in. Call one tool per step: `bash` runs a shell
command; call `submit` when the tests pass."""


def shell_harness(
    *, command_timeout_s: float = 60.0, cwd: str = "", name: str = "builtin:swe"
) -> ToolCallingHarness:
    """The lean software loop: a shell and submit, with a short system prompt. Its prompt is
    a quarter of the full loop's in tokens, which is what a small model's context can hold."""
    return ToolCallingHarness(
        name=name,
        system_prompt=SHELL_SYSTEM_PROMPT,
        description="The lean software loop for small models: a shell and submit.",
        tools=(BashTool(timeout_s=command_timeout_s, cwd=cwd), SubmitTool()),
    )


GENERIC_SYSTEM_PROMPT = """\
You solve the task with the tools you are given. Call tools as needed; when you are done,
answer with your final result without a tool call."""


def generic_tool_harness(name: str = "builtin:tools") -> ToolCallingHarness:
    """The generic loop: no tools of its own; each task declares its tools."""
    return ToolCallingHarness(
        name=name,
        system_prompt=GENERIC_SYSTEM_PROMPT,
        description="A generic tool loop with no tools of its own: each task declares its tools.",
    )
