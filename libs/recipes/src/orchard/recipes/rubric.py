"""Rubric-based process reward in RL (``stages.rl.rubric``): the outcome combined with a grade of
how the agent worked.

After an RL step's rollout job, every scored rollout of the step's groups is graded by
orchard-reward's GradeRubric (the judge the recipe names; ``builtin:scripted`` is the service's
scripted rubric grader, a stand-in for a judge model), and the trajectories the trainer gets
carry

    reward = (1 - weight) x outcome + weight x rubric

with the outcome and the rubric kept in the reward's components (``outcome``, ``rubric`` and
each dimension as ``rubric.<id>``). Everything that decides success stays on the outcome: the
sampler, the resolve counts, the step's success share and the groups log. A rollout the judge
does not grade (EXCLUDED, or the call fails for it) is excluded from training, never scored 0,
and counted. Whether a group trains is decided again on the combined rewards: a group whose
outcomes all agree trains when its rubric grades differ.

The functions that combine are pure (:func:`combined_reward`, :func:`shape_group`,
:func:`signal_reason`); :func:`rubric_rewards` is the RL stage's one call.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from orchard.recipes.trails import main_line
from orchard.reward.v1 import reward_service_pb2 as reward_api
from orchard.reward.v1 import reward_service_pb2_grpc
from orchard.sdk.recipe import RlRubric
from orchard.sdk.report import RubricReward, RubricRewardStep
from orchard.types.v1 import reward_pb2, trajectory_pb2

if TYPE_CHECKING:
    from orchard.recipes.stages import StageContext

__all__ = [
    "RUBRIC_LOG",
    "RubricGrade",
    "RubricStep",
    "combined_reward",
    "rubric_report",
    "rubric_rewards",
    "shape_group",
    "signal_reason",
]

RUBRIC_LOG = "rubric.jsonl"
"""Each graded rollout of each RL step, in the RL stage's folder."""
GRADE_TIMEOUT_S = 600.0
# The caller's mistakes, the same for every trajectory: the run stops and says so.
_REFUSED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)


def combined_reward(outcome: float, rubric: float, weight: float) -> float:
    """``(1 - weight) * outcome + weight * rubric``; ``weight`` in (0, 1]."""
    if not 0 < weight <= 1:
        raise ValueError(f"the rubric's weight must lie in (0, 1], got {weight}")
    return (1 - weight) * outcome + weight * rubric


@dataclass(frozen=True)
class RubricGrade:
    """GradeRubric's answer for one rollout: a value with its dimensions, or why none."""

    value: float | None
    components: Mapping[str, float] = field(default_factory=dict)
    excluded: str = ""
    """Why there is no value (e.g. ``judge_unavailable``, ``rpc_unavailable``)."""
    detail: str = ""


def _scored(trajectory: trajectory_pb2.Trajectory) -> bool:
    return trajectory.reward.status == reward_pb2.REWARD_STATUS_SCORED


def signal_reason(group: trajectory_pb2.TrajectoryGroup) -> str:
    """Why ``group`` carries no signal for group-relative advantages (fewer than two scored
    rollouts, or every one rewarded the same); empty: it carries signal. The rollout service's
    rule, applied to the rewards the group now holds."""
    rewards = [t.reward.value for t in main_line(group) if _scored(t)]
    if len(rewards) < 2:
        return f"{len(rewards)} of {len(main_line(group))} members scored, fewer than 2"
    if max(rewards) - min(rewards) <= 1e-12:
        return f"every scored member has reward {rewards[0]:g}: no variance"
    return ""


def shape_group(
    group: trajectory_pb2.TrajectoryGroup, grades: Mapping[str, RubricGrade], weight: float
) -> trajectory_pb2.TrajectoryGroup:
    """A copy of ``group`` as it trains: each scored rollout's trajectories (every path of it)
    rewarded ``combined_reward(outcome, grade, weight)``, or EXCLUDED (judge unavailable) when
    its grade is missing or has no value; advantages and ``no_signal_reason`` recomputed."""
    out = trajectory_pb2.TrajectoryGroup()
    out.CopyFrom(group)
    for trajectory in out.trajectories:
        if not _scored(trajectory):
            continue
        reward = trajectory.reward
        outcome = reward.value
        reward.components["outcome"] = outcome
        grade = grades.get(trajectory.rollout_id)
        if grade is None or grade.value is None:
            why = grade.excluded if grade else "not_graded"
            reward.status = reward_pb2.REWARD_STATUS_EXCLUDED
            reward.exclusion = reward_pb2.EXCLUSION_REASON_JUDGE_UNAVAILABLE
            reward.detail = f"no rubric grade ({why}); the outcome was {outcome:g}: {reward.detail}"
            reward.value = 0.0
            continue
        reward.value = combined_reward(outcome, grade.value, weight)
        reward.components["rubric"] = grade.value
        for key, value in grade.components.items():
            reward.components[f"rubric.{key}"] = value
        reward.detail = (
            f"(1 - {weight:g}) x outcome {outcome:g} + {weight:g} x rubric {grade.value:.3f}; "
            f"{reward.detail}"
        )
    scored = [t.reward.value for t in main_line(out) if _scored(t)]
    mean = statistics.fmean(scored) if scored else 0.0
    for trajectory in out.trajectories:
        trajectory.advantage = trajectory.reward.value - mean if _scored(trajectory) else 0.0
    out.no_signal_reason = signal_reason(out)
    return out


@dataclass
class RubricStep:
    """What the rubric did to one RL step: the groups as they train (the step's own groups,
    unchanged, when the rubric is off) and the figures for the step log."""

    groups: list[trajectory_pb2.TrajectoryGroup]
    log: dict[str, Any] = field(default_factory=dict)


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


async def _grade_all(
    ctx: StageContext, settings: RlRubric, rows: Sequence[trajectory_pb2.Trajectory]
) -> dict[str, RubricGrade]:
    statements = {t.id: t.instruction for t in ctx.tasks.get("rl", [])}
    dimensions = [
        reward_api.RubricDimension(id=d.id, text=d.text, weight=d.weight)
        for d in settings.dimensions or ()
    ]
    grades: dict[str, RubricGrade] = {}
    gate = asyncio.Semaphore(max(1, ctx.workers))
    async with grpc.aio.insecure_channel(ctx.stack.reward) as channel:
        stub = reward_service_pb2_grpc.RewardServiceStub(channel)

        async def one(row: trajectory_pb2.Trajectory) -> None:
            if not row.turns:
                grades[row.rollout_id] = RubricGrade(None, excluded="no_turns")
                return
            request = reward_api.GradeRubricRequest(
                trajectory=row,
                dimensions=dimensions,
                task=statements.get(row.task_id, ""),
                judge=settings.service_judge,
            )
            async with gate:
                try:
                    reply = await stub.GradeRubric(request, timeout=GRADE_TIMEOUT_S)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() in _REFUSED:
                        raise RuntimeError(
                            f"orchard-reward at {ctx.stack.reward} refused to grade RL "
                            f"trajectories with judge {settings.judge!r} "
                            f"({exc.code().name}: {exc.details()}); fix stages.rl.rubric, or "
                            "the reward service's judges (orchard up configures a scripted "
                            "judge named scripted)"
                        ) from None
                    grades[row.rollout_id] = RubricGrade(
                        None, excluded=f"rpc_{exc.code().name.lower()}", detail=exc.details() or ""
                    )
                    return
            reward = reply.reward
            if reward.status != reward_pb2.REWARD_STATUS_SCORED:
                reason = reward_pb2.ExclusionReason.Name(reward.exclusion)
                why = reason.removeprefix("EXCLUSION_REASON_").lower()
                grades[row.rollout_id] = RubricGrade(None, excluded=why, detail=reward.detail)
                return
            grades[row.rollout_id] = RubricGrade(reward.value, dict(reward.components))

        await asyncio.gather(*(one(r) for r in rows))
    return grades


async def rubric_rewards(
    ctx: StageContext, groups: Sequence[trajectory_pb2.TrajectoryGroup], out: Path, step: int
) -> RubricStep:
    """The step's ``groups`` as they train under ``stages.rl.rubric`` (unchanged when it is
    off): every scored rollout graded by GradeRubric and its reward combined with the
    outcome. Each grade goes to ``out/rubric.jsonl`` (started anew
    at step 1)."""
    settings = ctx.recipe.stages.rl.rubric
    if settings is None:
        return RubricStep(list(groups))
    # Every scored rollout, one path each (its other paths share its reward): PPO trains even
    # a group of one, so none may keep an outcome-only reward beside combined ones.
    rows = [t for g in groups for t in main_line(g) if _scored(t)]
    grades = await _grade_all(ctx, settings, rows)
    shaped = [shape_group(g, grades, settings.weight) for g in groups]
    given = [g for g in grades.values() if g.value is not None]
    excluded = Counter(g.excluded for g in grades.values() if g.value is None)
    outcomes = [t.reward.value for t in rows]
    log = {
        "judge": settings.judge,
        "weight": settings.weight,
        "graded": len(given),
        "excluded": sum(excluded.values()),
        "excluded_by_reason": dict(sorted(excluded.items())),
        "rubric_mean": _mean([g.value for g in given if g.value is not None]),
        "outcome_mean": _mean(outcomes),
        "combined_mean": _mean(
            [t.reward.value for g in shaped for t in main_line(g) if _scored(t)]
        ),
        "groups_with_signal_by_outcome": sum(not g.no_signal_reason for g in groups),
        "groups_with_signal": sum(not g.no_signal_reason for g in shaped),
    }
    log_path = out / RUBRIC_LOG
    with log_path.open("w" if step == 1 else "a", encoding="utf-8") as handle:
        for row in rows:
            grade = grades[row.rollout_id]
            record = {
                "step": step,
                "task": row.task_id,
                "rollout_id": row.rollout_id,
                "outcome": row.reward.value,
                "rubric": grade.value,
                "components": dict(grade.components),
                "excluded": grade.excluded or None,
            }
            handle.write(json.dumps(record, sort_keys=True) + "\n")
    return RubricStep(shaped, {"rubric": log})


def rubric_report(rl: Mapping[str, Any]) -> tuple[RubricReward, ...]:
    """The report's figures of the rubric process reward, from the RL stage's summary (its
    lines of weights that ran with one): per step the mean outcome reward beside the mean
    rubric score and the rollouts excluded."""
    out = []
    for line, summary in (("rl", rl), ("rl from base", rl.get("from_base") or {})):
        steps = [s for s in summary.get("steps", []) if s.get("rubric")]
        if not steps:
            continue
        first = steps[0]["rubric"]
        out.append(
            RubricReward(
                judge=str(first["judge"]),
                weight=float(first["weight"]),
                stand_in=first["judge"] == "builtin:scripted",
                line=line,
                steps=tuple(
                    RubricRewardStep(
                        step=int(s["step"]),
                        outcome_mean=s.get("reward_mean"),
                        rubric_mean=s["rubric"]["rubric_mean"],
                        graded=int(s["rubric"]["graded"]),
                        excluded=int(s["rubric"]["excluded"]),
                        groups_with_signal_by_outcome=int(
                            s["rubric"]["groups_with_signal_by_outcome"]
                        ),
                        groups_with_signal=int(s["rubric"]["groups_with_signal"]),
                    )
                    for s in steps
                ),
            )
        )
    return tuple(out)
