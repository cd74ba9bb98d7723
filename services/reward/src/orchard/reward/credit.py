"""Retrospective credit assignment for failed trajectories.

A judge model that knows the trajectory failed annotates P(resolve) at key turns under
calibration rules; the annotation is validated, interpolated linearly to one value per turn,
and the *rise segments* (maximal runs of turns that raised the value by at least epsilon) are
what SFT may train on in a failed trajectory.

The curve has one value per turn: ``values[t]`` is the estimated chance of resolving the task
after turn ``t``. Turn ``t + 1`` *rises* when ``values[t + 1] - values[t] >= epsilon``; a rise
segment is a maximal run of rising turns, as an inclusive :class:`TurnSpan`.

Turn 0 never receives credit: the curve holds no value before it to rise from (the judge's
value at turn 0 is its estimate *after* that turn, and the calibration rules pin it to an
uncertain start, not to a climb). So a segment starts at turn 1 at the earliest, and a one-turn
trajectory has no rise segment: failed, it carries no SFT loss.

Credit is for failed trajectories: a trajectory whose reward is scored at or above the success
threshold (the one every service shares) succeeded and is refused (:func:`require_failed`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchard.core.errors import OrchardError, Reason
from orchard.core.success import DEFAULT_SUCCESS_THRESHOLD
from orchard.reward.judge_json import MalformedJudgeOutput, extract_json_object, require_probability
from orchard.types.v1 import reward_pb2, trajectory_pb2

__all__ = [
    "DEFAULT_EPSILON",
    "CalibrationRules",
    "CreditCurve",
    "TurnSpan",
    "credit_curve",
    "interpolate",
    "parse_annotations",
    "require_failed",
    "rise_segments",
    "validate_epsilon",
    "validate_success_threshold",
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


def validate_success_threshold(threshold: float | None) -> float:
    """``threshold`` if it lies in [0, 1], else INVALID_ARGUMENT; None means the shared default."""
    if threshold is None:
        return DEFAULT_SUCCESS_THRESHOLD
    if not math.isfinite(threshold) or not 0 <= threshold <= 1:
        raise OrchardError(
            Reason.INVALID_ARGUMENT,
            f"success_threshold must lie in [0, 1] (unset for {DEFAULT_SUCCESS_THRESHOLD}), "
            f"got {threshold}",
        )
    return threshold


def require_failed(trajectory: trajectory_pb2.Trajectory, threshold: float) -> None:
    """INVALID_ARGUMENT when ``trajectory`` succeeded: its reward is scored at or above
    ``threshold``. A trajectory without a scored reward is taken as failed, as its caller says."""
    reward = trajectory.reward
    if reward.status == reward_pb2.REWARD_STATUS_SCORED and reward.value >= threshold:
        raise OrchardError(
            Reason.INVALID_ARGUMENT,
            f"trajectory {trajectory.id!r} succeeded (reward {reward.value:g} is at or above the "
            f"success threshold {threshold:g}): credit assignment is for failed trajectories",
        )


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


def _check_curve(values: Sequence[float], epsilon: float) -> None:
    """INVALID_ARGUMENT unless ``values`` are numbers in [0, 1] and ``epsilon`` lies in (0, 1)."""
    if isinstance(epsilon, bool) or not isinstance(epsilon, int | float):
        raise OrchardError(
            Reason.INVALID_ARGUMENT, f"epsilon must be a number in (0, 1), got {epsilon!r}"
        )
    if not math.isfinite(epsilon) or not 0 < epsilon < 1:
        raise OrchardError(Reason.INVALID_ARGUMENT, f"epsilon must lie in (0, 1), got {epsilon}")
    if values is None or isinstance(values, str | bytes):
        raise OrchardError(
            Reason.INVALID_ARGUMENT, f"values must be a sequence of numbers, got {values!r}"
        )
    for turn, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise OrchardError(
                Reason.INVALID_ARGUMENT,
                f"the value at turn {turn} must be a number in [0, 1], got {value!r}",
            )
        if not math.isfinite(value) or not 0 <= value <= 1:
            raise OrchardError(
                Reason.INVALID_ARGUMENT, f"the value at turn {turn} must lie in [0, 1], got {value}"
            )


def rise_segments(values: Sequence[float], epsilon: float = DEFAULT_EPSILON) -> list[TurnSpan]:
    """Maximal runs of turns ``t >= 1`` with ``values[t] - values[t - 1] >= epsilon``.

    Turn 0 never rises (nothing precedes it), so an empty or one-turn curve has no segment.
    Raises INVALID_ARGUMENT for a value that is None, not a number, NaN, infinite or outside
    [0, 1], and for an ``epsilon`` outside (0, 1), as :func:`credit_curve` does for its input.
    """
    _check_curve(values, epsilon)
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
