"""The rubric process reward: a whole trajectory graded on weighted dimensions.

Each dimension gets a score in [0, 1] with evidence cited from the trajectory; the reward is
the weighted mean. Weights and texts are configuration; they must sum to 1. The default rubric
has seven dimensions: the quality of the patch (R1) and six kinds of self-verification (R2-R7)
that together carry 0.85 of the weight, so an agent is rewarded for checking its own work and
not only for the final diff.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchard.core.errors import OrchardError, Reason
from orchard.reward.judge_json import MalformedJudgeOutput, extract_json_object, require_probability
from orchard.reward.outcome import Evidence, ScoreResult, scored

__all__ = ["DEFAULT_RUBRIC", "Dimension", "combine", "parse_grades", "validate_rubric"]

SCORER = "rubric"
WEIGHT_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Dimension:
    """One thing the grader looks for, and its share of the total."""

    id: str
    text: str
    weight: float


_VERIFICATION_WEIGHT = 0.85 / 6

DEFAULT_RUBRIC: tuple[Dimension, ...] = (
    Dimension("R1", "The final patch fixes the reported problem correctly and minimally.", 0.15),
    Dimension(
        "R2", "The agent reproduced the problem (a failing run or script) before changing code.",
        _VERIFICATION_WEIGHT,
    ),
    Dimension(
        "R3", "The agent ran the existing tests relevant to the change.", _VERIFICATION_WEIGHT
    ),
    Dimension(
        "R4", "The agent wrote or extended a test that fails without its fix and passes with it.",
        _VERIFICATION_WEIGHT,
    ),
    Dimension(
        "R5", "The agent checked edge cases of its change (empty input, bounds, errors).",
        _VERIFICATION_WEIGHT,
    ),
    Dimension(
        "R6", "The agent re-ran the tests after its last edit and read their result.",
        _VERIFICATION_WEIGHT,
    ),
    Dimension(
        "R7", "The agent reviewed its final diff for stray edits before submitting.",
        _VERIFICATION_WEIGHT,
    ),
)  # fmt: skip


def validate_rubric(dimensions: Sequence[Dimension]) -> tuple[Dimension, ...]:
    """``dimensions`` if usable: unique non-empty ids, weights in [0, 1] summing to 1."""
    if not dimensions:
        raise OrchardError(Reason.INVALID_ARGUMENT, "a rubric needs at least one dimension")
    seen: set[str] = set()
    for dimension in dimensions:
        if not dimension.id:
            raise OrchardError(Reason.INVALID_ARGUMENT, "every rubric dimension needs an id")
        if dimension.id in seen:
            raise OrchardError(
                Reason.INVALID_ARGUMENT, f"rubric dimension {dimension.id!r} appears twice"
            )
        seen.add(dimension.id)
        if not math.isfinite(dimension.weight) or not 0 <= dimension.weight <= 1:
            raise OrchardError(
                Reason.INVALID_ARGUMENT,
                f"rubric dimension {dimension.id!r}: weight must lie in [0, 1], "
                f"got {dimension.weight}",
            )
    total = math.fsum(d.weight for d in dimensions)
    if abs(total - 1.0) > WEIGHT_TOLERANCE:
        listing = ", ".join(f"{d.id}={d.weight:g}" for d in dimensions)
        raise OrchardError(
            Reason.INVALID_ARGUMENT,
            f"rubric weights must sum to 1, they sum to {total:.6g} ({listing})",
        )
    return tuple(dimensions)


@dataclass(frozen=True)
class Grade:
    """A grader's score of one dimension and the evidence it cited."""

    score: float
    evidence: str
    turn_index: int


def parse_grades(reply: str, dimensions: Sequence[Dimension], num_turns: int) -> dict[str, Grade]:
    """``{"grades": {"R1": {"score": s, "evidence": "...", "turn": t}, ...}}`` checked.

    Every dimension must be graded, with a score in [0, 1] and non-empty evidence; ``turn`` is
    optional (-1 or absent: the whole trajectory). Raises :class:`MalformedJudgeOutput`.
    """
    grades_raw = extract_json_object(reply).get("grades")
    if not isinstance(grades_raw, dict):
        raise MalformedJudgeOutput('the reply needs a "grades" object keyed by dimension id')
    grades: dict[str, Grade] = {}
    for dimension in dimensions:
        entry = grades_raw.get(dimension.id)
        if not isinstance(entry, dict):
            raise MalformedJudgeOutput(f"dimension {dimension.id} is not graded")
        grades[dimension.id] = _grade(dimension.id, entry, num_turns)
    return grades


def _grade(dimension_id: str, entry: Mapping[str, Any], num_turns: int) -> Grade:
    score = require_probability(entry.get("score"), f"the score of {dimension_id}")
    evidence = entry.get("evidence")
    if not isinstance(evidence, str) or not evidence.strip():
        raise MalformedJudgeOutput(f"dimension {dimension_id} cites no evidence")
    turn = entry.get("turn", -1)
    if isinstance(turn, bool) or not isinstance(turn, int) or not -1 <= turn < num_turns:
        raise MalformedJudgeOutput(
            f"dimension {dimension_id}: turn must be -1 or in [0, {num_turns - 1}], got {turn!r}"
        )
    return Grade(score, evidence.strip(), turn)


def combine(dimensions: Sequence[Dimension], grades: Mapping[str, Grade]) -> ScoreResult:
    """The weighted mean of the grades; components hold each dimension's unweighted score."""
    value = math.fsum(d.weight * grades[d.id].score for d in dimensions)
    return scored(
        SCORER,
        value,
        detail=f"weighted mean of {len(dimensions)} dimensions",
        components={d.id: grades[d.id].score for d in dimensions},
        evidence=tuple(
            Evidence.of(
                f"{d.id} ({grades[d.id].score:.2f} x {d.weight:.3f})",
                grades[d.id].evidence,
                grades[d.id].turn_index,
            )
            for d in dimensions
        ),
    )
