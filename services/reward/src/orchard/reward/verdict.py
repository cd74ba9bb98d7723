"""An LLM judge's verdict on an open-ended task, read strictly.

The judge answers ``{"success": true|false, "reason": "..."}``. A reply without such an
object, or with a non-boolean ``success``, is malformed: the caller retries, and after the last
attempt the reward is EXCLUDED (judge unavailable), never scored 0.

Two reward variants: *binary* (+1 success, -1 failure) and *format*, for GUI episodes: -1 when
the episode ended from repeated format failures (the policy's own output failed to parse at
least the limit's number of times), +1 for a success in which every assistant turn parsed, 0
otherwise (a failure, or a success with some unparsed turns).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from orchard.reward.judge_json import MalformedJudgeOutput, extract_json_object
from orchard.reward.outcome import Evidence, Exclusion, ScoreResult, excluded, scored

__all__ = ["Verdict", "parse_verdict", "score_verdicts", "verdict_reward"]

SCORER = "judge"


@dataclass(frozen=True)
class Verdict:
    """A well-formed verdict."""

    success: bool
    reason: str


def parse_verdict(reply: str) -> Verdict:
    """The verdict in ``reply``, or :class:`MalformedJudgeOutput`."""
    verdict = extract_json_object(reply)
    success = verdict.get("success")
    if not isinstance(success, bool):
        raise MalformedJudgeOutput(f'"success" must be true or false, got {success!r}')
    reason = verdict.get("reason", "")
    if not isinstance(reason, str):
        raise MalformedJudgeOutput(f'"reason" must be a string, got {reason!r}')
    return Verdict(success, reason)


def verdict_reward(
    verdict: Verdict | None,
    *,
    evidence: tuple[Evidence, ...] = (),
    attempts: int = 1,
    format_variant: bool = False,
    policy_format_failures: int = 0,
    format_failure_limit: int = 3,
    why_none: str = "no well-formed verdict",
    scorer: str = SCORER,
) -> ScoreResult:
    """The reward of one decided verdict; None (no usable verdict) is EXCLUDED with ``why_none``.

    Binary: +1 success, -1 failure. ``format_variant``: -1 when the policy's actions failed to
    parse at least ``format_failure_limit`` times (success or not), else +1 for a success with
    no failure at all, else 0.
    """
    if verdict is None:
        return excluded(scorer, Exclusion.JUDGE_UNAVAILABLE, why_none, evidence=evidence)
    if not format_variant:
        value = 1.0 if verdict.success else -1.0
    elif policy_format_failures >= format_failure_limit:
        value = -1.0
    else:
        value = 1.0 if verdict.success and policy_format_failures == 0 else 0.0
    return scored(
        scorer,
        value,
        detail=("success" if verdict.success else "failure") + f": {verdict.reason}",
        components={
            "attempts": float(attempts),
            "policy_format_failures": float(policy_format_failures),
        },
        evidence=evidence,
    )


def score_verdicts(
    replies: Sequence[str],
    *,
    format_variant: bool = False,
    policy_format_failures: int = 0,
    format_failure_limit: int = 3,
) -> ScoreResult:
    """The reward from the judge's replies, one per attempt, in order: the first well-formed
    one decides; with none the reward is EXCLUDED, so the policy is never blamed for the judge.
    """
    evidence: list[Evidence] = []
    verdict: Verdict | None = None
    attempts = 0
    for attempts, reply in enumerate(replies, start=1):
        try:
            verdict = parse_verdict(reply)
        except MalformedJudgeOutput as exc:
            title = f"attempt {attempts}: malformed verdict"
            evidence.append(Evidence.of(title, f"{exc}\n{reply}"))
            continue
        evidence.append(Evidence.of(f"attempt {attempts}: verdict", reply))
        break
    return verdict_reward(
        verdict,
        evidence=tuple(evidence),
        attempts=attempts,
        format_variant=format_variant,
        policy_format_failures=policy_format_failures,
        format_failure_limit=format_failure_limit,
        why_none=f"no well-formed verdict in {len(replies)} attempt(s)",
    )
