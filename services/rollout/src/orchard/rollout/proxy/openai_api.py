"""The OpenAI chat-completions wire format, as far as the capture proxy speaks it: request
validation with OpenAI-style errors, and the response and stream-chunk bodies.

Only what the proxy can honour is accepted; anything it cannot (several choices, audio, a
non-text content part) is refused with HTTP 400 naming the parameter, never silently ignored.
Fields the proxy has no use for and that do not change the answer (user, metadata,
parallel_tool_calls...) are accepted and ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import uuid
from typing import Any

from orchard.rollout.proxy.turns import (
    SSE_COMMENT,
    ApiError,
    ApiName,
    ModelTurn,
    TurnRequest,
    bad_request,
    boolean,
    integer,
    number,
    sse,
)

__all__ = ["ApiError", "ChatCompletionsDialect", "bad_request", "parse_chat_request"]

_MAX_TOKENS_KEYS = ("max_completion_tokens", "max_tokens")
_UNSUPPORTED = {
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
}


def parse_chat_request(body: Any) -> TurnRequest:
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
    if integer(body, "n") not in (None, 1):
        raise bad_request("only n=1 is supported", "n")
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad_request("tools must be an array", "tools")
    tool_choice = body.get("tool_choice", "auto")
    if not (tool_choice in ("auto", "none", "required") or isinstance(tool_choice, dict)):
        raise bad_request(
            "tool_choice must be 'auto', 'none', 'required' or an object", "tool_choice"
        )
    stream = boolean(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    max_tokens = None
    for key in _MAX_TOKENS_KEYS:
        max_tokens = integer(body, key, low=1)
        if max_tokens is not None:
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
    return TurnRequest(
        api="chat_completions",
        model=model,
        messages=tuple(messages),
        tools=tuple(tools),
        parse_tool_calls=tool_choice != "none",
        stream=stream,
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0),
        stop=stops,
        seed=integer(body, "seed"),
        options={"include_usage": bool(options.get("include_usage", False))},
    )


def _usage(turn: ModelTurn) -> dict[str, int]:
    return {
        "prompt_tokens": turn.prompt_tokens,
        "completion_tokens": turn.completion_tokens,
        "total_tokens": turn.prompt_tokens + turn.completion_tokens,
    }


def _content(turn: ModelTurn) -> str | None:
    return turn.content if turn.content or not turn.tool_calls else None


class _ChunkStream:
    """`chat.completion.chunk` events: the role, the content, each tool call complete in one
    delta, the finish reason, the usage when asked for, then ``[DONE]``."""

    def __init__(self, request: TurnRequest) -> None:
        self.include_usage = bool(request.options.get("include_usage"))

    def opening(self) -> bytes:
        return b""

    def keepalive(self) -> bytes:
        return SSE_COMMENT

    def _chunk(self, turn: ModelTurn, delta: dict[str, Any], finish: str | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": turn.id,
            "object": "chat.completion.chunk",
            "created": turn.created,
            "model": turn.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def turn(self, turn: ModelTurn) -> bytes:
        out = [self._chunk(turn, {"role": "assistant", "content": ""})]
        if turn.content:
            out.append(self._chunk(turn, {"content": turn.content}))
        for index, call in enumerate(turn.tool_calls):
            out.append(self._chunk(turn, {"tool_calls": [{"index": index, **call}]}))
        out.append(self._chunk(turn, {}, turn.finish_reason))
        if self.include_usage:
            out.append(
                sse(
                    {
                        "id": turn.id,
                        "object": "chat.completion.chunk",
                        "created": turn.created,
                        "model": turn.model,
                        "choices": [],
                        "usage": _usage(turn),
                    }
                )
            )
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)

    def error(self, error: ApiError) -> bytes:
        # The stream is open (status 200 sent): the error goes in the stream, as OpenAI does.
        return sse(error.body())


class ChatCompletionsDialect:
    """``POST /v1/chat/completions``."""

    api: ApiName = "chat_completions"

    def parse(self, body: Any) -> TurnRequest:
        return parse_chat_request(body)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error.body()

    def new_turn_id(self) -> str:
        return f"chatcmpl-{uuid.uuid4().hex}"

    def new_tool_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def answer(self, turn: ModelTurn, request: TurnRequest) -> dict[str, Any]:
        """The non-streaming `chat.completion` body."""
        message: dict[str, Any] = {"role": "assistant", "content": _content(turn)}
        if turn.tool_calls:
            message["tool_calls"] = list(turn.tool_calls)
        return {
            "id": turn.id,
            "object": "chat.completion",
            "created": turn.created,
            "model": turn.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": turn.finish_reason,
                }
            ],
            "usage": _usage(turn),
        }

    def stream(
        self, request: TurnRequest, *, turn_id: str, model: str, prompt_tokens: int
    ) -> _ChunkStream:
        return _ChunkStream(request)
