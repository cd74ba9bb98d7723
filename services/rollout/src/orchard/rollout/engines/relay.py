"""A teacher endpoint as an engine behind the capture proxy: any chat-completions API drives
agent programs of every dialect, and their calls are captured.

An agent program speaks its own dialect (Claude Code Anthropic Messages, Codex the Responses
API) and a teacher endpoint usually speaks OpenAI chat completions. Behind the capture proxy
this engine answers `decide` as the scripted teacher does: the proxy parses the program's request
into OpenAI chat messages and function tools, the engine asks the endpoint for the next turn
(with the official `openai` client, not streaming) and returns its text and tool calls, and the
proxy writes that turn to the program in the program's dialect, streaming or not. The proxy
records each call in the tokens of this engine's tokenizer (the built-in one), so a program
driven by a real teacher rebuilds into trajectories exactly as one driven by the script does;
the logprobs are 0.0 and never used (teacher trajectories train by SFT).

The endpoint's sampling is the job's (temperature, the proxy's cap on tokens per call); what
the program asks for is bounded by those. Errors: a request the endpoint refuses (400, 404, 413,
422) is `InvalidRequest` (the program gets 400); anything else, after the client's own retries
of timeouts, 429 and 5xx, is `EngineError` (the program gets 500 and may retry).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import openai
from transformers import PreTrainedTokenizerBase

from orchard.lm.chat import ToolCall
from orchard.rollout.engines.base import EngineError, InvalidRequest, SamplingParams
from orchard.rollout.engines.turn_base import TurnEngineBase

__all__ = ["RelayEngine"]

_REFUSED = frozenset({400, 404, 413, 422})
"""Statuses that mean the request itself was wrong: retrying it would not help."""


class RelayEngine(TurnEngineBase):
    """Turns from an OpenAI-compatible endpoint, in `tokenizer`'s tokens; see the module
    docstring."""

    kind = "a teacher endpoint's engine"

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str,
        tokenizer: PreTrainedTokenizerBase,
        temperature: float = 1.0,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        context_length: int = 1 << 20,
    ) -> None:
        super().__init__(tokenizer, context_length)
        self.base_url = base_url
        self.model = model
        self._api_key = api_key
        self._temperature = temperature
        self._timeout_s = timeout_s
        self._max_retries = max_retries
        self._client: openai.AsyncOpenAI | None = None

    @property
    def weight_version(self) -> str:
        return f"endpoint:{self.model}"

    async def start(self) -> None:
        if self._client is None:
            self._client = openai.AsyncOpenAI(
                base_url=self.base_url,
                api_key=self._api_key,
                timeout=self._timeout_s,
                max_retries=self._max_retries,
            )

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def decide(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        params: SamplingParams,
    ) -> tuple[str, tuple[ToolCall, ...]]:
        """The endpoint's next turn for the conversation and the tools offered."""
        if self._client is None:
            raise EngineError("the teacher endpoint's engine is not started")
        request: dict[str, Any] = {
            "model": self.model,
            "messages": [dict(m) for m in messages],
            "temperature": self._temperature,
            "max_tokens": params.max_tokens,
        }
        if tools:
            request["tools"] = [dict(t) for t in tools]
        if params.stop:
            request["stop"] = list(params.stop)
        try:
            reply = await self._client.chat.completions.create(**request)
        except openai.APIStatusError as exc:
            message = f"the teacher endpoint {self.base_url} refused the call: {_detail(exc)}"
            if exc.status_code in _REFUSED:
                raise InvalidRequest(message) from None
            raise EngineError(message) from None
        except openai.APIError as exc:
            raise EngineError(
                f"the teacher endpoint {self.base_url} did not answer: {type(exc).__name__}: {exc}"
            ) from None
        if not reply.choices:
            raise EngineError(f"the teacher endpoint {self.base_url} answered with no choice")
        message = reply.choices[0].message
        calls = tuple(
            ToolCall(call.function.name, _arguments(call.function.arguments))
            for call in message.tool_calls or ()
            if call.type == "function"
        )
        self.turns += 1
        return message.content or "", calls


def _arguments(text: str | None) -> str:
    """The call's arguments as compact JSON text (an endpoint may send none or pretty JSON)."""
    if not text:
        return "{}"
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text  # the program sees what the teacher wrote, as a model's own would be


def _detail(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, Mapping):
        error = body.get("error", body)
        if isinstance(error, Mapping) and error.get("message"):
            return f"{exc.status_code} {error['message']}"
    return f"{exc.status_code} {exc.message}"
