"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``), as far
as the capture proxy speaks it: messages of content blocks turned into chat messages, and the
`message` object and its event stream.

- ``system``: a string or text blocks (``cache_control`` and the like are ignored), rendered as
  the system message; ``system`` messages among the messages (Claude Code sends its environment
  so) become system messages where they stand.
- User content: ``text`` blocks, and ``tool_result`` blocks, each a tool message (its content a
  string or text blocks); ``tool_use_id`` must name a ``tool_use`` of an earlier assistant
  message. ``is_error`` is kept on the tool message; the prompt shows the result's text as the
  tool wrote it. Blocks keep their order: text after tool results becomes a user message after
  the tool messages.
- Assistant content: ``text``, then ``tool_use`` blocks (one assistant turn with tool calls, as
  the policy sampled it). ``thinking`` and ``redacted_thinking`` blocks are dropped: the policy
  never emits them, so they hold nothing it sampled.
- Images, documents and server-tool blocks are refused (400) naming the block type.
- Tools with an ``input_schema`` (``type`` absent or ``custom``) are offered to the policy;
  Anthropic-defined tools (``bash_…``, ``text_editor_…``, ``web_search_…``) carry no schema the
  chat template can show: they are left out of the prompt and listed in the call's record.
- ``tool_choice`` ``none`` keeps tool-call markup as text; ``auto``, ``any`` and ``tool`` are
  accepted. ``thinking``, ``metadata``, ``top_k``, ``service_tier`` and the ``anthropic-beta`` /
  ``anthropic-version`` headers are tolerated and change nothing, as are ``context_management``
  and ``output_config``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from orchard.rollout.proxy.turns import (
    ApiError,
    ApiName,
    ModelTurn,
    TurnRequest,
    arguments_object,
    bad_request,
    boolean,
    function_tool,
    integer,
    number,
    sse,
    string,
)

_STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def error_body(error: ApiError) -> dict[str, Any]:
    """Anthropic's error shape: ``{"type": "error", "error": {type, message}}``."""
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else error.type)
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def _text_blocks(content: Any, where: str, field: str) -> str:
    """A string, or text blocks joined (the renderer joins OpenAI text parts the same way)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of text blocks", field)
    texts = []
    for index, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(
                f"{where}[{index}]: only text blocks are supported here, got {kind!r}", field
            )
        text = block.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{where}[{index}].text must be a string", field)
        texts.append(text)
    return "".join(texts)


def _user_messages(content: Any, where: str, calls: set[str]) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list) or not content:
        raise bad_request(f"{where} must be a string or a non-empty array of blocks", "messages")
    out: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        at = f"{where}[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text = block.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{at}.text must be a string", "messages")
            last = out[-1] if out else None
            if last is not None and last["role"] == "user":
                last["content"].append({"type": "text", "text": text})
            else:
                out.append({"role": "user", "content": [{"type": "text", "text": text}]})
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if call_id not in calls:
                raise bad_request(
                    f"{at}: tool_use_id {call_id!r} names no tool_use of an earlier "
                    "assistant message",
                    "messages",
                )
            result = block.get("content", "")
            message: dict[str, Any] = {
                "role": "tool",
                "tool_call_id": call_id,
                "content": _text_blocks(result, f"{at}.content", "messages"),
            }
            if boolean(block, "is_error"):
                message["is_error"] = True
            out.append(message)
        elif kind is None:
            raise bad_request(f"{at} must be a content block with a type", "messages")
        else:
            raise bad_request(
                f"{at}: {kind!r} blocks are not supported in user messages", "messages"
            )
    return out


def _assistant_message(content: Any, where: str, calls: set[str]) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of blocks", "messages")
    texts: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        at = f"{where}[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text = block.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{at}.text must be a string", "messages")
            texts.append(text)
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{at}.id must be a non-empty string", "messages")
            if not isinstance(name, str) or not name:
                raise bad_request(f"{at}.name must be a non-empty string", "messages")
            if not isinstance(arguments, dict):
                raise bad_request(f"{at}.input must be an object", "messages")
            tool_calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    # As the proxy's parser writes arguments, so a sampled call renders again
                    # as the same text.
                    "function": {
                        "name": name,
                        "arguments": json.dumps(arguments, ensure_ascii=False),
                    },
                }
            )
            calls.add(call_id)
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise bad_request(
                f"{at}: {kind!r} blocks are not supported in assistant messages", "messages"
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def conversation(system: Any, messages: Any) -> list[dict[str, Any]]:
    """The chat messages for a `system` and Anthropic `messages` (see the module's notes)."""
    out: list[dict[str, Any]] = []
    if system is not None:
        text = _text_blocks(system, "system", "system")
        if text:
            out.append({"role": "system", "content": text})
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array", "messages")
    calls: set[str] = set()
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object", "messages")
        role = message.get("role")
        if role == "user":
            out.extend(_user_messages(message.get("content"), f"{where}.content", calls))
        elif role == "assistant":
            out.append(_assistant_message(message.get("content"), f"{where}.content", calls))
        elif role == "system":
            text = _text_blocks(message.get("content"), f"{where}.content", "messages")
            out.append({"role": "system", "content": text})
        else:
            raise bad_request(
                f"{where}.role must be 'user', 'assistant' or 'system', got {role!r}", "messages"
            )
    return out


def _tools(tools: Any) -> tuple[list[dict[str, Any]], list[str]]:
    if tools is None:
        return [], []
    if not isinstance(tools, list):
        raise bad_request("tools must be an array", "tools")
    offered, ignored = [], []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad_request(f"tools[{index}] must be an object", "tools")
        kind = tool.get("type", "custom")
        if kind in ("custom", None):
            if not isinstance(tool.get("input_schema"), dict):
                raise bad_request(f"tools[{index}].input_schema must be an object", "tools")
            offered.append(
                function_tool(
                    tool.get("name"),
                    tool.get("description"),
                    tool["input_schema"],
                    f"tools[{index}]",
                )
            )
        else:
            ignored.append(f"{kind}:{tool.get('name', '')}")
    return offered, ignored


def parse_messages_request(body: Any, *, counting: bool = False) -> TurnRequest:
    """Validate a decoded JSON body; raises `ApiError` (400). `counting`: a count_tokens body
    (no `max_tokens`)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    max_tokens = integer(body, "max_tokens", low=1)
    if max_tokens is None and not counting:
        raise bad_request("max_tokens is required", "max_tokens")
    messages = conversation(body.get("system"), body.get("messages"))
    tools, ignored = _tools(body.get("tools"))
    choice = body.get("tool_choice") or {"type": "auto"}
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise bad_request(
            "tool_choice must be an object of type 'auto', 'any', 'tool' or 'none'", "tool_choice"
        )
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop_sequences must be an array of non-empty strings", "stop_sequences")
    return TurnRequest(
        api="messages",
        model=string(body, "model"),
        messages=tuple(messages),
        tools=tuple(tools),
        parse_tool_calls=choice["type"] != "none",
        stream=boolean(body, "stream"),
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 1.0, 0.0, 1.0),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0),
        stop=tuple(stops),
        seed=None,
        ignored_tools=tuple(ignored),
    )


def _stop_reason(turn: ModelTurn) -> str:
    return "stop_sequence" if turn.stop_sequence is not None else _STOP_REASONS[turn.finish_reason]


def _blocks(turn: ModelTurn) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if turn.content or not turn.tool_calls:
        blocks.append({"type": "text", "text": turn.content})
    for call in turn.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": arguments_object(call["function"]["arguments"]),
            }
        )
    return blocks


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


_PING = sse({"type": "ping"}, "ping")


class _MessageEventStream:
    """message_start at once, pings while sampling, then the content blocks, message_delta
    (stop reason, usage) and message_stop."""

    def __init__(self, turn_id: str, model: str, prompt_tokens: int) -> None:
        self.turn_id = turn_id
        self.model = model
        self.prompt_tokens = prompt_tokens

    def opening(self) -> bytes:
        message: dict[str, Any] = {
            "id": self.turn_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(self.prompt_tokens, 0),
        }
        return sse({"type": "message_start", "message": message}, "message_start") + _PING

    def keepalive(self) -> bytes:
        return _PING

    def turn(self, turn: ModelTurn) -> bytes:
        # Each block whole in one delta: the turn is parsed once, after sampling.
        pieces: list[tuple[dict[str, Any], dict[str, Any]]] = []
        if turn.content or not turn.tool_calls:
            pieces.append(
                ({"type": "text", "text": ""}, {"type": "text_delta", "text": turn.content})
            )
        for call in turn.tool_calls:
            start = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"]}
            delta = {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}
            pieces.append(({**start, "input": {}}, delta))
        out: list[bytes] = []
        for index, (start, delta) in enumerate(pieces):
            out.append(
                sse(
                    {"type": "content_block_start", "index": index, "content_block": start},
                    "content_block_start",
                )
            )
            out.append(
                sse(
                    {"type": "content_block_delta", "index": index, "delta": delta},
                    "content_block_delta",
                )
            )
            out.append(sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
        out.append(
            sse(
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": _stop_reason(turn),
                        "stop_sequence": turn.stop_sequence,
                    },
                    "usage": {"output_tokens": turn.completion_tokens},
                },
                "message_delta",
            )
        )
        out.append(sse({"type": "message_stop"}, "message_stop"))
        return b"".join(out)

    def error(self, error: ApiError) -> bytes:
        return sse(error_body(error), "error")


class MessagesDialect:
    """``POST /v1/messages``."""

    api: ApiName = "messages"

    def parse(self, body: Any) -> TurnRequest:
        return parse_messages_request(body)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error_body(error)

    def new_turn_id(self) -> str:
        return f"msg_{uuid.uuid4().hex}"

    def new_tool_call_id(self) -> str:
        return f"toolu_{uuid.uuid4().hex[:24]}"

    def answer(self, turn: ModelTurn, request: TurnRequest) -> dict[str, Any]:
        """The non-streaming `message` object."""
        return {
            "id": turn.id,
            "type": "message",
            "role": "assistant",
            "model": turn.model,
            "content": _blocks(turn),
            "stop_reason": _stop_reason(turn),
            "stop_sequence": turn.stop_sequence,
            "usage": _usage(turn.prompt_tokens, turn.completion_tokens),
        }

    def stream(
        self, request: TurnRequest, *, turn_id: str, model: str, prompt_tokens: int
    ) -> _MessageEventStream:
        return _MessageEventStream(turn_id, model, prompt_tokens)
