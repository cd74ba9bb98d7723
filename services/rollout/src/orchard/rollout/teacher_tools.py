"""A scripted teacher's step, said in the tools the harness in front of it offers.

A plan step names what to do in one of three ways:

- ``shell`` with ``{"command": "..."}``: run a command. It becomes a call of the harness's own
  shell tool, whatever its name and schema (a ``command`` or ``cmd`` string, or an argv array
  that gets ``["bash", "-lc", command]``).
- ``write_file`` with ``{"path": "...", "content": "..."}``: write a file. It becomes the
  harness's file-writing tool, or a shell command with a here-document when it has none.
- any other name: that tool itself when offered, else an MCP tool of the same server and name
  (``mail.send`` matches ``mcp__mail__send``, ``mail_send``, ``mail-send``), else, when its
  arguments hold a ``command`` string (a step written for another harness's shell tool), the
  harness's shell tool.

Offered tools are read in the OpenAI function format (``{"type": "function", "function":
{"name", "description", "parameters"}}``), the form the capture proxy and the scripted endpoint
turn every dialect's tool list into; the flat form (``{"name", "parameters"}``) is read too.
Required parameters a step does not give get a neutral value of their type, so a harness whose
shell tool also demands, say, a ``description`` still gets a call it accepts.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SHELL", "WRITE_FILE", "NoToolFits", "ToolCall", "adapt_step", "tool_schemas"]

SHELL = "shell"
WRITE_FILE = "write_file"

_COMMAND_KEYS = ("command", "cmd")
_PATH_KEYS = ("file_path", "path", "filename", "file", "target_file")
_CONTENT_KEYS = ("content", "contents", "file_text", "text", "data")
_SHELL_NAMES = ("bash", "shell", "exec", "terminal", "exec_command", "run_shell_command")
_WRITE_NAMES = ("write", "write_file", "create_file", "file_write")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call of one offered tool."""

    name: str
    arguments: dict[str, Any]


class NoToolFits(Exception):
    """The harness offers no tool that can carry the step."""


def tool_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Offered tool name → its JSON-schema parameters (an empty object schema when missing)."""
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
        if not isinstance(function, Mapping):
            continue
        name = function.get("name")
        if not isinstance(name, str) or not name:
            continue
        parameters = function.get("parameters") or function.get("input_schema") or {}
        out[name] = parameters if isinstance(parameters, Mapping) else {}
    return out


def adapt_step(
    tool: str, arguments: Mapping[str, Any], tools: Sequence[Mapping[str, Any]]
) -> ToolCall:
    """The call that does what (`tool`, `arguments`) asks with the `tools` offered; raises
    `NoToolFits` naming what was missing."""
    schemas = tool_schemas(tools)
    # The abstract steps come first: a harness's own tool may share their name (Codex's
    # `shell` takes an argv array), and the step's string is then put in that tool's shape.
    if tool == SHELL and isinstance(arguments.get("command"), str | None):
        return _shell_call(_required_text(arguments, "command", tool), schemas)
    if tool == WRITE_FILE and isinstance(arguments.get("path"), str | None):
        path = _required_text(arguments, "path", tool)
        content = arguments.get("content", "")
        if not isinstance(content, str):
            raise NoToolFits(f"{WRITE_FILE} needs a string content, got {type(content).__name__}")
        return _write_call(path, content, schemas)
    if tool in schemas:
        return ToolCall(tool, dict(arguments))
    name = _mcp_name(tool, schemas)
    if name is None and isinstance(arguments.get("command"), str) and arguments["command"]:
        # A command for a shell of another harness (a script written for `bash`).
        return _shell_call(arguments["command"], schemas)
    if name is None:
        offered = ", ".join(sorted(schemas)) or "none"
        raise NoToolFits(f"the harness offers no tool {tool!r} (offered: {offered})")
    return ToolCall(name, dict(arguments))


def _required_text(arguments: Mapping[str, Any], key: str, tool: str) -> str:
    value = arguments.get(key)
    if not isinstance(value, str) or not value:
        raise NoToolFits(f"a {tool} step needs a non-empty string {key!r}")
    return value


def _properties(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    properties = schema.get("properties")
    return properties if isinstance(properties, Mapping) else {}


def _required(schema: Mapping[str, Any]) -> list[str]:
    required = schema.get("required")
    return [r for r in required if isinstance(r, str)] if isinstance(required, list) else []


def _types(prop: Any) -> set[str]:
    if not isinstance(prop, Mapping):
        return set()
    kind = prop.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    found: set[str] = set()
    for union in ("anyOf", "oneOf"):
        for option in prop.get(union) or ():
            found |= _types(option)
    return found


def _neutral(prop: Any) -> Any:
    """A harmless value of the property's type for a required parameter the step leaves out."""
    if isinstance(prop, Mapping):
        if "default" in prop:
            return prop["default"]
        if isinstance(prop.get("enum"), list) and prop["enum"]:
            return prop["enum"][0]
    types = _types(prop)
    if "string" in types:
        return ""
    if types & {"integer", "number"}:
        minimum = prop.get("minimum", 0) if isinstance(prop, Mapping) else 0
        return max(0, minimum) if isinstance(minimum, int | float) else 0
    if "boolean" in types:
        return False
    if "array" in types:
        return []
    if "object" in types:
        return {}
    return None


def _fill(schema: Mapping[str, Any], given: dict[str, Any], description: str) -> dict[str, Any]:
    properties = _properties(schema)
    for key in _required(schema):
        if key in given:
            continue
        given[key] = description if key == "description" else _neutral(properties.get(key))
    return given


def _rank(name: str, preferred: Sequence[str], extra_required: int) -> tuple[int, int, str]:
    lowered = name.lower()
    by_name = 0 if lowered in preferred else 1 if any(p in lowered for p in preferred) else 2
    return (by_name, extra_required, name)


def _shell_call(command: str, schemas: Mapping[str, Mapping[str, Any]]) -> ToolCall:
    candidates = []
    for name, schema in schemas.items():
        properties = _properties(schema)
        key = next((k for k in _COMMAND_KEYS if k in properties), None)
        if key is None:
            continue
        types = _types(properties[key])
        if not types & {"string", "array"}:
            continue
        extra = len([r for r in _required(schema) if r != key])
        candidates.append((_rank(name, _SHELL_NAMES, extra), name, key, types))
    if not candidates:
        offered = ", ".join(sorted(schemas)) or "none"
        raise NoToolFits(f"the harness offers no shell tool (offered: {offered})")
    _, name, key, types = min(candidates)
    value: Any = command if "string" in types else ["bash", "-lc", command]
    arguments = _fill(schemas[name], {key: value}, _describe(command))
    return ToolCall(name, arguments)


def _describe(command: str) -> str:
    first = command.strip().splitlines()[0] if command.strip() else command
    return f"Run: {first[:80]}"


def _write_call(path: str, content: str, schemas: Mapping[str, Mapping[str, Any]]) -> ToolCall:
    candidates = []
    for name, schema in schemas.items():
        properties = _properties(schema)
        path_key = next((k for k in _PATH_KEYS if k in properties), None)
        content_key = next((k for k in _CONTENT_KEYS if k in properties), None)
        if path_key is None or content_key is None:
            continue
        extra = [r for r in _required(schema) if r not in (path_key, content_key)]
        if extra:  # an edit tool (old/new strings) cannot write a whole file
            continue
        candidates.append((_rank(name, _WRITE_NAMES, 0), name, path_key, content_key))
    if candidates:
        _, name, path_key, content_key = min(candidates)
        return ToolCall(name, {path_key: path, content_key: content})
    return _shell_call(_heredoc(path, content), schemas)


def _heredoc(path: str, content: str) -> str:
    marker = "ORCHARD_EOF"
    while marker in content:
        marker += "_"
    body = content if content.endswith("\n") or not content else content + "\n"
    folder = path.rsplit("/", 1)[0] if "/" in path.strip("/") else ""
    mkdir = f"mkdir -p {shlex.quote(folder)} && " if folder else ""
    return f"{mkdir}cat > {shlex.quote(path)} <<'{marker}'\n{body}{marker}"


def _normal(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _mcp_name(tool: str, schemas: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The offered tool that is `tool` served by an MCP server: `server.name` or `server/name`
    matches a name ending in the normalized `server_name` (Claude Code: `mcp__server__name`)."""
    wanted = _normal(tool)
    if not wanted:
        return None
    matches = sorted(
        name for name in schemas if _normal(name) == wanted or _normal(name).endswith(f"_{wanted}")
    )
    return matches[0] if matches else None
