"""What every turn engine (an engine that decides whole turns from messages, with no weights of
its own) has in common: a tokenizer the capture proxy writes its turns in, a context as long as
the proxy should allow, no weights to load, and no `generate` from prompt ids alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Self

from transformers import PreTrainedTokenizerBase

from orchard.rollout.engines.base import Generation, InvalidRequest, SamplingParams

__all__ = ["TurnEngineBase"]


class TurnEngineBase:
    """The weightless half of a `TurnEngine`; subclasses give `weight_version` and `decide`,
    and `start`/`close` when they hold resources."""

    kind = "a turn engine"
    """How errors name the engine, e.g. "a scripted engine"."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, context_length: int = 1 << 20) -> None:
        self._tokenizer = tokenizer
        self._context_length = context_length
        self.turns = 0
        """Turns decided so far."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def context_length(self) -> int:
        return self._context_length

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def load_version(self, version: str, folder: str) -> None:
        raise InvalidRequest(f"{self.kind} has no weights to load")

    async def wait_for_weights(self, version: str | None = None) -> None:
        return None

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> Generation:
        raise InvalidRequest(
            f"{self.kind} decides turns from messages: serve it behind the capture proxy"
        )
