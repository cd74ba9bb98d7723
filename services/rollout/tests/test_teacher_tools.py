"""A teacher's step becomes a call of whichever tools a harness offers."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from orchard.rollout.teacher_tools import SHELL, WRITE_FILE, NoToolFits, adapt_step, tool_schemas


def _function(name: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"the {name} tool",
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


STRING = {"type": "string"}
# Tool lists shaped like those of the harnesses the claw domain runs (names and parameter
# shapes as they send them; descriptions left out).
ANTHROPIC_STYLE = [
    _function(
        "Bash",
        {"command": STRING, "timeout": {"type": "number"}, "description": STRING},
        ["command"],
    ),
    _function(
        "Edit",
        {"file_path": STRING, "old_string": STRING, "new_string": STRING},
        ["file_path", "old_string", "new_string"],
    ),
    _function("Write", {"file_path": STRING, "content": STRING}, ["file_path", "content"]),
    _function("mcp__mail__send", {"to": STRING, "subject": STRING, "body": STRING}, ["to"]),
]
ARGV_STYLE = [
    _function(
        "shell",
        {
            "command": {"type": "array", "items": STRING},
            "workdir": STRING,
            "timeout_ms": {"type": "integer"},
        },
        ["command"],
    ),
    _function("update_plan", {"plan": {"type": "array"}}, ["plan"]),
]
CHAT_STYLE = [
    _function("read", {"path": STRING}, ["path"]),
    _function("write", {"path": STRING, "content": STRING}, ["path", "content"]),
    _function(
        "exec",
        {"command": STRING, "workdir": STRING, "yieldMs": {"type": "integer", "minimum": 10}},
        ["command", "yieldMs"],
    ),
]


def test_a_shell_step_takes_the_harness_shell_tool_and_its_argument_shape() -> None:
    call = adapt_step(SHELL, {"command": "mail list --json"}, ANTHROPIC_STYLE)
    assert call.name == "Bash"
    assert call.arguments == {"command": "mail list --json"}

    call = adapt_step(SHELL, {"command": "mail list --json"}, ARGV_STYLE)
    assert call.name == "shell"
    assert call.arguments == {"command": ["bash", "-lc", "mail list --json"]}

    call = adapt_step(SHELL, {"command": "ls"}, CHAT_STYLE)
    assert call.name == "exec"
    # A required parameter the step does not give gets a neutral value of its type.
    assert call.arguments == {"command": "ls", "yieldMs": 10}


def test_a_write_step_takes_a_whole_file_writer_never_an_edit_tool() -> None:
    call = adapt_step(WRITE_FILE, {"path": "notes/a.txt", "content": "hi\n"}, ANTHROPIC_STYLE)
    assert call.name == "Write"
    assert call.arguments == {"file_path": "notes/a.txt", "content": "hi\n"}
    call = adapt_step(WRITE_FILE, {"path": "a.txt", "content": "x"}, CHAT_STYLE)
    assert (call.name, call.arguments) == ("write", {"path": "a.txt", "content": "x"})


def test_without_a_writer_a_write_step_is_a_here_document_that_writes_the_exact_bytes(
    tmp_path: Path,
) -> None:
    content = "line one\n$HOME `x` 'q' \"d\"\nORCHARD_EOF\nno newline at the end"
    target = tmp_path / "deep" / "er" / "out.txt"
    call = adapt_step(WRITE_FILE, {"path": str(target), "content": content}, ARGV_STYLE)
    assert call.name == "shell"
    argv = call.arguments["command"]
    subprocess.run(argv, check=True, timeout=10)
    assert target.read_text() == content + "\n"


def test_an_exact_tool_name_is_kept_and_an_mcp_tool_is_found_by_server_and_name() -> None:
    call = adapt_step("update_plan", {"plan": []}, ARGV_STYLE)
    assert (call.name, call.arguments) == ("update_plan", {"plan": []})
    call = adapt_step("mail.send", {"to": "ana@example.org"}, ANTHROPIC_STYLE)
    assert call.name == "mcp__mail__send"
    assert call.arguments == {"to": "ana@example.org"}


def test_a_command_for_another_harness_shell_runs_in_this_one() -> None:
    call = adapt_step("bash", {"command": "pytest -q"}, ARGV_STYLE)
    assert (call.name, call.arguments) == ("shell", {"command": ["bash", "-lc", "pytest -q"]})


def test_a_step_no_offered_tool_can_carry_says_what_was_missing() -> None:
    with pytest.raises(NoToolFits, match="no shell tool"):
        adapt_step(SHELL, {"command": "ls"}, [_function("read", {"path": STRING}, ["path"])])
    with pytest.raises(NoToolFits, match=r"no tool 'calendar\.add'"):
        adapt_step("calendar.add", {}, ANTHROPIC_STYLE)
    with pytest.raises(NoToolFits, match="non-empty string 'command'"):
        adapt_step(SHELL, {}, ANTHROPIC_STYLE)


def test_flat_and_anthropic_shaped_tool_lists_are_read() -> None:
    flat = [{"name": "bash", "parameters": {"properties": {"command": STRING}}}]
    anthropic = [{"name": "Bash", "input_schema": {"properties": {"command": STRING}}}]
    assert set(tool_schemas(flat)) == {"bash"}
    assert adapt_step(SHELL, {"command": "true"}, anthropic).name == "Bash"
