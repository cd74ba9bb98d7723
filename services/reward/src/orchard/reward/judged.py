"""The judge-backed scorers: outcome verdicts, rubric grades and credit assignment.

Each builds the question, asks a :class:`~orchard.reward.judge_client.Judge` with a
strict parser, and turns the answer into a :class:`~orchard.reward.outcome.ScoreResult` (or a
credit curve). When no attempt gives a usable answer the result is EXCLUDED with every
attempt's problem in its evidence.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orchard.core.errors import OrchardError, Reason
from orchard.reward.credit import (
    DEFAULT_EPSILON,
    CalibrationRules,
    CreditCurve,
    credit_curve,
    validate_epsilon,
)
from orchard.reward.judge_client import Judge, JudgeAnswer, image_data_url
from orchard.reward.outcome import Evidence, Exclusion, ScoreResult, excluded
from orchard.reward.rubric import DEFAULT_RUBRIC, Dimension, combine, parse_grades, validate_rubric
from orchard.reward.verdict import parse_verdict, verdict_reward

__all__ = [
    "CreditAnswer",
    "TranscriptStep",
    "assign_credit",
    "grade_rubric",
    "judge_outcome",
    "require_outcome_inputs",
]

DEFAULT_LAST_SCREENSHOTS = 3


@dataclass(frozen=True)
class TranscriptStep:
    """One turn of a trajectory as a judge reads it: what the agent did and what it saw."""

    action: str
    observation: str = ""


def _transcript(steps: Sequence[TranscriptStep]) -> str:
    return "\n\n".join(
        f"### Turn {index}\nAction:\n{step.action}\nObservation:\n{step.observation or '(none)'}"
        for index, step in enumerate(steps)
    )


def require_outcome_inputs(intent: str, policy_format_failures: int) -> None:
    """INVALID_ARGUMENT for what no outcome judge (a model or the state judge) accepts."""
    if not intent.strip():
        raise OrchardError(Reason.INVALID_ARGUMENT, "intent is empty: the judge needs the task")
    if policy_format_failures < 0:
        raise OrchardError(
            Reason.INVALID_ARGUMENT,
            f"policy_format_failures must not be negative, got {policy_format_failures}",
        )


def _problems(answer: JudgeAnswer[Any]) -> tuple[Evidence, ...]:
    return tuple(Evidence.of("judge attempt", problem) for problem in answer.problems)


async def judge_outcome(
    judge: Judge,
    *,
    intent: str,
    final_response: str,
    screenshots: Sequence[bytes] = (),
    last_screenshots: int = DEFAULT_LAST_SCREENSHOTS,
    format_variant: bool = False,
    policy_format_failures: int = 0,
    format_failure_limit: int = 3,
) -> ScoreResult:
    """Was the open-ended task achieved? +1 / -1 (or the format variant), else EXCLUDED."""
    require_outcome_inputs(intent, policy_format_failures)
    shown = screenshots[len(screenshots) - last_screenshots :] if last_screenshots > 0 else []
    try:
        images = [image_data_url(shot) for shot in shown]
    except ValueError as exc:
        raise OrchardError(Reason.INVALID_ARGUMENT, str(exc)) from exc
    content: list[dict[str, Any]] = [
        {
            "type": "text",
            "text": (
                f"Task given to a web agent:\n{intent}\n\nThe agent's final response:\n"
                f"{final_response or '(none)'}\n\nThe last {len(images)} screenshot(s) follow, "
                "oldest first. Decide whether the task was achieved. Answer with one JSON "
                'object only: {"success": true or false, "reason": "<one sentence>"}.'
            ),
        },
        *({"type": "image_url", "image_url": {"url": url}} for url in images),
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You judge whether an agent achieved a task. Be strict."},
        {"role": "user", "content": content},
    ]
    answer = await judge.ask(messages, parse_verdict)
    evidence = _problems(answer)
    if answer.value is not None:
        evidence += (Evidence.of(f"attempt {answer.attempts}: verdict", answer.replies[-1]),)
    reached = "unreachable" if not answer.replies else "gave no well-formed verdict"
    return verdict_reward(
        answer.value,
        evidence=evidence,
        attempts=answer.attempts,
        format_variant=format_variant,
        policy_format_failures=policy_format_failures,
        format_failure_limit=format_failure_limit,
        why_none=f"judge {judge.model} {reached} in {answer.attempts} attempt(s)",
    )


async def grade_rubric(
    judge: Judge,
    steps: Sequence[TranscriptStep],
    *,
    task: str,
    dimensions: Sequence[Dimension] = DEFAULT_RUBRIC,
) -> ScoreResult:
    """The rubric reward of a whole trajectory, or EXCLUDED when the grader gives no grades."""
    if not steps:
        raise OrchardError(Reason.INVALID_ARGUMENT, "the trajectory is empty: nothing to grade")
    rubric = validate_rubric(dimensions)
    listing = "\n".join(f"- {d.id}: {d.text}" for d in rubric)
    example = {d.id: {"score": 0.5, "evidence": "<quote>", "turn": 0} for d in rubric[:1]}
    messages = [
        {"role": "system", "content": "You grade an agent's trajectory against a rubric."},
        {
            "role": "user",
            "content": (
                f"Task:\n{task}\n\nRubric dimensions:\n{listing}\n\nTrajectory:\n"
                f"{_transcript(steps)}\n\nGrade every dimension from 0.0 to 1.0 and cite the "
                "evidence (a quote from the trajectory and its turn, -1 for the whole). Answer "
                f'with one JSON object only: {{"grades": {json.dumps(example)[:-1]}, ...}}}}.'
            ),
        },
    ]
    answer = await judge.ask(messages, lambda reply: parse_grades(reply, rubric, len(steps)))
    if answer.value is None:
        return excluded(
            "rubric",
            Exclusion.JUDGE_UNAVAILABLE,
            f"no usable grades in {len(answer.problems)} attempt(s)",
            evidence=_problems(answer),
        )
    return combine(rubric, answer.value)


@dataclass(frozen=True)
class CreditAnswer:
    """A credit curve, or why there is none (the trajectory then trains on nothing)."""

    curve: CreditCurve | None
    exclusion: ScoreResult | None


async def assign_credit(
    judge: Judge,
    steps: Sequence[TranscriptStep],
    *,
    task: str,
    failure: str,
    epsilon: float = DEFAULT_EPSILON,
    rules: CalibrationRules | None = None,
) -> CreditAnswer:
    """Ask the judge for P(resolve) along a failed trajectory and derive its rise segments."""
    if not steps:
        raise OrchardError(Reason.INVALID_ARGUMENT, "the trajectory is empty: nothing to assign")
    epsilon = validate_epsilon(epsilon)
    rules = rules or CalibrationRules()
    last = len(steps) - 1
    messages = [
        {
            "role": "system",
            "content": "You estimate, in hindsight, how likely an agent was to solve its task.",
        },
        {
            "role": "user",
            "content": (
                f"Task:\n{task}\n\nThis attempt FAILED: {failure}\n\nTrajectory:\n"
                f"{_transcript(steps)}\n\nReason backward from the known failure. Estimate "
                "P(resolve) after key turns. Rules: turn 0 lies in "
                f"[{rules.start_low}, {rules.start_high}]; the value drops at the critical "
                f"error; turn {last} (the last) is below {rules.end_below}. Annotate at least "
                "turns 0 and the last; values between are interpolated. Answer with one JSON "
                'object only: {"values": [{"turn": 0, "value": 0.4}, ...], '
                '"critical_turn": <turn of the critical error>}.'
            ),
        },
    ]
    answer = await judge.ask(
        messages, lambda reply: credit_curve(reply, len(steps), epsilon=epsilon, rules=rules)
    )
    if answer.value is None:
        return CreditAnswer(
            None,
            excluded(
                "credit",
                Exclusion.JUDGE_UNAVAILABLE,
                f"no usable value curve in {len(answer.problems)} attempt(s)",
                evidence=_problems(answer),
            ),
        )
    return CreditAnswer(answer.value, None)
