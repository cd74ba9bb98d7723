"""A scripted teacher as an engine behind the capture proxy: its turns, captured in tokens.

The scripted policy decides whole turns from the conversation and the tools offered, which a
token engine cannot see; so this engine answers `decide` (the proxy's parsed request in, a
turn's text and tool calls out) and the proxy writes the turn in the tokenizer's chat template,
exactly as a model of that tokenizer would have sampled it (the tool-call markup and the stop
token included). A harness of any dialect driven by the teacher is then captured like one
driven by a model: prompt and output token ids per call, prefix trees, trajectories in the
student's tokens. The logprobs are 0.0 (the teacher chose each token with certainty); they are
never used: teacher trajectories train by SFT.

A script with a GUI teacher plays it for conversations of the built-in GUI suite's tasks
(`orchard.rollout.gui_teacher_policy`), one teacher per capture session (`SamplingParams.
session`): behind the capture proxy, which names every call's session, many rollouts share the
engine.

`generate` (prompt ids alone) is refused: the script needs the messages.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from orchard.lm.chat import ToolCall
from orchard.rollout.engines.base import InvalidRequest, SamplingParams
from orchard.rollout.engines.turn_base import TurnEngineBase
from orchard.rollout.gui_teacher_policy import GuiTeacherPolicy, GuiTeacherRequestError
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
        self.gui_teacher = (
            None
            if script.gui_teacher is None
            else GuiTeacherPolicy(script.gui_teacher, self.policy, seed=seed)
        )

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
        draws its conversation's path (or seeds its GUI teacher), else the script's own
        generator does; `params.session` names the conversation of a GUI teacher; the other
        sampling settings do not apply. A GUI suite task's call the teacher cannot answer
        (`GuiTeacherRequestError`: no session, no observation) is `InvalidRequest`."""
        if self.gui_teacher is None:
            step = self.policy.next_step(messages, tools, params.seed)
        else:
            try:
                step = self.gui_teacher.next_step(
                    messages, tools, seed=params.seed, session=params.session
                )
            except GuiTeacherRequestError as exc:
                raise InvalidRequest(str(exc)) from None
        self.turns += 1
        calls = (ToolCall(step.tool, json.dumps(step.arguments)),) if step.tool else ()
        return step.thought, calls
