"""Credit assignment: annotation checks, interpolation and rise segments on hand-built cases."""

from __future__ import annotations

import json

import pytest

from orchard.core.errors import OrchardError
from orchard.reward.credit import (
    CalibrationRules,
    TurnSpan,
    credit_curve,
    interpolate,
    parse_annotations,
    rise_segments,
)
from orchard.reward.judge_json import MalformedJudgeOutput


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
    assert rise_segments([]) == []
    assert rise_segments([0.4]) == []


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
