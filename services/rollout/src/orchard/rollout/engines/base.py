"""The one interface every inference engine serves: prompt token ids and sampling parameters in,
sampled token ids with their logprobs, the finish reason and the weight version out.

Engines see tokens only. Chat templates, tool-call parsing and text live in the capture proxy,
so what the trainer later reads (the prompt ids and the sampled ids) is exactly what the engine
was given and produced. An engine that can serve a vision-language model (`VisionEngine`) also
takes a prompt's images, as encoded bytes beside the ids that already hold their image tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from transformers import PreTrainedTokenizerBase

from orchard.lm.chat import ToolCall

FinishReason = Literal["stop", "length"]
""""stop": a stop token or stop string ended the turn; "length": `max_tokens` or the context."""


class EngineError(Exception):
    """Base class of the engines' errors."""


class EngineClosed(EngineError):
    """The engine was used before `start()` or after `close()`."""


class InvalidRequest(EngineError, ValueError):
    """A request the engine cannot serve as given (prompt too long, bad parameters); retrying
    the same request will not help. The message names the parameter."""


class EngineUnavailable(EngineError):
    """The configured engine cannot run in this environment (its library is not installed);
    the message says how to get it."""


class NoWeightsLoaded(EngineError):
    """The engine has no model yet (no version was published before its start timeout)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one completion."""

    max_tokens: int = 256
    """Most tokens to sample; fewer when the model's context ends first ("length")."""
    temperature: float = 1.0
    """0 samples greedily; otherwise logits are divided by it before sampling."""
    top_p: float = 1.0
    """Nucleus sampling: draw only from the smallest set of tokens whose mass reaches top_p."""
    stop: tuple[str, ...] = ()
    """Strings that end the turn once the decoded output contains one (the token that completed
    it is the last sampled token)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the turn; the stop token is part of the output (the policy chose it)."""
    seed: int | None = None
    """Makes sampling of this request reproducible, whatever else is batched with it."""
    session: str = ""
    """The capture session (the rollout id) the call belongs to, set by the capture proxy; a
    turn engine that keeps state per conversation keys it by this. Engines that sample tokens
    ignore it."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= 100):
            raise InvalidRequest(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, slots=True)
class Generation:
    """What one request produced.

    `logprobs[i]` is the log-probability of `token_ids[i]` under the distribution it was drawn
    from: the model's, divided by the temperature and cut to the top-p nucleus. For greedy
    requests (temperature 0) it is the model's own log-probability at temperature 1.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    weight_version: str
    prompt_tokens: int


@runtime_checkable
class InferenceEngine(Protocol):
    """An engine: `async with engine:` starts it (loading weights), then `generate` from any
    number of concurrent tasks; the engine batches them as it sees fit. New weight versions
    come with `load_version` or, given a weight registry, as the trainer publishes them
    (`orchard.rollout.engines.versioned.VersionedEngine` implements that lifecycle once)."""

    @property
    def weight_version(self) -> str:
        """The version new requests are sampled with (empty before any is loaded)."""
        ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer of the loaded model; raises `NoWeightsLoaded` before one is."""
        ...

    @property
    def context_length(self) -> int:
        """The most tokens (prompt plus output) one sequence may hold."""
        ...

    async def start(self) -> None:
        """Load the weights and start serving."""
        ...

    async def close(self) -> None:
        """Stop serving; requests still waiting fail with `EngineClosed`."""
        ...

    async def load_version(self, version: str, folder: str) -> None:
        """Sample with `version`, the model folder `folder`, from the next request on (the
        requests running now finish on the version they started with)."""
        ...

    async def wait_for_weights(self, version: str | None = None) -> None:
        """Wait until weights (`version` if given) are loaded."""
        ...

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Sample one completion of `prompt_token_ids`.

        Raises `InvalidRequest` (e.g. the prompt fills the context), `EngineClosed`,
        `NoWeightsLoaded`.
        """
        ...


@runtime_checkable
class TurnEngine(Protocol):
    """An engine that decides whole turns from the conversation instead of sampling tokens (a
    scripted teacher, `orchard.rollout.engines.scripted.ScriptedEngine`, or a teacher endpoint,
    `orchard.rollout.engines.relay.RelayEngine`); the capture proxy writes its turns in the
    engine's tokenizer's chat template."""

    async def decide(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        params: SamplingParams,
    ) -> tuple[str, tuple[ToolCall, ...]]:
        """The next turn's text and tool calls (`params`: the call's sampling, as bounded by the
        proxy)."""
        ...


@runtime_checkable
class VisionEngine(Protocol):
    """An engine that may serve a vision-language model: `generate` then also takes the images
    of a prompt whose token ids the model's processor rendered (each image's tokens expanded,
    `orchard.lm.vision.VisionChatRenderer`)."""

    @property
    def processor(self) -> Any | None:
        """The loaded vision-language model's processor; None for a text model or before weights
        are loaded (never raises)."""
        ...

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        images: Sequence[bytes] = (),
    ) -> Generation:
        """`InferenceEngine.generate`, with `images` (PNG, JPEG... bytes) in the order of their
        tokens in the prompt. Raises `InvalidRequest` when the model reads text only or the
        prompt's image tokens are not those of `images`."""
        ...
