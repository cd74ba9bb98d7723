"""Curation of trajectory datasets: composable steps that drop rows, each saying why.

A step takes the rows (`orchard.types.v1.Trajectory`) that reached it and returns the ones it
keeps and a `Drop` (trajectory id, reason, detail) for each it leaves out. `curate` runs steps
in the order given and returns the surviving rows with one `StepReport` per step, whose
`summary()` is what a person reads:

- `TokenLimit(max_tokens)` — trajectories with more tokens in all (inputs and outputs of every
  turn) than `max_tokens`;
- `KnownTools(schemas)` — policy turns that call a tool the harness does not declare, or (with
  `check_arguments`) whose arguments do not validate against the tool's JSON schema; schemas are
  per harness, with `None` for every harness not named;
- `ParsableActions()` — policy turns whose action did not parse: a tool call whose arguments
  are not a JSON object, a `<tool_call>` block in the output text that is not a valid call (the
  same parser the capture proxy uses), or a `tool_calls` finish without any call;
- `ShortestSuccessful()` — of the successful trajectories of a task (or of a task in one
  harness, `per_harness`), only the one with the fewest tokens stays (the first in order on a
  tie); failed ones pass unless `keep_failed` is off. Successful: scored at or above
  `success_threshold`, the success threshold every service shares (`masks.is_success`);
- `CapPerSource(cap, key)` — at most `cap` trajectories per value of `metadata[key]` (e.g. the
  repository or website), the first ones in order; rows without the key pass.

Row steps come first in a sensible pipeline (a shortest success that is later dropped for an
unknown tool would otherwise take its task's other successes with it); `default_order` sorts
steps that way.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import jsonschema

from orchard.core.success import DEFAULT_SUCCESS_THRESHOLD, check_success_threshold, is_success
from orchard.lm.chat import ChatFormatError, normalize_tools, parse_assistant_text
from orchard.trainer.masks import trainable_reason
from orchard.types.v1 import trajectory_pb2

__all__ = [
    "CapPerSource",
    "CurationError",
    "CurationResult",
    "CurationStep",
    "Drop",
    "KnownTools",
    "ParsableActions",
    "ShortestSuccessful",
    "StepReport",
    "TokenLimit",
    "ToolSchema",
    "curate",
    "default_order",
    "load_tool_schema",
    "token_count",
]

Trajectory = trajectory_pb2.Trajectory


class CurationError(ValueError):
    """A curation step that cannot be built as configured (bad limit, unreadable schema)."""


@dataclass(frozen=True, slots=True)
class Drop:
    """One row a step left out."""

    trajectory_id: str
    reason: str
    """A short, stable name to count by (`over_token_limit`, `unknown_tool`...)."""
    detail: str
    """What exactly was wrong, for a person."""


class CurationStep(Protocol):
    @property
    def name(self) -> str:
        """The step and its settings, as a report shows them."""
        ...

    def apply(self, rows: Sequence[Trajectory]) -> tuple[list[Trajectory], list[Drop]]:
        """The rows kept, in their order, and the rows dropped."""
        ...


def token_count(trajectory: Trajectory) -> int:
    """All tokens of a trajectory: every turn's input and output tokens."""
    return sum(len(t.input_token_ids) + len(t.output_token_ids) for t in trajectory.turns)


def _policy_turns(trajectory: Trajectory) -> Iterable[trajectory_pb2.Turn]:
    return (t for t in trajectory.turns if t.kind == trajectory_pb2.TURN_KIND_POLICY)


class _RowFilter:
    """A step that judges each row on its own: `check` returns (reason, detail) to drop it."""

    name = "row filter"

    def check(self, trajectory: Trajectory) -> tuple[str, str] | None:
        raise NotImplementedError

    def apply(self, rows: Sequence[Trajectory]) -> tuple[list[Trajectory], list[Drop]]:
        kept: list[Trajectory] = []
        dropped: list[Drop] = []
        for row in rows:
            verdict = self.check(row)
            if verdict is None:
                kept.append(row)
            else:
                dropped.append(Drop(row.id, *verdict))
        return kept, dropped


class TokenLimit(_RowFilter):
    """Drop trajectories with more than `max_tokens` tokens in all."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise CurationError(f"the token limit must be at least 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.name = f"token_limit(max_tokens={max_tokens})"

    def check(self, trajectory: Trajectory) -> tuple[str, str] | None:
        n = token_count(trajectory)
        if n > self.max_tokens:
            return "over_token_limit", f"{n} tokens > {self.max_tokens}"
        return None


@dataclass(frozen=True, slots=True)
class ToolSchema:
    """The tools a harness declares: name -> JSON schema of the arguments."""

    parameters: Mapping[str, Mapping[str, Any]]

    @classmethod
    def of(cls, tools: Sequence[Mapping[str, Any]]) -> ToolSchema:
        """From OpenAI `tools` entries or task declarations ({"name", "parameters", ...})."""
        entries = [
            t if "function" in t else {"type": "function", "function": t}
            for t in tools
            if isinstance(t, Mapping)
        ]
        if len(entries) != len(tools):
            raise CurationError("every tool must be a JSON object")
        try:
            functions = [e["function"] for e in normalize_tools(entries)]
        except ChatFormatError as exc:
            raise CurationError(f"not a tool schema: {exc}") from exc
        parameters: dict[str, Mapping[str, Any]] = {}
        for f in functions:
            try:
                jsonschema.validators.validator_for(f["parameters"]).check_schema(f["parameters"])
            except jsonschema.SchemaError as exc:
                raise CurationError(
                    f"tool {f['name']!r}: its parameters are not a JSON schema: {exc.message}"
                ) from exc
            parameters[f["name"]] = f["parameters"]
        return cls(parameters)


def load_tool_schema(path: Path) -> ToolSchema:
    """A JSON file of tools: a list of them, or an object with a `tools` list."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CurationError(f"cannot read tool schema {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise CurationError(f"{path}: not JSON: {exc}") from exc
    tools = document.get("tools") if isinstance(document, dict) else document
    if not isinstance(tools, list):
        raise CurationError(f"{path}: expected a list of tools or an object with a 'tools' list")
    try:
        return ToolSchema.of(tools)
    except CurationError as exc:
        raise CurationError(f"{path}: {exc}") from exc


class KnownTools(_RowFilter):
    """Drop trajectories whose policy turns call tools outside their harness's schema.

    `schemas` maps a harness name to its tools; the `None` entry applies to every harness not
    named, and rows of a harness with no entry pass unchecked. Arguments that are not a JSON
    object are left to `ParsableActions`.
    """

    def __init__(
        self, schemas: Mapping[str | None, ToolSchema], *, check_arguments: bool = True
    ) -> None:
        if not schemas:
            raise CurationError("KnownTools needs the tool schema of at least one harness")
        self.schemas = dict(schemas)
        self.check_arguments = check_arguments
        harnesses = ", ".join("*" if h is None else h for h in self.schemas)
        self.name = f"known_tools(harnesses={harnesses}, check_arguments={check_arguments})"
        self._validators = {
            (harness, tool): jsonschema.validators.validator_for(params)(params)
            for harness, schema in self.schemas.items()
            for tool, params in schema.parameters.items()
        }

    def check(self, trajectory: Trajectory) -> tuple[str, str] | None:
        harness: str | None = trajectory.harness
        if harness not in self.schemas:
            harness = None
        schema = self.schemas.get(harness)
        if schema is None:
            return None
        for turn in _policy_turns(trajectory):
            for call in turn.tool_calls:
                if call.name not in schema.parameters:
                    known = ", ".join(sorted(schema.parameters)) or "none"
                    return (
                        "unknown_tool",
                        f"turn {turn.index} calls {call.name!r}; the tools are {known}",
                    )
                if not self.check_arguments:
                    continue
                try:
                    arguments = json.loads(call.arguments_json or "{}")
                except json.JSONDecodeError:
                    continue
                error = jsonschema.exceptions.best_match(
                    self._validators[harness, call.name].iter_errors(arguments)
                )
                if error is not None:
                    return (
                        "arguments_off_schema",
                        f"turn {turn.index} calls {call.name!r} with arguments that do not fit "
                        f"its schema: {error.message}",
                    )
        return None


class ParsableActions(_RowFilter):
    """Drop trajectories with a policy action that did not parse."""

    name = "parsable_actions"

    def check(self, trajectory: Trajectory) -> tuple[str, str] | None:
        for turn in _policy_turns(trajectory):
            for call in turn.tool_calls:
                try:
                    arguments = json.loads(call.arguments_json or "{}")
                except json.JSONDecodeError as exc:
                    return (
                        "unparsable_arguments",
                        f"turn {turn.index}: the arguments of {call.name!r} are not JSON "
                        f"({exc.msg} at character {exc.pos})",
                    )
                if not isinstance(arguments, dict):
                    return (
                        "unparsable_arguments",
                        f"turn {turn.index}: the arguments of {call.name!r} are a JSON "
                        f"{type(arguments).__name__}, not an object",
                    )
            if turn.output_text:
                unparsed = parse_assistant_text(turn.output_text).unparsed_tool_calls
                if unparsed:
                    return (
                        "unparsable_tool_call",
                        f"turn {turn.index}: {unparsed} <tool_call> block(s) in the output "
                        "are not a valid call",
                    )
            if turn.finish_reason == "tool_calls" and not turn.tool_calls:
                return (
                    "unparsable_tool_call",
                    f"turn {turn.index} finished for tool calls but none was parsed",
                )
        return None


def _successful(trajectory: Trajectory, threshold: float) -> bool:
    if trainable_reason(trajectory) is not None:
        return False
    return is_success(trajectory.reward.value, threshold)


class ShortestSuccessful:
    """Keep one successful trajectory per task (or per task and harness): the one with the
    fewest tokens. Successful: a reward at or above `success_threshold` (in [0, 1], else
    ValueError)."""

    def __init__(
        self,
        *,
        success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
        keep_failed: bool = True,
        per_harness: bool = False,
    ) -> None:
        self.success_threshold = check_success_threshold(success_threshold)
        self.keep_failed = keep_failed
        self.per_harness = per_harness
        per = ", per_harness=True" if per_harness else ""
        self.name = (
            f"shortest_successful(success_threshold={success_threshold}, "
            f"keep_failed={keep_failed}{per})"
        )

    def _key(self, row: Trajectory) -> tuple[str, str]:
        return (row.task_id, row.harness if self.per_harness else "")

    def _won(self, row: Trajectory) -> bool:
        return _successful(row, self.success_threshold)

    def apply(self, rows: Sequence[Trajectory]) -> tuple[list[Trajectory], list[Drop]]:
        best: dict[tuple[str, str], tuple[int, int]] = {}
        for position, row in enumerate(rows):
            if self._won(row):
                candidate = (token_count(row), position)
                key = self._key(row)
                best[key] = min(best.get(key, candidate), candidate)
        kept: list[Trajectory] = []
        dropped: list[Drop] = []
        for position, row in enumerate(rows):
            if not self._won(row):
                if self.keep_failed:
                    kept.append(row)
                else:
                    dropped.append(Drop(row.id, "not_successful", "not a successful trajectory"))
                continue
            tokens, winner = best[self._key(row)]
            if winner == position:
                kept.append(row)
            else:
                where = f" in {row.harness}" if self.per_harness else ""
                dropped.append(
                    Drop(
                        row.id,
                        "longer_success",
                        f"task {row.task_id!r}{where}: {token_count(row)} tokens; kept "
                        f"{rows[winner].id!r} with {tokens}",
                    )
                )
        return kept, dropped


class CapPerSource:
    """At most `cap` trajectories per source (`metadata[key]`), the first ones in order."""

    def __init__(self, cap: int, key: str = "repository") -> None:
        if cap < 1:
            raise CurationError(f"the cap per source must be at least 1, got {cap}")
        if not key:
            raise CurationError("the source key must be a metadata key, got an empty string")
        self.cap = cap
        self.key = key
        self.name = f"cap_per_source(cap={cap}, key={key!r})"

    def apply(self, rows: Sequence[Trajectory]) -> tuple[list[Trajectory], list[Drop]]:
        seen: Counter[str] = Counter()
        kept: list[Trajectory] = []
        dropped: list[Drop] = []
        for row in rows:
            if self.key not in row.metadata:
                kept.append(row)
                continue
            source = row.metadata[self.key]
            seen[source] += 1
            if seen[source] <= self.cap:
                kept.append(row)
            else:
                dropped.append(
                    Drop(row.id, "over_source_cap", f"{self.key} {source!r} has {self.cap} already")
                )
        return kept, dropped


_ORDER: dict[type, int] = {
    TokenLimit: 0,
    ParsableActions: 1,
    KnownTools: 2,
    ShortestSuccessful: 3,
    CapPerSource: 4,
}


def default_order(steps: Iterable[CurationStep]) -> list[CurationStep]:
    """Row filters first, then the shortest success per task, then the cap per source."""
    return sorted(steps, key=lambda s: _ORDER.get(type(s), len(_ORDER)))


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one step did."""

    step: str
    rows_in: int
    kept: int
    dropped: tuple[Drop, ...]

    @property
    def by_reason(self) -> Counter[str]:
        return Counter(d.reason for d in self.dropped)

    def as_dict(self, examples: int = 5) -> dict[str, Any]:
        """JSON form, with the first `examples` drops of each reason."""
        shown: dict[str, list[dict[str, str]]] = defaultdict(list)
        for d in self.dropped:
            if len(shown[d.reason]) < examples:
                shown[d.reason].append({"trajectory_id": d.trajectory_id, "detail": d.detail})
        return {
            "step": self.step,
            "rows_in": self.rows_in,
            "kept": self.kept,
            "dropped": len(self.dropped),
            "by_reason": dict(self.by_reason),
            "examples": dict(shown),
        }


@dataclass(frozen=True, slots=True)
class CurationResult:
    rows: list[Trajectory]
    reports: list[StepReport] = field(default_factory=list)

    def summary(self, examples: int = 3) -> str:
        """A few lines a person reads: per step, rows in, kept, dropped by reason, examples."""
        lines = []
        for r in self.reports:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(r.by_reason.items()))
            lines.append(
                f"{r.step}: {r.rows_in} in, {r.kept} kept, {len(r.dropped)} dropped"
                + (f" ({reasons})" if reasons else "")
            )
            for d in r.dropped[:examples]:
                lines.append(f"    {d.trajectory_id}: {d.reason}: {d.detail}")
            if len(r.dropped) > examples:
                lines.append(f"    ... {len(r.dropped) - examples} more")
        return "\n".join(lines)


def curate(
    rows: Iterable[Trajectory],
    steps: Sequence[CurationStep],
    *,
    on_report: Callable[[StepReport], None] | None = None,
) -> CurationResult:
    """Run `steps` in order over `rows`; the rows that survive all of them, and the reports."""
    current = list(rows)
    reports: list[StepReport] = []
    for step in steps:
        kept, dropped = step.apply(current)
        report = StepReport(step.name, len(current), len(kept), tuple(dropped))
        reports.append(report)
        if on_report is not None:
            on_report(report)
        current = kept
    return CurationResult(current, reports)
