"""Retrospective credit assignment for failed trajectories.

A judge model that knows the trajectory failed annotates P(resolve) at key turns under
calibration rules; the annotation is validated, interpolated linearly to one value per turn,
and the *rise segments* (maximal runs of turns that raised the value by at least epsilon) are
what SFT may train on in a failed trajectory.

The curve has one value per turn: ``values[t]`` is the estimated chance of resolving the task
after turn ``t``. Turn ``t + 1`` *rises* when ``values[t + 1] - values[t] >= epsilon``; a rise
segment is a maximal run of rising turns, as an inclusive :class:`TurnSpan`. Turn 0 has no
earlier value and never rises.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchard.core.errors import OrchardError, Reason
from orchard.reward.judge_json import MalformedJudgeOutput, extract_json_object, require_probability

__all__ = [
    "DEFAULT_EPSILON",
    "CalibrationRules",
    "CreditCurve",
    "TurnSpan",
    "credit_curve",
    "interpolate",
    "parse_annotations",
    "rise_segments",
    "validate_epsilon",
]

DEFAULT_EPSILON = 0.05


@dataclass(frozen=True)
class TurnSpan:
    """Turns ``start`` to ``end``, both included."""

    start: int
    end: int


@dataclass(frozen=True)
class CalibrationRules:
    """What a judge's annotation must satisfy to be used (else it is retried, then excluded).

    The judge reasons backward from the known failure: it starts uncertain, its estimate drops
    at the critical error, and it ends low.
    """

    start_low: float = 0.3
    start_high: float = 0.5
    end_below: float = 0.2
    require_drop_at_critical: bool = True


@dataclass(frozen=True)
class CreditCurve:
    """The value after every turn and the rise segments."""

    values: tuple[float, ...]
    rise_segments: tuple[TurnSpan, ...]
    epsilon: float
    critical_turn: int | None
    annotated: Mapping[int, float]


def validate_epsilon(epsilon: float) -> float:
    """``epsilon`` if it lies in (0, 1), else INVALID_ARGUMENT; 0 means the default."""
    if epsilon == 0:
        return DEFAULT_EPSILON
    if not math.isfinite(epsilon) or not 0 < epsilon < 1:
        raise OrchardError(
            Reason.INVALID_ARGUMENT,
            f"epsilon must lie in (0, 1) (0 for {DEFAULT_EPSILON}), got {epsilon}",
        )
    return epsilon


def parse_annotations(
    reply: str, num_turns: int, rules: CalibrationRules = CalibrationRules()
) -> tuple[dict[int, float], int | None]:
    """The judge's ``{"values": [{"turn": t, "value": p}, ...], "critical_turn": k}`` checked.

    Returns the annotated values by turn and the critical turn (None when not given). Raises
    :class:`MalformedJudgeOutput` on anything unusable: no JSON, a turn outside the trajectory
    or given twice, a value outside [0, 1], or a broken calibration rule.
    """
    if num_turns <= 0:
        raise OrchardError(
            Reason.INVALID_ARGUMENT, "the trajectory has no turns to assign credit to"
        )
    verdict = extract_json_object(reply)
    entries = verdict.get("values")
    if not isinstance(entries, list) or not entries:
        raise MalformedJudgeOutput('the reply needs a non-empty "values" list')
    annotated: dict[int, float] = {}
    for entry in entries:
        turn, value = _entry(entry, num_turns)
        if turn in annotated:
            raise MalformedJudgeOutput(f"turn {turn} is annotated twice")
        annotated[turn] = value
    critical = _critical_turn(verdict.get("critical_turn"), num_turns)
    last = num_turns - 1
    if 0 not in annotated or last not in annotated:
        raise MalformedJudgeOutput(f"the first (0) and last ({last}) turns must be annotated")
    if not rules.start_low <= annotated[0] <= rules.start_high:
        raise MalformedJudgeOutput(
            f"the value at turn 0 must lie in [{rules.start_low}, {rules.start_high}], "
            f"got {annotated[0]}"
        )
    if not annotated[last] < rules.end_below:
        raise MalformedJudgeOutput(
            f"the value at the last turn must be below {rules.end_below}, got {annotated[last]}"
        )
    if rules.require_drop_at_critical and critical is not None:
        values = interpolate(annotated, num_turns)
        if critical == 0 or not values[critical] < values[critical - 1]:
            raise MalformedJudgeOutput(f"the value must drop at the critical turn {critical}")
    return annotated, critical


def _entry(entry: Any, num_turns: int) -> tuple[int, float]:
    if not isinstance(entry, dict):
        raise MalformedJudgeOutput(f"each value entry must be an object, got {entry!r}")
    turn = entry.get("turn")
    if isinstance(turn, bool) or not isinstance(turn, int) or not 0 <= turn < num_turns:
        raise MalformedJudgeOutput(f"turn must be an integer in [0, {num_turns - 1}], got {turn!r}")
    return turn, require_probability(entry.get("value"), f"the value at turn {turn}")


def _critical_turn(raw: Any, num_turns: int) -> int | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw < num_turns:
        raise MalformedJudgeOutput(
            f"critical_turn must be an integer in [0, {num_turns - 1}], got {raw!r}"
        )
    return raw


def interpolate(annotated: Mapping[int, float], num_turns: int) -> list[float]:
    """One value per turn: linear between annotated turns, held flat beyond the outermost."""
    if not annotated:
        raise ValueError("nothing to interpolate")
    points = sorted(annotated.items())
    values: list[float] = []
    for turn in range(num_turns):
        if turn <= points[0][0]:
            values.append(points[0][1])
            continue
        if turn >= points[-1][0]:
            values.append(points[-1][1])
            continue
        for (left, low), (right, high) in itertools.pairwise(points):
            if left <= turn <= right:
                values.append(low + (high - low) * (turn - left) / (right - left))
                break
    return values


def rise_segments(values: Sequence[float], epsilon: float = DEFAULT_EPSILON) -> list[TurnSpan]:
    """Maximal runs of turns ``t`` with ``values[t] - values[t - 1] >= epsilon``."""
    spans: list[TurnSpan] = []
    start: int | None = None
    # A tiny slack keeps a climb of exactly epsilon from falling to float rounding.
    threshold = epsilon - 1e-12
    for turn in range(1, len(values)):
        if values[turn] - values[turn - 1] >= threshold:
            if start is None:
                start = turn
        elif start is not None:
            spans.append(TurnSpan(start, turn - 1))
            start = None
    if start is not None:
        spans.append(TurnSpan(start, len(values) - 1))
    return spans


def credit_curve(
    reply: str,
    num_turns: int,
    *,
    epsilon: float = DEFAULT_EPSILON,
    rules: CalibrationRules = CalibrationRules(),
) -> CreditCurve:
    """The whole step from a judge's reply to the value curve and its rise segments."""
    epsilon = validate_epsilon(epsilon)
    annotated, critical = parse_annotations(reply, num_turns, rules)
    values = interpolate(annotated, num_turns)
    return CreditCurve(
        tuple(values), tuple(rise_segments(values, epsilon)), epsilon, critical, annotated
    )
