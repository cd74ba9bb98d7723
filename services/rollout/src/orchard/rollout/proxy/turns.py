"""What the capture proxy's API dialects share: the one internal form of a request (OpenAI-chat
messages, OpenAI function tools, sampling settings, the stream flag), the one form of an answered
turn, dialect-neutral errors, and the `Dialect` interface each wire format implements.

A dialect module (`openai_api`, `responses_api`, `anthropic_api`) turns a request body into a
`TurnRequest` and a `ModelTurn` into its JSON answer or its event stream; everything between
(rendering, sampling, parsing, recording) is the same code for all of them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from orchard.lm.chat import AssistantTurn, ToolCall
from orchard.rollout.engines.base import InvalidRequest, SamplingParams

ApiName = Literal["chat_completions", "responses", "messages"]
TurnFinish = Literal["stop", "length", "tool_calls"]


class ApiError(Exception):
    """An error a dialect answers in its own body shape; `status` is the HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """OpenAI's shape, ``{"error": {message, type, param, code}}`` (chat completions and
        the Responses API share it)."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """A validated request of any dialect, in the form the renderer takes."""

    api: ApiName
    model: str
    messages: tuple[Mapping[str, Any], ...]
    """OpenAI chat messages (system, user, assistant with `tool_calls`, tool)."""
    tools: tuple[Mapping[str, Any], ...]
    """OpenAI function tools: ``{"type": "function", "function": {name, description,
    parameters}}``."""
    parse_tool_calls: bool
    """False when the request forbids tool calls: tool-call markup stays text."""
    stream: bool
    max_tokens: int | None
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    ignored_tools: tuple[str, ...] = ()
    """Tools the request declared that the policy cannot be offered (hosted or free-form tools),
    by type or name; kept out of the prompt and noted in the call's record."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Settings only the dialect's answer needs (e.g. `include_usage`, echoed fields)."""


@dataclass(frozen=True, slots=True)
class ModelTurn:
    """One answered turn, before a dialect encodes it."""

    id: str
    created: int
    model: str
    content: str
    """The text the harness sees (stop string and tool-call markup removed)."""
    tool_calls: tuple[dict[str, Any], ...]
    """In OpenAI's `tool_calls` shape, each with the id the proxy handed out."""
    finish_reason: TurnFinish
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None
    """The stop string that ended the turn, if one did."""


def sampling_params(
    request: TurnRequest, *, default_max_tokens: int, stop_token_ids: Sequence[int]
) -> SamplingParams:
    """The engine's parameters for `request`."""
    try:
        return SamplingParams(
            max_tokens=request.max_tokens or default_max_tokens,
            temperature=request.temperature,
            top_p=request.top_p if request.top_p > 0 else 1e-6,
            stop=request.stop,
            stop_token_ids=tuple(stop_token_ids),
            seed=request.seed,
        )
    except InvalidRequest as e:
        raise bad_request(str(e)) from None


def model_turn(
    *,
    turn_id: str,
    model: str,
    parsed: AssistantTurn,
    text: str,
    parse_tool_calls: bool,
    engine_finish: str,
    stop: Sequence[str],
    prompt_tokens: int,
    completion_tokens: int,
    tool_call_id: Callable[[], str],
) -> ModelTurn:
    """The answer from the parsed sample. A stop string ends the content before it, as OpenAI
    and Anthropic do; tool calls make the finish reason "tool_calls"; `tool_call_id` names each
    call in the dialect's style."""
    calls: tuple[ToolCall, ...] = parsed.tool_calls if parse_tool_calls else ()
    content = parsed.content if calls else text
    matched: str | None = None
    if engine_finish == "stop" and stop:
        hits = [(i, s) for s in stop if (i := content.find(s)) >= 0]
        if hits:
            cut, matched = min(hits)
            content = content[:cut]
    finish: TurnFinish
    if calls and engine_finish == "stop":
        finish = "tool_calls"
    elif engine_finish == "length":
        finish = "length"
    else:
        finish = "stop"
    return ModelTurn(
        id=turn_id,
        created=int(time.time()),
        model=model,
        content=content,
        tool_calls=tuple(c.openai(tool_call_id()) for c in calls),
        finish_reason=finish,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        stop_sequence=matched,
    )


def sse(data: Mapping[str, Any], event: str | None = None) -> bytes:
    """One server-sent event."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


SSE_COMMENT = b": keep-alive\n\n"


class TurnStream(Protocol):
    """The event stream of one streamed call, written in up to three parts."""

    def opening(self) -> bytes:
        """What goes out as soon as the stream opens, before the turn is known."""
        ...

    def keepalive(self) -> bytes:
        """Sent every keep-alive interval while the engine samples."""
        ...

    def turn(self, turn: ModelTurn) -> bytes:
        """The whole turn and the stream's end."""
        ...

    def error(self, error: ApiError) -> bytes:
        """An error once the stream is open (HTTP 200 already sent)."""
        ...


class Dialect(Protocol):
    """One wire format the proxy speaks."""

    api: ApiName

    def parse(self, body: Any) -> TurnRequest:
        """Validate a decoded JSON body; raises `ApiError` (400) naming the bad field."""
        ...

    def error_body(self, error: ApiError) -> dict[str, Any]:
        """The dialect's error body."""
        ...

    def new_turn_id(self) -> str: ...

    def new_tool_call_id(self) -> str: ...

    def answer(self, turn: ModelTurn, request: TurnRequest) -> dict[str, Any]:
        """The non-streaming answer body."""
        ...

    def stream(
        self, request: TurnRequest, *, turn_id: str, model: str, prompt_tokens: int
    ) -> TurnStream:
        """The encoder of one streamed answer (its id, model and prompt length are known
        before sampling ends)."""
        ...


# -- shared request validation ---------------------------------------------------------------


def number(body: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"{key} must be a number", key)
    if not low <= value <= high:
        raise bad_request(f"{key} must be between {low} and {high}, got {value}", key)
    return float(value)


def integer(body: Mapping[str, Any], key: str, *, low: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{key} must be an integer", key)
    if low is not None and value < low:
        raise bad_request(f"{key} must be at least {low}, got {value}", key)
    return value


def boolean(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{key} must be a boolean", key)
    return value


def string(body: Mapping[str, Any], key: str, default: str = "") -> str:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad_request(f"{key} must be a string", key)
    return value


def function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    """An OpenAI function tool from its parts, checked."""
    param = where.split("[", maxsplit=1)[0]
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where} needs a name", param)
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{where}: the parameters schema must be an object", param)
    function: dict[str, Any] = {"name": name}
    if isinstance(description, str) and description:
        function["description"] = description
    function["parameters"] = parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def arguments_object(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as an object (the parser guarantees JSON object text)."""
    value = json.loads(arguments) if arguments.strip() else {}
    return value if isinstance(value, dict) else {}
