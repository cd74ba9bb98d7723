"""The OpenAI Responses API (``POST /v1/responses``), as far as the capture proxy speaks it: the
request's input items turned into chat messages, and the `response` object and its event stream.

The proxy keeps no responses (every request is answered as if ``store: false``): a request
carries its whole conversation, and ``previous_response_id`` or ``background`` are refused.

Input items:

- ``message`` (also without ``type``, the short form ``{role, content}``), content a string or
  ``input_text`` / ``output_text`` / ``refusal`` parts; images and files are refused (400);
- ``function_call`` joins the assistant message before it (one assistant turn: text, then its
  calls, as the policy sampled it); ``function_call_output`` becomes a tool message, and its
  ``call_id`` must name a ``function_call`` earlier in the input;
- ``reasoning`` items are dropped: the policy never emits one, so they hold nothing it sampled;
- any other item type is refused (400) naming it.

Tools: ``type: function`` (flat ``name``, ``description``, ``parameters``) are offered to the
policy. Hosted and free-form tools (``web_search``, ``file_search``, ``custom``, ``local_shell``,
``mcp``...) have no schema the chat template can show; they are left out of the prompt and
listed in the call's record (``ignored_tools``), so a harness that declares them still works.
``tool_choice: "none"`` keeps tool-call markup as text; other choices are accepted.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from orchard.rollout.proxy.turns import (
    SSE_COMMENT,
    ApiError,
    ApiName,
    ModelTurn,
    TurnRequest,
    bad_request,
    boolean,
    function_tool,
    integer,
    number,
    sse,
    string,
)

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _part_text(part: Any, where: str) -> str:
    if not isinstance(part, dict):
        raise bad_request(f"{where} must be an object", "input")
    kind = part.get("type")
    if kind in _TEXT_PARTS:
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{where}.text must be a string", "input")
        return text
    if kind == "refusal":
        return str(part.get("refusal", ""))
    raise bad_request(f"{where}: only text content is supported, got {kind!r}", "input")


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(p, f"{where}[{i}]") for i, p in enumerate(content))
    raise bad_request(f"{where} must be a string or an array of content parts", "input")


def input_messages(items: Any, instructions: str) -> list[dict[str, Any]]:
    """The chat messages for `instructions` and the input items (see the module's notes)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty array of items", "input")
    calls: set[str] = set()
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(
                    f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", "input"
                )
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{where}.call_id must be a non-empty string", "input")
            if not isinstance(name, str) or not name:
                raise bad_request(f"{where}.name must be a non-empty string", "input")
            arguments = item.get("arguments", "")
            if not isinstance(arguments, str):
                raise bad_request(f"{where}.arguments must be a string of JSON", "input")
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments or "{}"},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            calls.add(call_id)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in calls:
                raise bad_request(
                    f"{where}: no function_call with call_id {call_id!r} precedes this output",
                    "input",
                )
            output = _text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported", "input")
    if not messages:
        raise bad_request("input holds no message", "input")
    return messages


def _tools(tools: Any) -> tuple[list[dict[str, Any]], list[str]]:
    if tools is None:
        return [], []
    if not isinstance(tools, list):
        raise bad_request("tools must be an array", "tools")
    offered, ignored = [], []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad_request(f"tools[{index}] must be an object", "tools")
        kind = tool.get("type")
        if kind == "function":
            offered.append(
                function_tool(
                    tool.get("name"),
                    tool.get("description"),
                    tool.get("parameters"),
                    f"tools[{index}]",
                )
            )
        elif isinstance(kind, str) and kind:
            name = tool.get("name")
            ignored.append(f"{kind}:{name}" if isinstance(name, str) and name else kind)
        else:
            raise bad_request(f"tools[{index}].type must be a string", "tools")
    return offered, ignored


def parse_responses_request(body: Any) -> TurnRequest:
    """Validate a decoded JSON body; raises `ApiError` (400) naming the bad parameter."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if body.get("previous_response_id"):
        raise bad_request(
            "the proxy keeps no responses: send the whole conversation as input "
            "(store: false) instead of previous_response_id",
            "previous_response_id",
        )
    if body.get("conversation"):
        raise bad_request("conversations are not kept: send the whole input", "conversation")
    if boolean(body, "background"):
        raise bad_request("background responses are not supported", "background")
    instructions = string(body, "instructions")
    messages = input_messages(body.get("input"), instructions)
    tools, ignored = _tools(body.get("tools"))
    tool_choice = body.get("tool_choice", "auto")
    if not (tool_choice in ("auto", "none", "required") or isinstance(tool_choice, dict)):
        raise bad_request(
            "tool_choice must be 'auto', 'none', 'required' or an object", "tool_choice"
        )
    return TurnRequest(
        api="responses",
        model=string(body, "model"),
        messages=tuple(messages),
        tools=tuple(tools),
        parse_tool_calls=tool_choice != "none",
        stream=boolean(body, "stream"),
        max_tokens=integer(body, "max_output_tokens", low=1),
        temperature=number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0),
        stop=(),
        seed=integer(body, "seed"),
        ignored_tools=tuple(ignored),
        options={
            "instructions": instructions or None,
            "tool_choice": tool_choice,
            "tools": body.get("tools") or [],
            "parallel_tool_calls": boolean(body, "parallel_tool_calls", True),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "store": boolean(body, "store", False),
            "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        },
    )


def _item_ids(turn: ModelTurn) -> tuple[str, list[str]]:
    """Ids of the output items, derived from the turn's so both encodings agree."""
    suffix = turn.id.removeprefix("resp_")
    return f"msg_{suffix}", [f"fc_{suffix}_{i}" for i in range(len(turn.tool_calls))]


def _message_item(turn: ModelTurn, status: str) -> dict[str, Any]:
    message_id, _ = _item_ids(turn)
    part = {"type": "output_text", "text": turn.content, "annotations": [], "logprobs": []}
    return {
        "id": message_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def _call_item(turn: ModelTurn, index: int, status: str, arguments: str) -> dict[str, Any]:
    _, call_ids = _item_ids(turn)
    call = turn.tool_calls[index]
    return {
        "id": call_ids[index],
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": arguments,
    }


def _has_message(turn: ModelTurn) -> bool:
    return bool(turn.content) or not turn.tool_calls


def _output(turn: ModelTurn) -> list[dict[str, Any]]:
    status = "incomplete" if turn.finish_reason == "length" else "completed"
    out = [_message_item(turn, status)] if _has_message(turn) else []
    for index, call in enumerate(turn.tool_calls):
        out.append(_call_item(turn, index, "completed", call["function"]["arguments"]))
    return out


def _usage(turn: ModelTurn) -> dict[str, Any]:
    return {
        "input_tokens": turn.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": turn.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": turn.prompt_tokens + turn.completion_tokens,
    }


def _response(
    request: TurnRequest,
    *,
    response_id: str,
    created: int,
    model: str,
    turn: ModelTurn | None,
) -> dict[str, Any]:
    """The `response` object: in progress (`turn` None) or finished."""
    options: Mapping[str, Any] = request.options
    status = "in_progress"
    incomplete = None
    if turn is not None:
        status = "incomplete" if turn.finish_reason == "length" else "completed"
        if turn.finish_reason == "length":
            incomplete = {"reason": "max_output_tokens"}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": options.get("instructions"),
        "max_output_tokens": options.get("max_output_tokens"),
        "model": model,
        "output": _output(turn) if turn is not None else [],
        "parallel_tool_calls": options.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": options.get("store", False),
        "temperature": options.get("temperature"),
        "text": {"format": {"type": "text"}},
        "tool_choice": options.get("tool_choice", "auto"),
        "tools": list(options.get("tools", [])),
        "top_p": options.get("top_p"),
        "truncation": "disabled",
        "usage": _usage(turn) if turn is not None else None,
        "metadata": dict(options.get("metadata", {})),
    }


class _ResponseEventStream:
    """The Responses API's typed events, numbered by `sequence_number`."""

    def __init__(self, request: TurnRequest, response_id: str, model: str) -> None:
        self.request = request
        self.response_id = response_id
        self.created = int(time.time())
        self.model = model
        self.sequence = 0

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(data, kind)

    def _snapshot(self, turn: ModelTurn | None) -> dict[str, Any]:
        return _response(
            self.request,
            response_id=self.response_id,
            created=self.created,
            model=self.model,
            turn=turn,
        )

    def opening(self) -> bytes:
        snapshot = self._snapshot(None)
        return self._event("response.created", response=snapshot) + self._event(
            "response.in_progress", response=snapshot
        )

    def keepalive(self) -> bytes:
        return SSE_COMMENT

    def turn(self, turn: ModelTurn) -> bytes:
        out: list[bytes] = []
        index = 0
        if _has_message(turn):
            item = _message_item(turn, "in_progress")
            item_id, part = item["id"], dict(item["content"][0])
            item["content"] = []
            place = {"item_id": item_id, "output_index": index, "content_index": 0}
            out.append(self._event("response.output_item.added", output_index=index, item=item))
            out.append(
                self._event("response.content_part.added", **place, part={**part, "text": ""})
            )
            if turn.content:
                out.append(
                    self._event(
                        "response.output_text.delta", **place, delta=turn.content, logprobs=[]
                    )
                )
            out.append(
                self._event("response.output_text.done", **place, text=turn.content, logprobs=[])
            )
            out.append(self._event("response.content_part.done", **place, part=part))
            done = _message_item(
                turn, "incomplete" if turn.finish_reason == "length" else "completed"
            )
            out.append(self._event("response.output_item.done", output_index=index, item=done))
            index += 1
        for k, call in enumerate(turn.tool_calls):
            arguments = call["function"]["arguments"]
            added = _call_item(turn, k, "in_progress", "")
            place = {"item_id": added["id"], "output_index": index}
            out.append(self._event("response.output_item.added", output_index=index, item=added))
            out.append(
                self._event("response.function_call_arguments.delta", **place, delta=arguments)
            )
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    **place,
                    name=call["function"]["name"],
                    arguments=arguments,
                )
            )
            done = _call_item(turn, k, "completed", arguments)
            out.append(self._event("response.output_item.done", output_index=index, item=done))
            index += 1
        final = "response.incomplete" if turn.finish_reason == "length" else "response.completed"
        out.append(self._event(final, response=self._snapshot(turn)))
        return b"".join(out)

    def error(self, error: ApiError) -> bytes:
        failed = self._snapshot(None)
        failed["status"] = "failed"
        failed["error"] = {"code": error.code or error.type, "message": error.message}
        return self._event("response.failed", response=failed)


class ResponsesDialect:
    """``POST /v1/responses``."""

    api: ApiName = "responses"

    def parse(self, body: Any) -> TurnRequest:
        return parse_responses_request(body)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error.body()

    def new_turn_id(self) -> str:
        return f"resp_{uuid.uuid4().hex}"

    def new_tool_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def answer(self, turn: ModelTurn, request: TurnRequest) -> dict[str, Any]:
        """The non-streaming `response` object."""
        return _response(
            request, response_id=turn.id, created=turn.created, model=turn.model, turn=turn
        )

    def stream(
        self, request: TurnRequest, *, turn_id: str, model: str, prompt_tokens: int
    ) -> _ResponseEventStream:
        return _ResponseEventStream(request, turn_id, model)
