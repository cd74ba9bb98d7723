"""The OpenAI chat-completions wire format, as far as the capture proxy speaks it: request
validation with OpenAI-style errors, and the response and stream-chunk bodies.

Only what the proxy can honour is accepted; anything it cannot (several choices, audio, a
non-text content part) is refused with HTTP 400 naming the parameter, never silently ignored.
Fields the proxy has no use for and that do not change the answer (user, metadata,
parallel_tool_calls...) are accepted and ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchard.lm.chat import AssistantTurn, ToolCall
from orchard.rollout.engines.base import InvalidRequest, SamplingParams


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

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
class ChatCompletionRequest:
    """A validated chat-completions request."""

    model: str
    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...]
    parse_tool_calls: bool
    """False for ``tool_choice: "none"``: tool-call markup stays text."""
    stream: bool
    include_usage: bool
    max_tokens: int | None
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None


_DEFAULT_MAX_TOKENS_KEYS = ("max_completion_tokens", "max_tokens")
_UNSUPPORTED = {
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
}


def _number(body: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"{key} must be a number", key)
    if not low <= value <= high:
        raise bad_request(f"{key} must be between {low} and {high}, got {value}", key)
    return float(value)


def _integer(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{key} must be an integer", key)
    return value


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """Validate a decoded JSON body; raises `ApiError` (400) naming the bad parameter."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for key, why in _UNSUPPORTED.items():
        if body.get(key) not in (None, [], ["text"]):
            raise bad_request(why, key)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array", "messages")
    if not all(isinstance(m, dict) for m in messages):
        raise bad_request("each message must be an object", "messages")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    n = _integer(body, "n")
    if n not in (None, 1):
        raise bad_request("only n=1 is supported", "n")
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad_request("tools must be an array", "tools")
    tool_choice = body.get("tool_choice", "auto")
    if not (tool_choice in ("auto", "none", "required") or isinstance(tool_choice, dict)):
        raise bad_request(
            "tool_choice must be 'auto', 'none', 'required' or an object", "tool_choice"
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    max_tokens = None
    for key in _DEFAULT_MAX_TOKENS_KEYS:
        value = _integer(body, key)
        if value is not None:
            if value < 1:
                raise bad_request(f"{key} must be at least 1, got {value}", key)
            max_tokens = value
            break
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = tuple(stop)
    else:
        raise bad_request("stop must be a string or an array of at most 4 strings", "stop")
    if any(not s for s in stops):
        raise bad_request("stop strings must not be empty", "stop")
    return ChatCompletionRequest(
        model=model,
        messages=tuple(messages),
        tools=tuple(tools),
        parse_tool_calls=tool_choice != "none",
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        stop=stops,
        seed=_integer(body, "seed"),
    )


def sampling_params(
    request: ChatCompletionRequest, *, default_max_tokens: int, stop_token_ids: Sequence[int]
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


@dataclass(frozen=True, slots=True)
class Answer:
    """What the harness receives for one call."""

    completion_id: str
    created: int
    model: str
    content: str | None
    tool_calls: tuple[dict[str, Any], ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = list(self.tool_calls)
        return message

    def completion(self) -> dict[str, Any]:
        """The non-streaming `chat.completion` body."""
        return {
            "id": self.completion_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": self.message(),
                    "logprobs": None,
                    "finish_reason": self.finish_reason,
                }
            ],
            "usage": self.usage(),
        }

    def chunks(self, *, include_usage: bool) -> list[dict[str, Any]]:
        """The whole turn as `chat.completion.chunk` bodies: the role, the content, each tool
        call complete in one delta, the finish reason, and the usage when asked for."""

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            body: dict[str, Any] = {
                "id": self.completion_id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }
            if include_usage:
                body["usage"] = None
            return body

        out = [chunk({"role": "assistant", "content": ""})]
        if self.content:
            out.append(chunk({"content": self.content}))
        for index, call in enumerate(self.tool_calls):
            out.append(chunk({"tool_calls": [{"index": index, **call}]}))
        out.append(chunk({}, self.finish_reason))
        if include_usage:
            final = chunk({})
            final["choices"] = []
            final["usage"] = self.usage()
            out.append(final)
        return out


def answer_for(
    *,
    completion_id: str,
    model: str,
    turn: AssistantTurn,
    text: str,
    parse_tool_calls: bool,
    engine_finish: str,
    stop: Sequence[str],
    prompt_tokens: int,
    completion_tokens: int,
    call_ids: Sequence[str],
) -> Answer:
    """Build the answer from the parsed turn. A stop string ends the content before it, as
    OpenAI does; tool calls make the finish reason "tool_calls"."""
    calls: tuple[ToolCall, ...] = turn.tool_calls if parse_tool_calls else ()
    content = turn.content if calls else text
    if engine_finish == "stop" and stop:
        cut = min((i for s in stop if (i := content.find(s)) >= 0), default=-1)
        if cut >= 0:
            content = content[:cut]
    finish = "tool_calls" if calls and engine_finish == "stop" else engine_finish
    return Answer(
        completion_id=completion_id,
        created=int(time.time()),
        model=model,
        content=content if content or not calls else None,
        tool_calls=tuple(c.openai(i) for c, i in zip(calls, call_ids, strict=False)),
        finish_reason=finish,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )
