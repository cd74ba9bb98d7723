"""The 13 atomic tools of the GUI domain: names, JSON schemas, OpenAI tool format, and the
checking of the arguments a model sends (before anything touches the browser).

Coordinates are viewport pixels of the latest screenshot (origin top left), as a
screenshot-driven agent reads them. Checking here covers what a schema says (required and
unknown fields, types, enums, ranges); whether a point lies inside the viewport or a tab index
exists depends on the browser's state and is checked by `orchard.tasks.gui.browser`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MAX_WAIT_SECONDS",
    "TOOLS",
    "TOOL_NAMES",
    "ToolArgumentError",
    "ToolSpec",
    "tool_schemas",
    "validate_arguments",
]

# A wait longer than this is almost always a stuck agent; the rollout's clock is the real cap.
MAX_WAIT_SECONDS = 10.0
MAX_SCROLL_PIXELS = 5000
MAX_TEXT_CHARS = 5000


class ToolArgumentError(ValueError):
    """A tool call the browser cannot run as given; the message says what to fix."""


def _coord(axis: str) -> dict[str, Any]:
    return {
        "type": "number",
        "minimum": 0,
        "description": f"{axis} in viewport pixels of the latest screenshot (0 is the "
        + ("left edge)" if axis == "x" else "top edge)"),
    }


@dataclass(frozen=True)
class ToolSpec:
    """One tool: its name, what it does (for the model) and the JSON schema of its arguments."""

    name: str
    description: str
    properties: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    required: tuple[str, ...] = ()

    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the arguments (an object; unknown fields are refused)."""
        return {
            "type": "object",
            "properties": {k: dict(v) for k, v in self.properties.items()},
            "required": list(self.required),
            "additionalProperties": False,
        }

    def openai_schema(self) -> dict[str, Any]:
        """The tool as an OpenAI chat-completions function tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters(),
            },
        }


_SPECS = (
    ToolSpec(
        "click",
        "Click at a point of the page. Use clicks=2 for a double click.",
        {
            "x": _coord("x"),
            "y": _coord("y"),
            "button": {"type": "string", "enum": ["left", "right", "middle"], "default": "left"},
            "clicks": {"type": "integer", "minimum": 1, "maximum": 3, "default": 1},
        },
        ("x", "y"),
    ),
    ToolSpec(
        "write",
        "Type text into the focused field. Give x and y to click a field first; clear=true "
        "replaces what the field holds.",
        {
            "text": {"type": "string", "maxLength": MAX_TEXT_CHARS, "description": "the text"},
            "x": _coord("x"),
            "y": _coord("y"),
            "clear": {"type": "boolean", "default": False},
        },
        ("text",),
    ),
    ToolSpec(
        "press_keys",
        "Press keys in order, e.g. ['Enter'], ['Tab', 'Tab'] or ['Control+a', 'Backspace'] "
        "(key names as in KeyboardEvent.key; '+' joins a chord).",
        {
            "keys": {
                "type": "array",
                "items": {"type": "string", "minLength": 1},
                "minItems": 1,
                "maxItems": 20,
            }
        },
        ("keys",),
    ),
    ToolSpec(
        "scroll",
        "Scroll the page (or the scrollable element under x, y) in a direction.",
        {
            "direction": {"type": "string", "enum": ["up", "down", "left", "right"]},
            "amount": {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_SCROLL_PIXELS,
                "default": 600,
                "description": "pixels",
            },
            "x": _coord("x"),
            "y": _coord("y"),
        },
        ("direction",),
    ),
    ToolSpec(
        "wait",
        "Wait for the page to change (loading, animations), then look again.",
        {
            "seconds": {
                "type": "number",
                "minimum": 0,
                "maximum": MAX_WAIT_SECONDS,
                "default": 1,
            }
        },
    ),
    ToolSpec(
        "drag",
        "Press the mouse at one point, move to another and release (sliders, drag and drop).",
        {
            "from_x": _coord("x"),
            "from_y": _coord("y"),
            "to_x": _coord("x"),
            "to_y": _coord("y"),
        },
        ("from_x", "from_y", "to_x", "to_y"),
    ),
    ToolSpec(
        "hover",
        "Move the mouse over a point without clicking (menus, tooltips).",
        {"x": _coord("x"), "y": _coord("y")},
        ("x", "y"),
    ),
    ToolSpec(
        "goto_url",
        "Open a URL in the active tab.",
        {"url": {"type": "string", "minLength": 1, "description": "http(s) URL"}},
        ("url",),
    ),
    ToolSpec("go_back", "Go back one page in the active tab's history."),
    ToolSpec(
        "new_tab",
        "Open a new tab (at url, or blank) and make it the active tab.",
        {"url": {"type": "string", "description": "http(s) URL; leave out for a blank tab"}},
    ),
    ToolSpec(
        "switch_tab",
        "Make the tab at index (0 is the first) the active tab.",
        {"index": {"type": "integer", "minimum": 0}},
        ("index",),
    ),
    ToolSpec(
        "close_tab",
        "Close the tab at index (the active tab when left out); the last tab cannot be closed.",
        {"index": {"type": "integer", "minimum": 0}},
    ),
    ToolSpec(
        "done",
        "Finish the task, with the answer or a short report for the user.",
        {"response": {"type": "string", "description": "the answer or report"}},
        ("response",),
    ),
)

TOOLS: Mapping[str, ToolSpec] = {spec.name: spec for spec in _SPECS}
TOOL_NAMES: tuple[str, ...] = tuple(TOOLS)


def tool_schemas() -> list[dict[str, Any]]:
    """The 13 tools in OpenAI function-tool format, in a fixed order."""
    return [spec.openai_schema() for spec in _SPECS]


def _check_value(tool: str, key: str, schema: Mapping[str, Any], value: Any) -> Any:
    kind = schema.get("type")
    where = f"{tool}: {key}"
    if kind == "number":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ToolArgumentError(f"{where} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ToolArgumentError(f"{where} must be a finite number, got {value!r}")
    elif kind == "integer":
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ToolArgumentError(f"{where} must be an integer, got {value!r}")
    elif kind == "string":
        if not isinstance(value, str):
            raise ToolArgumentError(f"{where} must be a string, got {value!r}")
        if len(value) < schema.get("minLength", 0):
            raise ToolArgumentError(f"{where} must not be empty")
        if len(value) > schema.get("maxLength", math.inf):
            raise ToolArgumentError(f"{where} is longer than {schema['maxLength']} characters")
        if "enum" in schema and value not in schema["enum"]:
            raise ToolArgumentError(f"{where} must be one of {', '.join(schema['enum'])}")
    elif kind == "boolean":
        if not isinstance(value, bool):
            raise ToolArgumentError(f"{where} must be true or false, got {value!r}")
    elif kind == "array":
        if not isinstance(value, list):
            raise ToolArgumentError(f"{where} must be a list, got {value!r}")
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", math.inf):
            raise ToolArgumentError(
                f"{where} must hold {schema.get('minItems', 0)} to "
                f"{schema.get('maxItems', 'any number of')} items, got {len(value)}"
            )
        items = schema.get("items", {})
        value = [_check_value(tool, f"{key}[{i}]", items, v) for i, v in enumerate(value)]
    if kind in ("number", "integer"):
        low, high = schema.get("minimum", -math.inf), schema.get("maximum", math.inf)
        if not low <= value <= high:
            bounds = f"at least {low}" if high == math.inf else f"between {low} and {high}"
            raise ToolArgumentError(f"{where} must be {bounds}, got {value!r}")
    return value


def validate_arguments(tool: str, arguments: Any) -> dict[str, Any]:
    """Checks one call's arguments against its tool's schema and fills in the defaults.

    Raises `ToolArgumentError` naming the tool, the field and what it must be."""
    spec = TOOLS.get(tool)
    if spec is None:
        raise ToolArgumentError(f"no tool {tool!r}; the tools are {', '.join(TOOL_NAMES)}")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, Mapping):
        raise ToolArgumentError(f"{tool}: the arguments must be a JSON object, got {arguments!r}")
    unknown = sorted(set(arguments) - set(spec.properties))
    if unknown:
        allowed = ", ".join(spec.properties) or "none"
        raise ToolArgumentError(
            f"{tool}: unknown argument(s) {', '.join(unknown)}; its arguments are {allowed}"
        )
    missing = [k for k in spec.required if k not in arguments]
    if missing:
        raise ToolArgumentError(f"{tool}: missing required argument(s) {', '.join(missing)}")
    checked: dict[str, Any] = {}
    for key, schema in spec.properties.items():
        if key in arguments:
            checked[key] = _check_value(tool, key, schema, arguments[key])
        elif "default" in schema:
            checked[key] = schema["default"]
    return checked
