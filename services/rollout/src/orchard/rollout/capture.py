"""What the capture proxy records for one model call, and what trajectory trees are built from.

A record keeps the exact tokens: the prompt token ids after the chat template, the sampled token
ids and their logprobs under the weight version that sampled them. Text and parsed tool calls are
kept for people and judges only; training never re-tokenizes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One captured model call of one rollout."""

    rollout_id: str
    """The rollout (capture session) the call belongs to."""
    call_id: str
    """Unique id of the call, also returned to the harness as the completion id."""
    seq: int
    """Arrival order of the call within its rollout, from 0."""
    prompt_token_ids: tuple[int, ...]
    """The whole prompt exactly as the engine saw it (chat template applied)."""
    output_token_ids: tuple[int, ...]
    """The tokens the engine sampled."""
    output_logprobs: tuple[float, ...]
    """Log-probability of each sampled token under the sampling policy."""
    weight_version: str
    """The weight version that sampled the call."""
    finish_reason: str
    """Why sampling stopped: "stop", "length" or "tool_calls"."""
    started_at: float
    """Wall-clock start of the call, seconds since the epoch."""
    latency_s: float
    """How long the call took, seconds."""
    request_messages: tuple[dict[str, Any], ...] = ()
    """The chat messages the harness sent, as received (for people and provenance)."""
    output_text: str = ""
    """The sampled text decoded, tool-call markup included."""
    tool_calls: tuple[dict[str, Any], ...] = ()
    """Tool calls parsed from the output, in OpenAI's `tool_calls` shape."""
    branch: str = ""
    """Empty for the main line; else the auxiliary branch this call belongs to, such as
    "compaction" or "subagent:<name>", as declared by the harness. Auxiliary calls are kept in
    provenance and out of the loss."""
    metadata: dict[str, str] = field(default_factory=dict)
    """Free-form labels from the harness or the proxy."""

    def __post_init__(self) -> None:
        if len(self.output_logprobs) != len(self.output_token_ids):
            raise ValueError(
                f"call {self.call_id}: {len(self.output_logprobs)} logprobs for "
                f"{len(self.output_token_ids)} output tokens; there must be one per token"
            )
