"""Between the scorers' plain records and the wire: ``ScoreResult`` → ``Reward``, a
``Trajectory`` → the transcript judges read, a credit curve → ``CreditAssignment``."""

from __future__ import annotations

from orchard.reward.credit import CreditCurve
from orchard.reward.judged import TranscriptStep
from orchard.reward.outcome import Exclusion, ScoreResult
from orchard.reward.test_output import Outcome
from orchard.reward.v1 import reward_service_pb2 as api
from orchard.types.v1 import reward_pb2, trajectory_pb2

__all__ = ["credit_message", "outcome_message", "reward_message", "task_text", "transcript"]

_EXCLUSIONS = {
    Exclusion.SANDBOX_FAILURE: reward_pb2.EXCLUSION_REASON_SANDBOX_FAILURE,
    Exclusion.TIMEOUT: reward_pb2.EXCLUSION_REASON_TIMEOUT,
    Exclusion.JUDGE_UNAVAILABLE: reward_pb2.EXCLUSION_REASON_JUDGE_UNAVAILABLE,
    Exclusion.CAPTCHA_BLOCKED: reward_pb2.EXCLUSION_REASON_CAPTCHA_BLOCKED,
    Exclusion.ABORTED: reward_pb2.EXCLUSION_REASON_ABORTED,
    Exclusion.OTHER: reward_pb2.EXCLUSION_REASON_OTHER,
}
_OUTCOMES = {
    Outcome.PASSED: api.TEST_OUTCOME_PASSED,
    Outcome.FAILED: api.TEST_OUTCOME_FAILED,
    Outcome.ERROR: api.TEST_OUTCOME_ERROR,
    Outcome.SKIPPED: api.TEST_OUTCOME_SKIPPED,
}


def reward_message(result: ScoreResult) -> reward_pb2.Reward:
    """The ``orchard.types.v1.Reward`` of a scorer's result."""
    message = reward_pb2.Reward(
        status=(
            reward_pb2.REWARD_STATUS_SCORED
            if result.is_scored
            else reward_pb2.REWARD_STATUS_EXCLUDED
        ),
        value=result.value if result.is_scored else 0.0,
        exclusion=(
            _EXCLUSIONS[result.exclusion]
            if result.exclusion is not None
            else reward_pb2.EXCLUSION_REASON_UNSPECIFIED
        ),
        detail=result.detail,
        scorer=result.scorer,
        components=result.components,
    )
    for item in result.evidence:
        message.evidence.add(title=item.title, text=item.text, turn_index=item.turn_index)
    return message


def outcome_message(outcome: Outcome | None) -> api.TestOutcome.ValueType:
    """The wire outcome of one listed test; None (not in the report) is UNSPECIFIED."""
    return api.TEST_OUTCOME_UNSPECIFIED if outcome is None else _OUTCOMES[outcome]


def transcript(trajectory: trajectory_pb2.Trajectory) -> list[TranscriptStep]:
    """One step per turn, indices kept (credit and citations refer to them): the turn's
    output and tool calls as the action, the context the next turn added as what it saw."""
    turns = list(trajectory.turns)
    steps: list[TranscriptStep] = []
    for index, turn in enumerate(turns):
        action = turn.output_text
        calls = [f"tool call {call.name}({call.arguments_json})" for call in turn.tool_calls]
        if calls:
            action = "\n".join([action, *calls]) if action else "\n".join(calls)
        if turn.kind == trajectory_pb2.TURN_KIND_AUXILIARY:
            action = f"(auxiliary call, not the policy's action)\n{action}"
        observation = turns[index + 1].input_text if index + 1 < len(turns) else ""
        steps.append(TranscriptStep(action or "(no output)", observation))
    return steps


def task_text(trajectory: trajectory_pb2.Trajectory, given: str) -> str:
    """The task as a judge reads it: ``given``, else the first turn's input text."""
    if given.strip():
        return given
    if trajectory.turns and trajectory.turns[0].input_text.strip():
        return trajectory.turns[0].input_text
    return f"task {trajectory.task_id or '(unnamed)'} (no task text in the trajectory)"


def credit_message(curve: CreditCurve, estimator: str) -> reward_pb2.CreditAssignment:
    message = reward_pb2.CreditAssignment(
        step_values=list(curve.values), epsilon=curve.epsilon, estimator=estimator
    )
    for span in curve.rise_segments:
        message.rise_segments.add(start=span.start, end=span.end)
    return message
