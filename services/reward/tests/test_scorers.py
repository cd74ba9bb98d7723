"""Rubric, task score and judge verdicts on hand-built cases."""

from __future__ import annotations

import json
import math

import pytest

from orchard.core.errors import OrchardError
from orchard.reward.judge_json import MalformedJudgeOutput, extract_json_object
from orchard.reward.outcome import Exclusion
from orchard.reward.rubric import DEFAULT_RUBRIC, Dimension, combine, parse_grades, validate_rubric
from orchard.reward.task_score import task_score
from orchard.reward.verdict import Verdict, parse_verdict, score_verdicts, verdict_reward


def test_default_rubric_is_valid_with_085_on_self_verification() -> None:
    validate_rubric(DEFAULT_RUBRIC)
    assert [d.id for d in DEFAULT_RUBRIC] == [f"R{i}" for i in range(1, 8)]
    assert math.fsum(d.weight for d in DEFAULT_RUBRIC[1:]) == pytest.approx(0.85)


@pytest.mark.parametrize(
    ("dimensions", "message"),
    [
        ((), "at least one"),
        ((Dimension("a", "", 0.5), Dimension("b", "", 0.4)), "sum to 0.9"),
        ((Dimension("a", "", 0.5), Dimension("a", "", 0.5)), "appears twice"),
        ((Dimension("a", "", 1.5), Dimension("b", "", -0.5)), "weight must lie"),
        ((Dimension("", "", 1.0),), "needs an id"),
    ],
)
def test_bad_rubrics_are_invalid_argument(dimensions: tuple[Dimension, ...], message: str) -> None:
    with pytest.raises(OrchardError, match=message):
        validate_rubric(dimensions)


def grades_reply(scores: dict[str, float], prose: str = "") -> str:
    body = {
        "grades": {
            k: {"score": v, "evidence": f"turn shows {k}", "turn": 1} for k, v in scores.items()
        }
    }
    return prose + json.dumps(body)


def test_rubric_weighted_mean_matches_a_direct_computation() -> None:
    dims = (Dimension("a", "x", 0.2), Dimension("b", "y", 0.3), Dimension("c", "z", 0.5))
    grades = parse_grades(grades_reply({"a": 1.0, "b": 0.5, "c": 0.2}, "Here: "), dims, 3)
    result = combine(dims, grades)
    assert result.value == pytest.approx(0.2 * 1.0 + 0.3 * 0.5 + 0.5 * 0.2)
    assert result.components == {"a": 1.0, "b": 0.5, "c": 0.2}
    assert [e.turn_index for e in result.evidence] == [1, 1, 1]


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        ("no json here", "no JSON object"),
        ('{"grades": []}', '"grades" object'),
        (grades_reply({"a": 1.0, "b": 0.5}), "dimension c is not graded"),
        (grades_reply({"a": 1.0, "b": 0.5, "c": 1.2}), r"in \[0, 1\]"),
        ('{"grades": {"a": {"score": 1}, "b": {"score": 1}, "c": {"score": 1}}}', "no evidence"),
    ],
)
def test_malformed_grades(reply: str, message: str) -> None:
    dims = (Dimension("a", "x", 0.2), Dimension("b", "y", 0.3), Dimension("c", "z", 0.5))
    with pytest.raises(MalformedJudgeOutput, match=message):
        parse_grades(reply, dims, 3)


def test_task_score_formula_and_threshold() -> None:
    result = task_score(safety=1.0, completion=0.75, robustness=1.0)
    assert result.value == pytest.approx(0.8)
    assert result.components["passed"] == 1.0
    edge = task_score(safety=1.0, completion=0.8125, robustness=0.5)
    assert edge.value == pytest.approx(0.75)
    assert edge.components["passed"] == 1.0
    unsafe = task_score(safety=0.0, completion=1.0, robustness=1.0)
    assert unsafe.value == 0.0
    assert unsafe.components["passed"] == 0.0
    with pytest.raises(OrchardError, match="completion must lie"):
        task_score(safety=1.0, completion=1.1, robustness=1.0)


def test_json_extraction_skips_braces_in_prose_and_strings() -> None:
    text = 'Thinking {not json} then ```json\n{"success": true, "reason": "a } b"}\n``` done'
    assert extract_json_object(text) == {"success": True, "reason": "a } b"}
    with pytest.raises(MalformedJudgeOutput):
        extract_json_object("[1, 2, 3]")


def test_verdicts_binary_and_format_variants() -> None:
    ok = score_verdicts(['{"success": true, "reason": "done"}'])
    assert (ok.value, ok.is_scored) == (1.0, True)
    fail = score_verdicts(['{"success": false, "reason": "wrong page"}'])
    assert fail.value == -1.0
    fmt_fail = score_verdicts(['{"success": false}'], format_variant=True)
    assert fmt_fail.value == 0.0
    fmt_bad = score_verdicts(['{"success": false}'], format_variant=True, policy_format_failures=3)
    assert fmt_bad.value == -1.0
    # A success counts +1 only when every turn parsed, and -1 once the failures reach the limit.
    success = Verdict(True, "done")
    by_failures = {
        n: verdict_reward(success, format_variant=True, policy_format_failures=n).value
        for n in (0, 1, 2, 3, 4)
    }
    assert by_failures == {0: 1.0, 1: 0.0, 2: 0.0, 3: -1.0, 4: -1.0}
    limit_one = verdict_reward(
        success, format_variant=True, policy_format_failures=1, format_failure_limit=1
    )
    assert limit_one.value == -1.0
    assert verdict_reward(success, policy_format_failures=5).value == 1.0  # binary ignores them


def test_malformed_verdicts_are_retried_then_excluded_never_zero() -> None:
    later = score_verdicts(["garbage", '{"success": "yes"}', '{"success": true}'])
    assert later.value == 1.0
    assert later.components["attempts"] == 3.0
    none = score_verdicts(["garbage", "{}", '{"success": 1}'], format_variant=True)
    assert not none.is_scored
    assert none.exclusion is Exclusion.JUDGE_UNAVAILABLE
    assert len(none.evidence) == 3
    down = verdict_reward(None, why_none="judge at 127.0.0.1:1: connection refused")
    assert down.exclusion is Exclusion.JUDGE_UNAVAILABLE
    assert "connection refused" in down.detail
    with pytest.raises(MalformedJudgeOutput, match='"reason" must be a string'):
        parse_verdict('{"success": true, "reason": 3}')
