"""The chat format: a ChatML template with tool calls, the renderer from OpenAI-style messages to
prompt token ids, and the parser from sampled text back to content and OpenAI tool calls.

A turn looks like ``<|im_start|>role\\ncontent<|im_end|>\\n``. Tools are declared in the system
turn inside ``<tools></tools>``, one JSON schema a line. The assistant calls a tool by writing
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; a tool's result comes back as
a user turn wrapped in ``<tool_response></tool_response>``. This is the layout Qwen2-family and
SmolLM2 instruct models were tuned on, so the same renderer serves the small model built here
and real pre-trained ones.

An assistant message is rendered exactly the way `format_assistant_text` writes it, and the
parser reads that form back, so a turn the model sampled renders again as the same text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOLS_OPEN = "<tools>"
TOOLS_CLOSE = "</tools>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

# Written for this project; Jinja so that any Hugging Face consumer of the tokenizer folder
# (apply_chat_template, vLLM's own server) renders exactly what the renderer below renders.
_CHAT_TEMPLATE = """\
{%- set first_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
<|im_start|>system
{% if first_system %}{{ messages[0].content }}

{% endif -%}
You can call tools. Their JSON schemas, one a line:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call a tool, write a JSON object with its name and arguments between tags:
<tool_call>
{"name": "tool name", "arguments": {"argument": "value"}}
</tool_call><|im_end|>
{% elif first_system -%}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if loop.first and first_system -%}
{%- elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' -%}
<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls -%}
{%- if not loop.first or message.content %}{{ '\\n' }}{% endif -%}
<tool_call>
{"name": {{ call.name | tojson }}, "arguments": {{ call.arguments }}}
</tool_call>
{%- endfor -%}
<|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""


def chat_template() -> str:
    """The Jinja chat template, as stored in the tokenizer folder (`tokenizer.chat_template`)."""
    return _CHAT_TEMPLATE


class ChatFormatError(ValueError):
    """A message or tool declaration that cannot be rendered; the message says which and why."""


class ChatImageError(ChatFormatError):
    """An image part given to a renderer that reads text only (a text model's)."""


IMAGE_PART = "image_url"
"""The OpenAI content-part type of an image:
``{"type": "image_url", "image_url": {"url": ...}}``."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed tool call; `arguments` is the JSON text of the arguments object."""

    name: str
    arguments: str

    def openai(self, call_id: str) -> dict[str, Any]:
        """The call in OpenAI's `tool_calls` shape."""
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class AssistantTurn:
    """Sampled text split into what the harness sees: plain content and tool calls."""

    content: str
    tool_calls: tuple[ToolCall, ...]
    unparsed_tool_calls: int = 0
    """`<tool_call>` blocks whose body was not a valid call; they stay in `content`."""


def image_part_url(part: Mapping[str, Any]) -> str:
    """The URL of an ``image_url`` content part (``{"url": ...}``, or the URL itself)."""
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, Mapping) else image
    return url if isinstance(url, str) else ""


def _content(index: int, content: Any, *, images: bool) -> str | list[dict[str, str]]:
    """A message's content as the templates read it: text, or (with `images`, when it holds
    an image) a list of ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict[str, str]] = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if kind == "text" and isinstance(part, Mapping):
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == IMAGE_PART and isinstance(part, Mapping) and images:
                if not image_part_url(part):
                    raise ChatFormatError(f"messages[{index}].content: an image part has no url")
                parts.append({"type": "image"})
            elif kind == IMAGE_PART:
                raise ChatImageError(
                    f"messages[{index}].content: only text parts are supported, got {kind!r} "
                    "(this model reads text; an image needs a vision-language model)"
                )
            else:
                raise ChatFormatError(
                    f"messages[{index}].content: only text parts are supported, got {kind!r}"
                )
        if any(p["type"] == "image" for p in parts):
            return parts
        return "".join(p["text"] for p in parts)
    raise ChatFormatError(
        f"messages[{index}].content must be a string or a list of text parts, "
        f"got {type(content).__name__}"
    )


def content_text(content: Any, *, image: str = "[image]") -> str:
    """A message's content as plain text for people (logs, a turn's `input_text`): text parts
    joined, each image part shown as `image` (never its data)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                pieces.append(str(part.get("text", "")))
            elif isinstance(part, Mapping) and part.get("type") == IMAGE_PART:
                pieces.append(image)
        return "".join(pieces)
    return str(content)


def _arguments_text(where: str, arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ChatFormatError(f"{where}.arguments is not valid JSON: {e}") from None
        if not isinstance(parsed, dict):
            raise ChatFormatError(f"{where}.arguments must be a JSON object")
        return arguments if arguments.strip() else "{}"
    if isinstance(arguments, Mapping):
        return json.dumps(dict(arguments), ensure_ascii=False)
    raise ChatFormatError(f"{where}.arguments must be a JSON object or its text")


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], *, images: bool = False
) -> list[dict[str, Any]]:
    """OpenAI-style messages in the plain shape the template reads, checked.

    Content parts are joined, `tool_calls` become `{name, arguments}` with the arguments as
    JSON text, and anything that cannot be rendered raises `ChatFormatError` naming the field.
    An image part raises `ChatImageError`, unless `images` (a vision-language model's
    renderer): then a content that holds one stays a list of text and ``{"type": "image"}``
    parts, in order.
    """
    if not messages:
        raise ChatFormatError("messages must hold at least one message")
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatFormatError(f"messages[{index}] must be an object")
        role = message.get("role")
        if role not in _ROLES:
            raise ChatFormatError(
                f"messages[{index}].role must be one of {sorted(_ROLES)}, got {role!r}"
            )
        if role == "developer":
            role = "system"
        calls: list[dict[str, str]] = []
        for k, call in enumerate(message.get("tool_calls") or ()):
            where = f"messages[{index}].tool_calls[{k}]"
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise ChatFormatError(f"{where} needs function.name")
            calls.append(
                {
                    "name": function["name"],
                    "arguments": _arguments_text(f"{where}.function", function.get("arguments")),
                }
            )
        if calls and role != "assistant":
            raise ChatFormatError(f"messages[{index}]: only assistant messages carry tool_calls")
        out.append(
            {
                "role": role,
                "content": _content(index, message.get("content"), images=images),
                "tool_calls": calls,
            }
        )
    return out


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI `tools` entries checked and reduced to their function schemas."""
    out: list[dict[str, Any]] = []
    for index, tool in enumerate(tools or ()):
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise ChatFormatError(f"tools[{index}] must be an object of type 'function'")
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatFormatError(f"tools[{index}].function needs a name")
        schema: dict[str, Any] = {"name": function["name"]}
        if function.get("description"):
            schema["description"] = function["description"]
        schema["parameters"] = function.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": schema})
    return out


def format_assistant_text(content: str, tool_calls: Sequence[ToolCall]) -> str:
    """The text of an assistant turn as the template renders it (without `<|im_end|>`)."""
    pieces = [content] if content else []
    for call in tool_calls:
        name = json.dumps(call.name, ensure_ascii=False)
        body = f'{{"name": {name}, "arguments": {call.arguments}}}'
        pieces.append(f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}")
    return "\n".join(pieces)


_TOOL_CALL_BLOCK = re.compile(
    re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL
)


def _calls_in(body: str) -> list[ToolCall] | None:
    """The calls in one `<tool_call>` body: a JSON object, or a list of them; None if invalid."""
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


def parse_assistant_text(text: str) -> AssistantTurn:
    """Split sampled text into content and tool calls.

    Every complete ``<tool_call>…</tool_call>`` block whose body is a call object (or a list of
    them, as SmolLM2 writes) becomes a tool call; a block that does not parse stays in the content
    and is counted in `unparsed_tool_calls`, as does an unterminated one (sampling was cut off).
    """
    calls: list[ToolCall] = []
    kept: list[str] = []
    unparsed = 0
    position = 0
    for match in _TOOL_CALL_BLOCK.finditer(text):
        kept.append(text[position : match.start()])
        found = _calls_in(match.group(1).strip())
        if found is None:
            unparsed += 1
            kept.append(match.group(0))
        else:
            calls.extend(found)
        position = match.end()
    rest = text[position:]
    if TOOL_CALL_OPEN in rest:
        unparsed += 1
    kept.append(rest)
    content = "".join(kept).strip() if calls else "".join(kept)
    return AssistantTurn(content=content, tool_calls=tuple(calls), unparsed_tool_calls=unparsed)


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A prompt ready for an engine: its token ids, and the text they were encoded from."""

    token_ids: tuple[int, ...]
    text: str


class ChatRenderer:
    """Renders OpenAI-style messages and tools into prompt token ids with one tokenizer.

    The template is the one given, else the tokenizer's own (`tokenizer.chat_template`), else
    this module's. Special tokens in the template (``<|im_start|>``…) encode to their own ids;
    the text of messages is encoded as text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, template: str | None = None) -> None:
        self._tokenizer = tokenizer
        own = getattr(tokenizer, "chat_template", None)
        self.template = template or (own if isinstance(own, str) and own else _CHAT_TEMPLATE)
        self.stop_token_ids = self._stop_ids()

    def _stop_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        unknown = getattr(self._tokenizer, "unk_token_id", None)
        for token in (IM_END, END_OF_TEXT):
            token_id = self._tokenizer.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id >= 0 and token_id != unknown:
                ids.append(token_id)
        eos = getattr(self._tokenizer, "eos_token_id", None)
        if isinstance(eos, int) and eos not in ids:
            ids.append(eos)
        return tuple(ids)

    def _normalize(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The messages as the template reads them (a text model's: image parts refused)."""
        return normalize_messages(messages)

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt as text; raises `ChatFormatError` for messages it cannot render."""
        schemas: Any = normalize_tools(tools) or None
        text = self._tokenizer.apply_chat_template(
            self._normalize(messages),
            tools=schemas,
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        if not isinstance(text, str):
            raise TypeError(f"the chat template rendered {type(text).__name__}, not text")
        return text

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> RenderedPrompt:
        """The prompt token ids (and text) for `messages` and `tools`."""
        text = self.render_text(messages, tools, add_generation_prompt=add_generation_prompt)
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        return RenderedPrompt(token_ids=tuple(int(i) for i in ids), text=text)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Sampled token ids as text, the tool markup kept and the stop token dropped."""
        ids = list(token_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return str(self._tokenizer.decode(ids, skip_special_tokens=False))

    def parse(self, token_ids: Sequence[int]) -> tuple[str, AssistantTurn]:
        """Decode sampled token ids and split them into content and tool calls."""
        text = self.decode(token_ids)
        return text, parse_assistant_text(text)
