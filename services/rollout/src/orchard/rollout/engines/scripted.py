"""A scripted teacher as an engine behind the capture proxy: its turns, captured in tokens.

The scripted policy decides whole turns from the conversation and the tools offered, which a
token engine cannot see; so this engine answers `decide` (the proxy's parsed request in, a
turn's text and tool calls out) and the proxy writes the turn in the tokenizer's chat template,
exactly as a model of that tokenizer would have sampled it (the tool-call markup and the stop
token included). A harness of any dialect driven by the teacher is then captured like one
driven by a model: prompt and output token ids per call, prefix trees, trajectories in the
student's tokens. The logprobs are 0.0 (the teacher chose each token with certainty); they are
never used: teacher trajectories train by SFT.

`generate` (prompt ids alone) is refused: the script needs the messages.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from orchard.lm.chat import ToolCall
from orchard.rollout.engines.base import SamplingParams
from orchard.rollout.engines.turn_base import TurnEngineBase
from orchard.rollout.scripted_policy import PolicyScript, ScriptedPolicy

__all__ = ["ScriptedEngine"]


class ScriptedEngine(TurnEngineBase):
    """`ScriptedPolicy` turns in `tokenizer`'s tokens; see the module docstring."""

    kind = "a scripted engine"

    def __init__(
        self,
        script: PolicyScript,
        tokenizer: PreTrainedTokenizerBase,
        *,
        seed: int | None = None,
        context_length: int = 1 << 20,
    ) -> None:
        super().__init__(tokenizer, context_length)
        self.policy = ScriptedPolicy(script, seed)

    @property
    def weight_version(self) -> str:
        return f"scripted:{self.policy.script.model}"

    async def decide(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        params: SamplingParams,
    ) -> tuple[str, tuple[ToolCall, ...]]:
        """The next turn's text and tool calls for a conversation and the tools offered: a
        call's `params.seed` (the capture proxy's per-rollout draw, with a seeded script)
        draws its conversation's path, else the script's own generator does; the other
        sampling settings do not apply."""
        self.turns += 1
        step = self.policy.next_step(messages, tools, params.seed)
        calls = (ToolCall(step.tool, json.dumps(step.arguments)),) if step.tool else ()
        return step.thought, calls
