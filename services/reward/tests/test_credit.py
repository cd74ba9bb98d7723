"""Credit assignment: annotation checks, interpolation and rise segments on hand-built cases."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orchard.core.errors import OrchardError, Reason
from orchard.reward.credit import (
    CalibrationRules,
    TurnSpan,
    credit_curve,
    interpolate,
    parse_annotations,
    require_failed,
    rise_segments,
    validate_success_threshold,
)
from orchard.reward.judge_json import MalformedJudgeOutput
from orchard.types.v1 import reward_pb2, trajectory_pb2


def reply(values: dict[int, float], critical: int | None = None, prose: str = "") -> str:
    body: dict[str, object] = {"values": [{"turn": t, "value": v} for t, v in values.items()]}
    if critical is not None:
        body["critical_turn"] = critical
    return f"{prose}{json.dumps(body)}{prose}"


def test_all_flat_curve_has_no_rise() -> None:
    assert rise_segments([0.4, 0.4, 0.4, 0.4]) == []


def test_single_step_rise() -> None:
    assert rise_segments([0.4, 0.4, 0.5, 0.5, 0.1]) == [TurnSpan(2, 2)]


def test_rise_to_the_last_step() -> None:
    assert rise_segments([0.3, 0.3, 0.4, 0.5]) == [TurnSpan(2, 3)]


def test_maximal_runs_split_by_a_flat_or_small_step() -> None:
    values = [0.3, 0.4, 0.5, 0.52, 0.6, 0.7, 0.1]
    assert rise_segments(values, 0.05) == [TurnSpan(1, 2), TurnSpan(4, 5)]
    # A climb of exactly epsilon counts.
    assert rise_segments([0.3, 0.35], 0.05) == [TurnSpan(1, 1)]
    assert rise_segments([0.3, 0.34], 0.05) == []


def test_empty_and_one_turn_curves() -> None:
    """A one-turn trajectory has no rise segment: turn 0 has no earlier value to rise from."""
    assert rise_segments([]) == []
    assert rise_segments([0.4]) == []
    assert rise_segments([1.0]) == []


def test_turn_0_never_gets_credit_and_a_rise_at_turn_1_starts_a_segment() -> None:
    # However high the value after turn 0, turn 0 itself never rises.
    assert rise_segments([0.9, 0.9, 0.9]) == []
    assert rise_segments([0.0, 1.0]) == [TurnSpan(1, 1)]
    assert rise_segments([0.3, 0.4, 0.5, 0.1]) == [TurnSpan(1, 2)]
    # The same through the whole step: a judge's curve over one turn gives no segment.
    curve = credit_curve(reply({0: 0.4}), 1, rules=CalibrationRules(end_below=0.5))
    assert (curve.values, curve.rise_segments) == ((0.4,), ())


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([0.3, float("nan")], r"the value at turn 1 must lie in \[0, 1\], got nan"),
        ([0.3, float("inf")], r"turn 1 must lie in \[0, 1\], got inf"),
        ([float("-inf"), 0.3], r"turn 0 must lie in \[0, 1\]"),
        ([0.3, 1.2], r"turn 1 must lie in \[0, 1\], got 1.2"),
        ([-0.1, 0.3], r"turn 0 must lie in \[0, 1\], got -0.1"),
        ([0.3, None], r"the value at turn 1 must be a number in \[0, 1\], got None"),
        ([0.3, "0.5"], r"turn 1 must be a number"),
        ([True, 0.5], r"turn 0 must be a number"),
        (None, "values must be a sequence of numbers, got None"),
    ],
)
def test_rise_segments_refuses_values_that_are_not_probabilities(values: Any, message: str) -> None:
    with pytest.raises(OrchardError, match=message) as caught:
        rise_segments(values)
    assert caught.value.reason is Reason.INVALID_ARGUMENT


@pytest.mark.parametrize("epsilon", [0, 0.0, -0.05, 1.0, 1.5, float("nan"), float("inf"), None])
def test_rise_segments_refuses_an_epsilon_outside_0_1(epsilon: Any) -> None:
    with pytest.raises(OrchardError, match="epsilon must") as caught:
        rise_segments([0.3, 0.5], epsilon)
    assert caught.value.reason is Reason.INVALID_ARGUMENT


def test_the_success_threshold_decides_what_may_get_credit() -> None:
    row = trajectory_pb2.Trajectory(id="r1")
    row.reward.status = reward_pb2.REWARD_STATUS_SCORED
    row.reward.value = 0.5
    # At the threshold it succeeded (the one rule: reward >= threshold); below it, failed.
    with pytest.raises(OrchardError, match=r"succeeded \(reward 0.5 is at or above"):
        require_failed(row, validate_success_threshold(None))
    require_failed(row, 0.51)
    row.reward.value = 0.4999
    require_failed(row, 0.5)
    # Without a scored reward the caller's word stands.
    require_failed(trajectory_pb2.Trajectory(id="r2"), 0.0)
    assert validate_success_threshold(None) == 0.5
    assert validate_success_threshold(0.0) == 0.0
    for bad in (-0.1, 1.1, float("nan"), float("inf")):
        with pytest.raises(OrchardError, match=r"success_threshold must lie in \[0, 1\]"):
            validate_success_threshold(bad)


def test_interpolation_is_linear_between_annotated_turns() -> None:
    assert interpolate({0: 0.4, 4: 0.0}, 5) == pytest.approx([0.4, 0.3, 0.2, 0.1, 0.0])
    assert interpolate({0: 0.4, 2: 0.6, 3: 0.1}, 4) == pytest.approx([0.4, 0.5, 0.6, 0.1])


def test_a_full_curve_from_a_reply_with_extra_text() -> None:
    text = reply({0: 0.4, 2: 0.6, 3: 0.1, 5: 0.05}, critical=3, prose="Reasoning... ")
    curve = credit_curve(text, 6, epsilon=0.05)
    assert curve.values == pytest.approx((0.4, 0.5, 0.6, 0.1, 0.075, 0.05))
    assert curve.rise_segments == (TurnSpan(1, 2),)
    assert curve.critical_turn == 3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("I think the agent did fine.", "no JSON object"),
        ("", "no JSON object"),
        (reply({0: 0.4, 3: 1.5}), r"in \[0, 1\]"),
        (reply({0: 0.4, 3: -0.1}), r"in \[0, 1\]"),
        (reply({0: 0.4, 7: 0.1}), "turn must be an integer"),
        ('{"values": [{"turn": 0, "value": "high"}]}', "must be a number"),
        ('{"values": []}', "non-empty"),
        (reply({0: 0.4, 2: 0.1}), r"first \(0\) and last \(3\)"),
        (reply({0: 0.8, 3: 0.1}), "turn 0 must lie"),
        (reply({0: 0.4, 3: 0.5}), "last turn must be below"),
        (reply({0: 0.4, 1: 0.5, 2: 0.6, 3: 0.1}, critical=1), "drop at the critical turn 1"),
        (reply({0: 0.4, 3: 0.1}, critical=9), "critical_turn must be"),
        ('{"values": [{"turn": 0, "value": 0.4}, {"turn": 0, "value": 0.4}]}', "twice"),
    ],
)
def test_unusable_annotations_are_malformed(text: str, message: str) -> None:
    with pytest.raises(MalformedJudgeOutput, match=message):
        parse_annotations(text, 4)


def test_calibration_rules_are_configurable() -> None:
    loose = CalibrationRules(start_low=0.0, start_high=1.0, end_below=1.01)
    annotated, _ = parse_annotations(reply({0: 0.9, 3: 0.9}), 4, loose)
    assert annotated == {0: 0.9, 3: 0.9}


def test_bad_request_input_is_invalid_argument() -> None:
    with pytest.raises(OrchardError, match="no turns"):
        parse_annotations(reply({0: 0.4}), 0)
    for epsilon in (-0.1, 1.0, 2.0, float("nan")):
        with pytest.raises(OrchardError, match="epsilon must lie"):
            credit_curve(reply({0: 0.4, 3: 0.1}), 4, epsilon=epsilon)
    assert credit_curve(reply({0: 0.4, 3: 0.1}), 4, epsilon=0).epsilon == 0.05
