"""What makes a run repeatable and its SFT validated, without services: the seeds each stage
sends, the groups an RL step takes whatever order they finished in, the SFT job's validation
settings, the run folder's seed, and the report's validation curve and note."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from orchard.recipes import stages
from orchard.recipes.pipeline import build_report
from orchard.recipes.stages import (
    StageContext,
    derived_seed,
    in_pair_order,
    sft_spec,
    trainable_tasks,
)
from orchard.recipes.workspace import RecipeMismatch, RunDir, StackEndpoints, write_json
from orchard.rollout.v1 import rollout_service_pb2 as rollout_api
from orchard.sdk.recipe import Recipe
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


def _group(task: str, signal: bool) -> trajectory_pb2.TrajectoryGroup:
    group = trajectory_pb2.TrajectoryGroup(task_id=task, harness="builtin:swe")
    if not signal:
        group.no_signal_reason = "all rewards equal"
    return group


def test_an_rl_step_takes_its_tasks_groups_in_its_order_not_by_finishing() -> None:
    pairs = [(t, "builtin:swe") for t in ("a", "b", "c", "d")]

    def trains(group: trajectory_pb2.TrajectoryGroup) -> bool:
        return not group.no_signal_reason

    def tasks(groups: list[trajectory_pb2.TrajectoryGroup]) -> list[str]:
        return [g.task_id for g in groups]

    # c and d finished first: nothing is decided while a and b run.
    early = [_group("d", True), _group("c", True)]
    assert in_pair_order(early, pairs, trains, 1) == ([], False)
    # a has no signal, b has: with b in, the step's one group is b's, whatever came after.
    later = [*early, _group("b", True), _group("a", False)]
    taken, decided = in_pair_order(later, pairs, trains, 1)
    assert (tasks(taken), decided) == (["a", "b"], True)
    assert tasks(in_pair_order(list(reversed(later)), pairs, trains, 1)[0]) == ["a", "b"]
    # Two wanted: c too. Once the job ended, a pair that emitted nothing is passed over.
    assert tasks(in_pair_order(later, pairs, trains, 2)[0]) == ["a", "b", "c"]
    gap = [_group("a", False), _group("c", True), _group("d", True)]
    assert in_pair_order(gap, pairs, trains, 2) == ([gap[0]], False)
    taken, decided = in_pair_order(gap, pairs, trains, 2, ended=True)
    assert (tasks(taken), decided) == (["a", "c", "d"], True)


def test_the_members_of_a_submitted_group_are_in_content_order() -> None:
    def member(rollout: str, reward: float, tokens: list[int]) -> trajectory_pb2.Trajectory:
        t = trajectory_pb2.Trajectory(id=rollout, rollout_id=rollout)
        t.reward.status = reward_pb2.REWARD_STATUS_SCORED
        t.reward.value = reward
        t.turns.add(input_token_ids=[1, 2], output_token_ids=tokens)
        return t

    members = [member("x.1.aa", 1.0, [5]), member("x.0.bb", -1.0, [7]), member("x.2.cc", 1.0, [4])]
    one = trajectory_pb2.TrajectoryGroup(trajectories=members)
    other = trajectory_pb2.TrajectoryGroup(trajectories=[members[2], members[0], members[1]])
    order = [t.id for t in stages._sorted_members(one).trajectories]
    assert order == [t.id for t in stages._sorted_members(other).trajectories]
    assert order == ["x.0.bb", "x.2.cc", "x.1.aa"]  # by reward, then tokens


class _Captured(Exception):
    pass


class _CapturingRollouts:
    specs: list[rollout_api.RolloutJobSpec] = []

    def __init__(self, address: str) -> None:
        del address

    async def __aenter__(self) -> _CapturingRollouts:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def run(self, spec: rollout_api.RolloutJobSpec, request_id: str, **kw: Any) -> Any:
        self.specs.append(spec)
        raise _Captured


def test_every_job_carries_a_seed_drawn_from_the_run_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stages, "RolloutJobs", _CapturingRollouts)
    _CapturingRollouts.specs = []
    for seed in (5, 5, 6):
        ctx = _context(tmp_path, seed=seed)
        for model in ("base", "sft"):
            with pytest.raises(_Captured):
                asyncio.run(stages._evaluate_model(ctx, model, model, tmp_path))
    seeds = [s.policy_spec.seed for s in _CapturingRollouts.specs]
    assert all(s.policy_spec.HasField("seed") for s in _CapturingRollouts.specs)
    # Every model of a run meets the same draws; the same seed gives them again, another not.
    assert seeds[0] == seeds[1] == seeds[2] == seeds[3] != seeds[4] == seeds[5]
    assert seeds[0] == derived_seed(5, "student", "evaluate")
    assert sft_spec(_context(tmp_path, seed=5), "d", 4).seed == derived_seed(5, "sft")
    assert sft_spec(_context(tmp_path, seed=6), "d", 4).seed != derived_seed(5, "sft")
    assert len({derived_seed(5, "student", "rl", s) for s in range(4)}) == 4
    assert all(0 <= derived_seed(s, "sft") < 2**63 for s in (-1, 0, 2**70))


def test_the_sft_job_validates_on_held_out_tasks_unless_told_not_to(tmp_path: Path) -> None:
    spec = sft_spec(_context(tmp_path), "file:///store/sft.jsonl", steps=6)
    assert spec.HasField("validation")
    assert (spec.validation.fraction, spec.validation.patience) == (0.2, 0)
    assert not spec.validation.dataset
    patient = _context(tmp_path, stages={"sft": {"validation_fraction": 0.3, "patience": 2}})
    spec = sft_spec(patient, "file:///store/sft.jsonl", steps=6)
    assert (spec.validation.fraction, spec.validation.patience) == (0.3, 2)
    off = _context(tmp_path, stages={"sft": {"validation_fraction": 0}})
    assert not sft_spec(off, "d", 6).HasField("validation")
    assert not sft_spec(_context(tmp_path), "d", 6, validate=False).HasField("validation")
    with pytest.raises(ValueError, match="validation_fraction"):
        _context(tmp_path, stages={"sft": {"validation_fraction": 1.0}})

    def row(task: str, reward: float, rise: bool = False) -> trajectory_pb2.Trajectory:
        t = trajectory_pb2.Trajectory(task_id=task)
        t.reward.status = reward_pb2.REWARD_STATUS_SCORED
        t.reward.value = reward
        if rise:
            t.credit.rise_segments.add(start=1, end=1)
        return t

    rows = [row("won", 1.0), row("credited", -1.0, rise=True), row("lost", -1.0)]
    assert trainable_tasks(rows, 0.5) == {"won", "credited"}


def test_a_run_folder_keeps_its_seed(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.claim_seed(5)
    run.claim_seed(5)  # the same run resumes
    with pytest.raises(RecipeMismatch, match="seed 5, not 6"):
        run.claim_seed(6)


def test_the_report_shows_both_sft_curves_and_the_step_handed_on(tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    sft = ctx.run.stage("sft")
    log = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.0, "validation_loss": 2.5},
        {"step": 3, "loss": 1.5},
        {"step": 4, "loss": 1.0, "validation_loss": 2.7},
    ]
    (sft / "run.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    validation = {
        "held_out_tasks": ["task-a"],
        "trajectories": 2,
        "samples": 2,
        "training_samples": 6,
        "points": [
            {"step": 2, "epoch": 1.0, "loss": 2.5, "loss_tokens": 40},
            {"step": 4, "epoch": 2.0, "loss": 2.7, "loss_tokens": 40},
        ],
        "best_step": 2,
        "best_epoch": 1.0,
        "best_loss": 2.5,
        "stopped_early": True,
    }
    write_json(sft / "done.json", {"steps": 4, "validation": validation})
    report = build_report(ctx)
    curves = {c.name: (c.steps, c.values) for c in report.curves}
    assert curves["sft loss"] == ((1.0, 2.0, 3.0, 4.0), (3.0, 2.0, 1.5, 1.0))
    assert curves["sft validation loss"] == ((2.0, 4.0), (2.5, 2.7))
    (note,) = [n for n in report.notes if n.startswith("SFT")]
    assert "handed on step 2 of 4 (epoch 1)" in note
    assert "lowest validation loss, 2.5, on 1 held-out task(s)" in note
    assert "early stopping ended SFT after step 4" in note
    write_json(sft / "done.json", {"steps": 4, "validation": {"off": "no reason"}})
    notes = build_report(ctx).notes
    assert "SFT ran without validation (no reason): its last step is handed on" in notes
