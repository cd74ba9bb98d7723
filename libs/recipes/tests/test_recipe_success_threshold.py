"""One success threshold per run: the recipe's (or its task suite's) value is what every RPC that
decides success is sent — the samplers of collection, RL and evaluation, credit assignment,
PrepareDataset and the SFT job — and a reward exactly at it counts as a success everywhere."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from orchard.core.success import DEFAULT_SUCCESS_THRESHOLD
from orchard.recipes import stages
from orchard.recipes.stages import (
    StageContext,
    credit_request,
    failed_rows,
    group_counts,
    prepare_request,
    rl_sampler,
    sft_spec,
)
from orchard.recipes.workspace import RunDir, StackEndpoints
from orchard.rollout.v1 import rollout_service_pb2 as rollout_api
from orchard.sdk.recipe import Recipe
from orchard.trainer.v1 import trainer_service_pb2 as trainer_api
from orchard.types.v1 import reward_pb2, trajectory_pb2


def _context(tmp_path: Path, seed: int = 0, **recipe: Any) -> StageContext:
    document = {"name": "t", "tasks": {"builtin": {"count": 3}}, **recipe}
    (tmp_path / "run").mkdir(exist_ok=True)
    stack = StackEndpoints(
        env="e", env_token="", reward="r", etcd="x", trainer="t", rollout="o", artifacts=""
    )
    return StageContext(
        recipe=Recipe.model_validate(document),
        run=RunDir(tmp_path / "run"),
        stack=stack,
        tasks={"sft": [], "rl": [], "evaluate": []},
        progress=False,
        seed=seed,
    )


def _row(value: float | None, id: str = "r") -> trajectory_pb2.Trajectory:
    row = trajectory_pb2.Trajectory(id=id, rollout_id=id)
    if value is not None:
        row.reward.status = reward_pb2.REWARD_STATUS_SCORED
        row.reward.value = value
    return row


def test_the_threshold_is_the_recipe_s_else_the_suite_s_else_the_default(tmp_path: Path) -> None:
    assert _context(tmp_path).pass_mark == DEFAULT_SUCCESS_THRESHOLD == 0.5
    claw = {"tasks": {"claw": {"count": 24}}, "harnesses": ["program:codex"],
            "stages": {"credit": {"enabled": False}}}  # fmt: skip
    assert _context(tmp_path, **claw).pass_mark == 0.75
    assert _context(tmp_path, **claw, success_threshold=0.6).pass_mark == 0.6
    assert _context(tmp_path, success_threshold=0.0).pass_mark == 0.0


class _Sent(Exception):
    """Stops a stage once its request is captured."""


class _CapturingRollouts:
    """RolloutJobs that records the job spec it is asked to run and ends the stage there."""

    specs: list[rollout_api.RolloutJobSpec] = []

    def __init__(self, address: str) -> None:
        del address

    async def __aenter__(self) -> _CapturingRollouts:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def run(self, spec: rollout_api.RolloutJobSpec, request_id: str, **kw: Any) -> Any:
        self.specs.append(spec)
        raise _Sent


def test_every_rollout_job_carries_the_recipe_s_threshold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = _context(tmp_path, success_threshold=0.8, seed=5)
    monkeypatch.setattr(stages, "RolloutJobs", _CapturingRollouts)
    _CapturingRollouts.specs = []
    with pytest.raises(_Sent):
        asyncio.run(stages._collect(ctx, tmp_path))
    with pytest.raises(_Sent):
        asyncio.run(stages._evaluate_model(ctx, "base", "base", tmp_path))
    collect, evaluate = _CapturingRollouts.specs
    for spec in (collect, evaluate):
        assert spec.sampler.kind == rollout_api.SAMPLER_KIND_FIXED_N
        assert spec.sampler.HasField("positive_threshold")
        assert spec.sampler.positive_threshold == 0.8
    # RL with BAR and with fixed-N.
    bar = rl_sampler(ctx)
    assert (bar.kind, bar.positive_threshold) == (rollout_api.SAMPLER_KIND_BAR, 0.8)
    fixed = _context(tmp_path, success_threshold=0.8, stages={"rl": {"sampler": {"kind": "fixed"}}})
    assert rl_sampler(fixed).positive_threshold == 0.8


def test_credit_prepare_and_the_sft_job_carry_the_threshold(tmp_path: Path) -> None:
    ctx = _context(tmp_path, success_threshold=0.8)
    request = credit_request(ctx, _row(0.79), "fix it", "scripted")
    assert request.HasField("success_threshold") and request.success_threshold == 0.8
    curation = trainer_api.CurationSettings(shortest_success_per_task=True)
    prepared = prepare_request(
        ctx, model="builtin:tiny", trajectories="u", tools=[], output="o", curation=curation
    )
    assert prepared.HasField("success_threshold") and prepared.success_threshold == 0.8
    # One threshold per request: curation's own (deprecated) field is left unset.
    assert not prepared.curation.HasField("success_threshold")
    spec = sft_spec(ctx, "file:///store/sft.jsonl", steps=3)
    assert spec.HasField("success_threshold") and spec.success_threshold == 0.8
    assert (spec.mode, spec.total_steps) == (trainer_api.TRAINING_MODE_SFT, 3)


def test_a_reward_at_the_threshold_is_a_success_for_credit_and_counts(tmp_path: Path) -> None:
    rows = [_row(0.75, "at"), _row(0.7499, "below"), _row(None, "unscored"), _row(1.0, "won")]
    assert [r.id for r in failed_rows(rows, 0.75)] == ["below"]
    group = trajectory_pb2.TrajectoryGroup(task_id="t", trajectories=rows)
    counts = group_counts([group], 0.75)
    assert (counts["resolved"], counts["unresolved"]) == (2, 1)


def test_bar_options_and_the_run_s_seed_reach_the_sampler_config(tmp_path: Path) -> None:
    sampler = {"n": 4, "n_max": 12, "stride": 3, "stop_rule": "band", "member_choice": "ranked"}
    ctx = _context(tmp_path, seed=9, stages={"rl": {"sampler": sampler}})
    config = rl_sampler(ctx, step=2)
    assert (config.group_size, config.max_rollouts, config.stride) == (4, 12, 3)
    assert config.stop_rule == rollout_api.BAR_STOP_RULE_BAND
    assert config.member_choice == rollout_api.BAR_MEMBER_CHOICE_RANKED
    # The defaults: the mixed rule, random members, a stride of n; a seed per run and step.
    ctx = _context(tmp_path, seed=9)
    config = rl_sampler(ctx, step=2)
    assert config.stop_rule == rollout_api.BAR_STOP_RULE_MIXED
    assert config.member_choice == rollout_api.BAR_MEMBER_CHOICE_RANDOM
    assert (config.group_size, config.stride, config.max_rollouts) == (8, 8, 16)
    assert config.HasField("seed")
    assert config.seed == rl_sampler(_context(tmp_path, seed=9), step=2).seed
    assert config.seed != rl_sampler(ctx, step=3).seed
    assert config.seed != rl_sampler(_context(tmp_path, seed=10), step=2).seed
