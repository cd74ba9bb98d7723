"""One provenance record per rollout: what happened, in order, joined from every source.

The record joins the sandboxes the rollout used, its tool events, every captured model call
(tokens, logprobs, weight version), the reward with its evidence, and any infrastructure
failure with the layer it happened in. It is written as one JSON object and survives history
rewrites by the harness (compaction, stripped reasoning, sub-agents) because it keeps the calls
as captured, not the conversation the harness shows the model at the end.

`render_rollout` prints a record for a person: one line per event, in time order.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from orchard.rollout.capture import CallRecord
from orchard.rollout.results import RolloutStatus


class FailureLayer(enum.Enum):
    """Where an infrastructure failure happened; such a rollout is excluded, never scored."""

    SANDBOX_CREATE = "sandbox_create"
    INFERENCE = "inference"
    TOOL_EXEC = "tool_exec"
    REWARD = "reward"
    HARNESS = "harness"
    """The harness program itself broke (not the policy): a crash of our own loop."""
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class InfraFailure:
    layer: FailureLayer
    error: str
    attempts: int


@dataclass(frozen=True, slots=True)
class ToolEvent:
    """One tool execution of the harness in a sandbox."""

    started_at: float
    latency_s: float
    sandbox_id: str
    tool: str
    arguments: dict[str, Any]
    exit_code: int | None
    output: str
    """What the model was shown (already truncated to the harness's observation limit)."""
    call_id: str = ""
    """The tool-call id the model gave, when it gave one."""


@dataclass(frozen=True, slots=True)
class RewardEvidence:
    title: str
    text: str


@dataclass(frozen=True, slots=True)
class RewardRecord:
    value: float
    scorer: str
    detail: str = ""
    evidence: tuple[RewardEvidence, ...] = ()


@dataclass(slots=True)
class RolloutRecord:
    """Everything about one rollout; filled while it runs, frozen in spirit once written."""

    rollout_id: str
    task_id: str
    harness: str
    started_at: float = field(default_factory=time.time)
    ended_at: float = 0.0
    status: RolloutStatus = RolloutStatus.ABORTED
    outcome: str = ""
    """How it ended in words: "submitted", "step_limit", "token_limit", "time_limit", ..."""
    sandbox_ids: list[str] = field(default_factory=list)
    tool_events: list[ToolEvent] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The harness's final conversation (what it showed the model last), for reading."""
    messages_complete: bool = False
    """`messages` is the whole conversation with every tool call and result (a harness that
    keeps it itself: the tool loop, mini-swe-agent), not a program's instruction and final
    answer; a teacher's rollout then carries it as its trajectory's conversation."""
    reward: RewardRecord | None = None
    failure: InfraFailure | None = None
    sampled_tokens: int = 0
    steps: int = 0
    gui_trail: str = ""
    """URL of the GUI episode's trail.json when its job kept trails (`orchard.rollout.trails`)."""

    @property
    def weight_versions(self) -> list[str]:
        return sorted({c.weight_version for c in self.calls})

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        if self.failure is not None:
            data["failure"]["layer"] = self.failure.layer.value
        data["weight_versions"] = self.weight_versions
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RolloutRecord:
        reward = data.get("reward")
        failure = data.get("failure")
        return cls(
            rollout_id=data["rollout_id"],
            task_id=data["task_id"],
            harness=data["harness"],
            started_at=data["started_at"],
            ended_at=data["ended_at"],
            status=RolloutStatus(data["status"]),
            outcome=data["outcome"],
            sandbox_ids=list(data["sandbox_ids"]),
            tool_events=[ToolEvent(**e) for e in data["tool_events"]],
            calls=[_call_from_json(c) for c in data["calls"]],
            messages=list(data["messages"]),
            messages_complete=bool(data.get("messages_complete", False)),
            reward=(
                None
                if reward is None
                else RewardRecord(
                    value=reward["value"],
                    scorer=reward["scorer"],
                    detail=reward["detail"],
                    evidence=tuple(RewardEvidence(**e) for e in reward["evidence"]),
                )
            ),
            failure=(
                None
                if failure is None
                else InfraFailure(
                    FailureLayer(failure["layer"]), failure["error"], failure["attempts"]
                )
            ),
            sampled_tokens=data["sampled_tokens"],
            steps=data["steps"],
            gui_trail=str(data.get("gui_trail", "")),
        )


def _call_from_json(data: dict[str, Any]) -> CallRecord:
    tuples = (
        "prompt_token_ids",
        "output_token_ids",
        "output_logprobs",
        "request_messages",
        "tool_calls",
    )
    fields: dict[str, Any] = {k: tuple(v) if k in tuples else v for k, v in data.items()}
    return CallRecord(**fields)


def write_records(records: Iterable[RolloutRecord], path: str) -> int:
    """Writes one JSON object per line; returns how many."""
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record.to_json(), separators=(",", ":")) + "\n")
            count += 1
    return count


def read_records(path: str) -> list[RolloutRecord]:
    with open(path, encoding="utf-8") as source:
        return [RolloutRecord.from_json(json.loads(line)) for line in source if line.strip()]


def _clip(text: str, limit: int) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render_rollout(record: RolloutRecord, *, width: int = 160) -> str:
    """The rollout for a person: a header, then its events in time order, then the ending."""
    lines = [
        f"rollout {record.rollout_id}  task {record.task_id}  harness {record.harness}",
        f"  status {record.status.value} ({record.outcome or '-'})  steps {record.steps}  "
        f"sampled tokens {record.sampled_tokens}  "
        f"weights {', '.join(record.weight_versions) or '-'}",
        f"  sandboxes {', '.join(record.sandbox_ids) or '-'}",
    ]
    if record.gui_trail:
        lines.append(f"  gui trail {record.gui_trail}")
    events: list[tuple[float, str]] = []
    for call in record.calls:
        branch = f" [{call.branch}]" if call.branch else ""
        tools = ", ".join(str(t.get("function", {}).get("name", "?")) for t in call.tool_calls)
        events.append(
            (
                call.started_at,
                f"model{branch} #{call.seq} {call.weight_version} "
                f"prompt {len(call.prompt_token_ids)} tok -> "
                f"{len(call.output_token_ids)} tok ({call.finish_reason}"
                f"{'; ' + tools if tools else ''}): {_clip(call.output_text, width)}",
            )
        )
    for event in record.tool_events:
        events.append(
            (
                event.started_at,
                f"tool {event.tool} in {event.sandbox_id} exit {event.exit_code} "
                f"{json.dumps(event.arguments)[:width]} -> {_clip(event.output, width)}",
            )
        )
    start = record.started_at
    for at, text in sorted(events, key=lambda e: e[0]):
        lines.append(f"  +{at - start:8.3f}s  {text}")
    if record.failure is not None:
        lines.append(
            f"  infrastructure failure in {record.failure.layer.value} after "
            f"{record.failure.attempts} attempt(s): {record.failure.error}"
        )
    if record.reward is not None:
        lines.append(
            f"  reward {record.reward.value:g} by {record.reward.scorer}: {record.reward.detail}"
        )
        for evidence in record.reward.evidence:
            lines.append(f"    evidence {evidence.title}: {_clip(evidence.text, width)}")
    else:
        lines.append("  reward none (not scored)")
    return "\n".join(lines)


def find_record(records: Sequence[RolloutRecord], rollout_id: str) -> RolloutRecord:
    for record in records:
        if record.rollout_id == rollout_id:
            return record
    known = ", ".join(r.rollout_id for r in records[:5])
    raise KeyError(f"no rollout {rollout_id!r} in the file (first ones: {known})")
