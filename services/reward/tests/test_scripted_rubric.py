"""The scripted rubric grader: GradeRubric with a judge of kind scripted, through the real
server on loopback (and its grades in process for the finer cases)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import grpc
import pytest

from orchard.core.errors import error_info
from orchard.reward.rubric import DEFAULT_RUBRIC
from orchard.reward.scripted_rubric import actions_of, grade_scripted, task_files
from orchard.reward.v1 import reward_service_pb2 as api
from orchard.reward.v1 import reward_service_pb2_grpc
from orchard.types.v1 import reward_pb2, trajectory_pb2

TASK = "`pick_trips(24)` returns False, but the rule is 'at least 24'. Fix src/quarry0/rules.py."
VERIFICATION = ("R2", "R3", "R4", "R5", "R6", "R7")


Step = tuple[str, dict[str, Any], str]
"""A tool call (name, arguments) and what the next turn saw."""


def _trajectory(steps: Sequence[Step], task: str = TASK) -> trajectory_pb2.Trajectory:
    message = trajectory_pb2.Trajectory(id="t", task_id="rules-0", rollout_id="r")
    seen = task
    for index, (tool, arguments, observation) in enumerate(steps):
        turn = message.turns.add(index=index, kind=trajectory_pb2.TURN_KIND_POLICY, input_text=seen)
        turn.tool_calls.add(name=tool, arguments_json=json.dumps(arguments))
        seen = observation
    return message


def _bash(command: str, observation: str = "exit code 0") -> Step:
    return ("bash", {"command": command}, observation)


SUBMIT: Step = ("submit", {}, "")
VERIFIED = _trajectory(
    [
        _bash("cat src/*/rules.py"),
        _bash("python -m pytest -q", "exit code 1\n1 failed, 2 passed in 0.1s"),
        _bash("sed -i 's/value > /value >= /' src/*/rules.py"),
        _bash("python -m pytest -q", "exit code 0\n3 passed in 0.1s"),
        _bash("git diff"),
        SUBMIT,
    ]
)
UNTESTED = _trajectory(
    [
        _bash("cat src/*/rules.py"),
        _bash("sed -i 's/value > /value >= /' src/*/rules.py"),
        SUBMIT,
    ]
)


async def _grade(
    scripted_stub: reward_service_pb2_grpc.RewardServiceStub,
    trajectory: trajectory_pb2.Trajectory,
    judge: str = "scripted",
    dimensions: Sequence[api.RubricDimension] = (),
) -> reward_pb2.Reward:
    request = api.GradeRubricRequest(
        trajectory=trajectory, task=TASK, judge=judge, dimensions=dimensions
    )
    reply = await scripted_stub.GradeRubric(request, timeout=10)
    return reply.reward


def _verification(reward: reward_pb2.Reward) -> float:
    weight = {d.id: d.weight for d in DEFAULT_RUBRIC}
    return sum(weight[d] * reward.components[d] for d in VERIFICATION)


async def test_editing_then_testing_scores_higher_on_self_verification(
    scripted_stub: reward_service_pb2_grpc.RewardServiceStub,
) -> None:
    verified = await _grade(scripted_stub, VERIFIED)
    untested = await _grade(scripted_stub, UNTESTED)
    for reward in (verified, untested):
        assert reward.status == reward_pb2.REWARD_STATUS_SCORED
        assert reward.scorer == "rubric" and "stand-in for a judge model" in reward.detail
        assert sorted(reward.components) == [d.id for d in DEFAULT_RUBRIC]
    # The same patch on the task's file: patch quality alike, self-verification apart.
    assert verified.components["R1"] == untested.components["R1"] == 1.0
    assert _verification(verified) > _verification(untested) + 0.5
    assert verified.value > untested.value
    assert verified.components["R2"] == 1.0 and untested.components["R2"] == 0.25
    assert verified.components["R6"] == 1.0 and untested.components["R6"] == 0.0
    assert verified.components["R7"] == 1.0 and untested.components["R7"] == 0.0
    # The weighted mean of the components, by the default weights.
    weight = {d.id: d.weight for d in DEFAULT_RUBRIC}
    assert verified.value == pytest.approx(
        sum(weight[k] * v for k, v in verified.components.items())
    )
    # Deterministic: the same trajectory, the same reward.
    assert await _grade(scripted_stub, VERIFIED) == verified


async def test_the_evidence_cites_the_turns_it_rests_on(
    scripted_stub: reward_service_pb2_grpc.RewardServiceStub,
) -> None:
    reward = await _grade(scripted_stub, VERIFIED)
    cited = {e.title.split()[0]: e for e in reward.evidence}
    assert set(cited) == {d.id for d in DEFAULT_RUBRIC}
    expected = {"R1": 2, "R2": 1, "R3": 1, "R6": 3, "R7": 4}
    for dimension, turn in expected.items():
        evidence = cited[dimension]
        assert evidence.turn_index == turn, evidence
        assert evidence.text.startswith(f"turn {turn}: `"), evidence.text
    assert "src/quarry0/rules.py" in cited["R1"].text
    assert "fails before any edit" in cited["R2"].text
    # Nothing to cite: the whole trajectory (-1), said so.
    assert cited["R4"].turn_index == -1 and "no edit touches a test file" in cited["R4"].text


async def test_a_request_chooses_its_judge(
    scripted_stub: reward_service_pb2_grpc.RewardServiceStub,
) -> None:
    # Empty: the configured default, a model judge that cannot be reached: excluded, not 0.
    default = await _grade(scripted_stub, VERIFIED, judge="")
    assert default.status == reward_pb2.REWARD_STATUS_EXCLUDED
    assert default.exclusion == reward_pb2.EXCLUSION_REASON_JUDGE_UNAVAILABLE
    named = await _grade(scripted_stub, VERIFIED, judge="model")
    assert named.exclusion == reward_pb2.EXCLUSION_REASON_JUDGE_UNAVAILABLE
    scripted = await _grade(scripted_stub, VERIFIED, judge="scripted")
    assert scripted.status == reward_pb2.REWARD_STATUS_SCORED


async def test_a_rubric_of_default_ids_without_text_is_graded_on_those_only(
    scripted_stub: reward_service_pb2_grpc.RewardServiceStub,
) -> None:
    dimensions = [
        api.RubricDimension(id="R1", weight=0.5),
        api.RubricDimension(id="R6", weight=0.5),
    ]
    reward = await _grade(scripted_stub, UNTESTED, dimensions=dimensions)
    assert dict(reward.components) == {"R1": 1.0, "R6": 0.0}
    assert reward.value == pytest.approx(0.5)


async def _code(call: Any) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    info = error_info(caught.value)
    return caught.value.code(), caught.value.details() or "", info.reason if info else ""


async def test_requests_it_cannot_answer_are_refused_with_the_fix(
    scripted_stub: reward_service_pb2_grpc.RewardServiceStub,
) -> None:
    def request(judge: str = "scripted", **fields: Any) -> api.GradeRubricRequest:
        fields.setdefault("trajectory", VERIFIED)
        return api.GradeRubricRequest(judge=judge, task=TASK, **fields)

    custom = [api.RubricDimension(id="Q1", text="The agent was polite.", weight=1.0)]
    textless = [api.RubricDimension(id="Q2", weight=1.0)]
    halves = [api.RubricDimension(id="R1", weight=0.5), api.RubricDimension(id="R2", weight=0.4)]
    cases = [
        (request(judge="oracle"), "unknown judge 'oracle'; configured judges: model, scripted"),
        (request(judge="builtin:gui-state"), "answers JudgeOutcome only"),
        (request(dimensions=custom), "grades the default rubric's dimensions (R1, R2, R3, R4"),
        (request(dimensions=textless), "'Q2' has no text and the configured rubric has no"),
        (request(dimensions=halves), "must sum to 1, they sum to 0.9"),
        (request(trajectory=trajectory_pb2.Trajectory(id="e")), "the trajectory is empty"),
    ]
    for call, message in cases:
        code, details, reason = await _code(scripted_stub.GradeRubric(call))
        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"), details
        assert message in details, details
    # A model judge takes any dimension with text (it is only unreachable here).
    reward = await _grade(scripted_stub, VERIFIED, judge="model", dimensions=custom)
    assert reward.exclusion == reward_pb2.EXCLUSION_REASON_JUDGE_UNAVAILABLE


def test_edits_of_test_files_and_off_task_files_lower_patch_quality() -> None:
    def patch_quality(*steps: Step) -> float:
        result = grade_scripted(_trajectory([*steps, SUBMIT]), task=TASK, dimensions=DEFAULT_RUBRIC)
        return result.components["R1"]

    assert patch_quality(_bash("sed -i 's/a/b/' src/quarry0/rules.py")) == 1.0
    assert (
        patch_quality(("edit", {"path": "src/quarry0/rules.py", "old": "a", "new": "b"}, "")) == 1.0
    )
    assert patch_quality(_bash("sed -i 's/a/b/' src/*/rules.py tests/test_rules.py")) == 0.6
    assert patch_quality(_bash("echo 'assert True' > tests/test_rules.py")) == 0.0
    assert patch_quality(_bash("sed -i 's/a/b/' src/quarry0/other.py")) == 0.4
    assert patch_quality(_bash("cat src/quarry0/rules.py")) == 0.0  # no edit, no patch


def test_a_failing_last_run_and_an_own_check_are_told_apart() -> None:
    stopped = _trajectory(
        [
            _bash("sed -i 's/a/b/' src/*/rules.py"),
            _bash("python -m pytest -q", "exit code 1\n1 failed"),
            SUBMIT,
        ]
    )
    checked = _trajectory(
        [
            _bash("sed -i 's/a/b/' src/*/rules.py"),
            _bash("python -c 'from quarry0.rules import pick_trips; print(pick_trips(24))'"),
            _bash("python -m pytest -q tests/test_rules.py::test_limit", "exit code 0"),
            SUBMIT,
        ]
    )
    stopped_grades = grade_scripted(stopped, task=TASK, dimensions=DEFAULT_RUBRIC).components
    checked_grades = grade_scripted(checked, task=TASK, dimensions=DEFAULT_RUBRIC).components
    assert stopped_grades["R6"] == 0.25 and checked_grades["R6"] == 1.0
    assert stopped_grades["R5"] == 0.5 and checked_grades["R5"] == 1.0


def test_it_reads_tool_calls_only_and_skips_auxiliary_turns() -> None:
    message = _trajectory([_bash("python -m pytest -q", "exit code 0"), SUBMIT])
    message.turns[0].kind = trajectory_pb2.TURN_KIND_AUXILIARY
    message.turns[1].output_text = "I ran `python -m pytest` and it passed."
    kinds = [(a.turn, a.kind) for a in actions_of(message)]
    assert kinds == [(1, "submit")]
    assert task_files(TASK) == ("src/quarry0/rules.py",)
