"""Asking a judge model on any OpenAI-compatible chat endpoint, with retries and strict parsing.

The official ``openai`` client does the HTTP; this module adds what rewards need on top: a
bounded number of attempts, each reply parsed strictly by the caller's parser, and a record of
every attempt (the replies and the transport errors) kept as evidence. Transport failures
(timeouts, HTTP 5xx, refused connections, bodies that are not a chat completion) and malformed
replies are both retried; when the attempts run out the caller excludes the reward. The judge
is never a reason to score the policy low.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import openai

from orchard.reward.judge_json import MalformedJudgeOutput

__all__ = [
    "Judge",
    "JudgeAnswer",
    "JudgeEndpoint",
    "OpenAIJudge",
    "RetryObserver",
    "image_data_url",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class JudgeEndpoint:
    """Where the judge model is served and how patiently to ask it."""

    base_url: str
    """The API root, e.g. ``http://127.0.0.1:8000/v1``."""
    model: str
    """The model name the endpoint serves."""
    api_key: str = "unused"
    """Bearer token; local endpoints ignore it."""
    timeout_s: float = 60.0
    """Deadline of one call."""
    max_attempts: int = 3
    """Calls per question, transport failures and malformed replies together."""
    max_tokens: int = 1024
    """Most tokens one reply may have."""
    temperature: float = 0.0
    """Sampling temperature; 0 for the most repeatable verdicts."""

    def __post_init__(self) -> None:
        if not self.base_url:
            raise ValueError("a judge endpoint needs a base_url, e.g. http://127.0.0.1:8000/v1")
        if not self.model:
            raise ValueError("a judge endpoint needs the model name it serves")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")


@dataclass
class JudgeAnswer(Generic[T]):
    """The parsed answer (None when no attempt gave one) and what every attempt returned."""

    value: T | None = None
    replies: list[str] = field(default_factory=list)
    """Reply texts that came back, in order, well-formed or not."""
    problems: list[str] = field(default_factory=list)
    """One line per failed attempt: a transport error or why the reply was malformed."""
    transport_failures: int = 0

    @property
    def attempts(self) -> int:
        return len(self.problems) + (1 if self.value is not None else 0)


def image_data_url(image: bytes) -> str:
    """A ``data:`` URL for a PNG or JPEG screenshot; other bytes are refused."""
    if image.startswith(b"\x89PNG\r\n\x1a\n"):
        kind = "png"
    elif image.startswith(b"\xff\xd8\xff"):
        kind = "jpeg"
    else:
        raise ValueError("a screenshot must be PNG or JPEG bytes")
    return f"data:image/{kind};base64,{base64.b64encode(image).decode()}"


class Judge(Protocol):
    """What the judged scorers ask: a model behind an endpoint (:class:`OpenAIJudge`) or the
    scripted judge (:class:`orchard.reward.scripted_judge.ScriptedJudge`)."""

    @property
    def model(self) -> str:
        """The name a credit or verdict is attributed to."""
        ...

    @property
    def scripted(self) -> bool:
        """True for a judge without a model, which answers credit questions only."""
        ...

    async def ask(
        self, messages: Sequence[dict[str, Any]], parse: Callable[[str], T]
    ) -> JudgeAnswer[T]: ...

    async def close(self) -> None: ...


RetryObserver = Callable[[str], None]
"""Told the kind of every failed attempt that is retried: ``timeout``, ``http_error``,
``connection``, ``bad_response`` (not a chat completion) or ``malformed`` (no usable answer)."""


class OpenAIJudge:
    """A judge behind one endpoint; ``async with`` it, or call :meth:`close`.

    ``on_retry`` (e.g. a metrics counter) hears of each failed attempt that is tried again.
    """

    def __init__(self, endpoint: JudgeEndpoint, *, on_retry: RetryObserver | None = None) -> None:
        self.endpoint = endpoint
        self._on_retry = on_retry
        # Retries are ours (they also cover malformed replies), so the client makes none.
        self._client = openai.AsyncOpenAI(
            base_url=endpoint.base_url,
            api_key=endpoint.api_key,
            timeout=endpoint.timeout_s,
            max_retries=0,
        )

    scripted = False

    @property
    def model(self) -> str:
        return self.endpoint.model

    async def __aenter__(self) -> OpenAIJudge:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._client.close()

    async def ask(
        self, messages: Sequence[dict[str, Any]], parse: Callable[[str], T]
    ) -> JudgeAnswer[T]:
        """Ask until ``parse`` accepts a reply or the attempts run out.

        ``parse`` raises :class:`MalformedJudgeOutput` (or ``ValueError``) on a reply it cannot
        use; anything else it raises is a bug and propagates.
        """
        answer: JudgeAnswer[T] = JudgeAnswer()
        for attempt in range(1, self.endpoint.max_attempts + 1):
            try:
                reply = await self._complete(messages)
            except (openai.APIError, ValueError) as exc:
                answer.transport_failures += 1
                answer.problems.append(f"attempt {attempt}: {_describe(exc)}")
                log.warning("judge %s attempt %d failed: %s", self.endpoint.model, attempt, exc)
                self._retrying(attempt, _failure_kind(exc))
                continue
            answer.replies.append(reply)
            try:
                answer.value = parse(reply)
            except (MalformedJudgeOutput, ValueError) as exc:
                answer.problems.append(f"attempt {attempt}: malformed reply: {exc}")
                self._retrying(attempt, "malformed")
                continue
            return answer
        return answer

    def _retrying(self, attempt: int, kind: str) -> None:
        if self._on_retry is not None and attempt < self.endpoint.max_attempts:
            self._on_retry(kind)

    async def _complete(self, messages: Sequence[dict[str, Any]]) -> str:
        response = await self._client.chat.completions.create(
            model=self.endpoint.model,
            messages=list(messages),  # type: ignore[arg-type]
            max_tokens=self.endpoint.max_tokens,
            temperature=self.endpoint.temperature,
        )
        choices = getattr(response, "choices", None)
        if not choices:
            raise ValueError("the response has no choices")
        content = choices[0].message.content
        if not isinstance(content, str):
            raise ValueError("the response's message has no text content")
        return content


def _failure_kind(exc: BaseException) -> str:
    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIStatusError):
        return "http_error"
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    return "bad_response"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, openai.APITimeoutError):
        return "timed out"
    if isinstance(exc, openai.APIStatusError):
        return f"HTTP {exc.status_code}"
    if isinstance(exc, openai.APIConnectionError):
        return f"connection failed: {exc.__cause__ or exc}"
    return f"{type(exc).__name__}: {exc}"
