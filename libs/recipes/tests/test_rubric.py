"""The rubric process reward in RL (`orchard.recipes.rubric`): the combination, exclusion of
what the judge did not grade, the signal decided again, the step log and the report; and the
grades asked of a real orchard-reward on loopback."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from orchard.recipes.rubric import (
    RUBRIC_LOG,
    RubricGrade,
    combined_reward,
    rubric_report,
    rubric_rewards,
    shape_group,
    signal_reason,
)
from orchard.recipes.stages import StageContext
from orchard.recipes.workspace import RunDir, StackEndpoints
from orchard.sdk.recipe import Recipe
from orchard.sdk.report import RunReport, write_report
from orchard.types.v1 import reward_pb2, trajectory_pb2


def test_the_reward_trained_on_is_the_weighted_sum_of_outcome_and_rubric() -> None:
    assert combined_reward(-1.0, 0.5, 0.3) == pytest.approx(0.7 * -1.0 + 0.3 * 0.5)
    assert combined_reward(1.0, 0.25, 1.0) == pytest.approx(0.25)
    assert combined_reward(1.0, 0.0, 0.5) == pytest.approx(0.5)
    for weight in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"weight must lie in \(0, 1\]"):
            combined_reward(1.0, 1.0, weight)


def _rollout(
    rollout: str, outcome: float, *, branch: bool = False, status: int = 1
) -> trajectory_pb2.Trajectory:
    trajectory = trajectory_pb2.Trajectory(
        id=f"{rollout}/{1 if branch else 0}", rollout_id=rollout, task_id="t", harness="h"
    )
    trajectory.reward.CopyFrom(reward_pb2.Reward(status=status, value=outcome, detail="tests"))
    if branch:
        trajectory.metadata["branch"] = "auxiliary"
    turn = trajectory.turns.add(index=0, kind=trajectory_pb2.TURN_KIND_POLICY, input_text="fix")
    turn.tool_calls.add(name="bash", arguments_json='{"command": "python -m pytest -q"}')
    return trajectory


def _group(*members: trajectory_pb2.Trajectory, reason: str = "") -> trajectory_pb2.TrajectoryGroup:
    group = trajectory_pb2.TrajectoryGroup(
        id="g", task_id="t", harness="h", no_signal_reason=reason
    )
    group.trajectories.extend(members)
    return group


def test_a_group_whose_outcomes_agree_trains_when_its_rubric_grades_differ() -> None:
    group = _group(
        _rollout("a", -1.0), _rollout("a", -1.0, branch=True), _rollout("b", -1.0),
        reason="every scored member has reward -1: no variance",
    )  # fmt: skip
    grades = {
        "a": RubricGrade(0.6, {"R1": 1.0, "R6": 0.5}),
        "b": RubricGrade(0.2, {"R1": 0.0, "R6": 0.4}),
    }
    shaped = shape_group(group, grades, 0.5)
    assert shaped.no_signal_reason == ""
    a, a_branch, b = shaped.trajectories
    assert a.reward.value == pytest.approx(-0.2) and b.reward.value == pytest.approx(-0.4)
    assert a_branch.reward.value == a.reward.value  # every path of a rollout, one reward
    assert dict(a.reward.components) == pytest.approx(
        {"outcome": -1.0, "rubric": 0.6, "rubric.R1": 1.0, "rubric.R6": 0.5}
    )
    assert "(1 - 0.5) x outcome -1 + 0.5 x rubric 0.600" in a.reward.detail
    assert a.advantage == pytest.approx(0.1) and b.advantage == pytest.approx(-0.1)
    # The step's own groups keep the outcome: success and the groups log are decided on it.
    assert group.trajectories[0].reward.value == -1.0 and group.no_signal_reason
    # Equal grades leave a group of equal outcomes without signal.
    same = shape_group(group, {"a": RubricGrade(0.5), "b": RubricGrade(0.5)}, 0.3)
    assert "no variance" in same.no_signal_reason


def test_a_rollout_the_judge_did_not_grade_is_excluded_never_scored_zero() -> None:
    group = _group(_rollout("a", 1.0), _rollout("b", -1.0), _rollout("c", -1.0))
    grades = {
        "a": RubricGrade(0.5),
        "b": RubricGrade(None, excluded="judge_unavailable"),
        # "c" has no grade at all (its call never answered)
    }
    shaped = shape_group(group, grades, 0.3)
    a, b, c = shaped.trajectories
    assert a.reward.status == reward_pb2.REWARD_STATUS_SCORED
    for left_out, why in ((b, "judge_unavailable"), (c, "not_graded")):
        assert left_out.reward.status == reward_pb2.REWARD_STATUS_EXCLUDED
        assert left_out.reward.exclusion == reward_pb2.EXCLUSION_REASON_JUDGE_UNAVAILABLE
        assert left_out.reward.components["outcome"] == -1.0  # still visible
        assert why in left_out.reward.detail and left_out.advantage == 0.0
    # One scored rollout left: no signal, whatever the outcomes were.
    assert shaped.no_signal_reason == "1 of 3 members scored, fewer than 2"


def test_signal_counts_rollouts_once_and_needs_two_different_rewards() -> None:
    assert signal_reason(_group(_rollout("a", 1.0), _rollout("b", -1.0))) == ""
    assert "no variance" in signal_reason(_group(_rollout("a", 1.0), _rollout("b", 1.0)))
    branches = _group(_rollout("a", 1.0), _rollout("a", -1.0, branch=True))
    assert signal_reason(branches) == "1 of 1 members scored, fewer than 2"
    excluded = _group(_rollout("a", 1.0), _rollout("b", 0.0, status=2))
    assert signal_reason(excluded) == "1 of 2 members scored, fewer than 2"


STEP_LOG = {
    "step": 1,
    "reward_mean": -0.5,
    "rubric": {
        "judge": "builtin:scripted",
        "weight": 0.3,
        "graded": 3,
        "excluded": 1,
        "excluded_by_reason": {"judge_unavailable": 1},
        "rubric_mean": 0.42,
        "outcome_mean": -0.5,
        "combined_mean": -0.2,
        "groups_with_signal_by_outcome": 0,
        "groups_with_signal": 1,
    },
}


def test_the_report_says_rpr_was_on_and_shows_outcome_beside_rubric(tmp_path: Path) -> None:
    rl = {"steps": [STEP_LOG, {**STEP_LOG, "step": 2, "reward_mean": 0.0}]}
    (figures,) = rubric_report(rl)
    assert figures.stand_in and figures.weight == 0.3 and figures.line == "rl"
    assert [(s.step, s.outcome_mean, s.rubric_mean, s.excluded) for s in figures.steps] == [
        (1, -0.5, 0.42, 1),
        (2, 0.0, 0.42, 1),
    ]
    assert rubric_report({"steps": [{"step": 1, "reward_mean": 0.0}]}) == ()
    text = write_report(RunReport(title="r", rubric=(figures,)), tmp_path).read_text()
    assert "rubric process reward on, weight 0.3, judge builtin:scripted" in text
    assert "a deterministic stand-in for a judge model" in text
    assert "(1 - 0.3) x outcome + 0.3 x rubric" in text
    assert "| rl | 1 | -0.500 | 0.420 | 3 | 1 | 0 / 1 |" in text
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["rubric"][0]["steps"][1]["outcome_mean"] == 0.0


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _context(tmp_path: Path, reward: str, rubric: dict[str, object]) -> StageContext:
    recipe = Recipe.model_validate(
        {"name": "rpr", "tasks": {"builtin": {"count": 12}},
         "output_dir": tmp_path / str(rubric["judge"]).replace(":", "-"),
         "stages": {"rl": {"rubric": rubric}}}
    )  # fmt: skip
    stack = StackEndpoints("127.0.0.1:1", "", reward, "", "127.0.0.1:3", "127.0.0.1:4")
    return StageContext(recipe, RunDir.open(recipe), stack, {"rl": []}, workers=2)


def _verified(rollout: str, outcome: float) -> trajectory_pb2.Trajectory:
    """Edits the task's file, then runs the tests and sees them pass."""
    trajectory = _rollout(rollout, outcome)
    edit = trajectory.turns.add(index=1, kind=trajectory_pb2.TURN_KIND_POLICY, input_text="ok")
    edit.tool_calls.add(name="bash", arguments_json='{"command": "sed -i s/a/b/ src/m.py"}')
    run = trajectory.turns.add(index=2, kind=trajectory_pb2.TURN_KIND_POLICY, input_text="ok")
    run.tool_calls.add(name="bash", arguments_json='{"command": "python -m pytest -q"}')
    trajectory.turns.add(index=3, kind=trajectory_pb2.TURN_KIND_POLICY, input_text="exit code 0")
    return trajectory


async def test_the_step_asks_the_reward_service_and_logs_what_it_got(tmp_path: Path) -> None:
    from orchard.core.config import ServerConfig
    from orchard.reward.config import JudgeConfig, RewardConfig, ScriptedJudgeConfig
    from orchard.reward.main import RewardApplication

    config = RewardConfig(
        server=ServerConfig(listen=["127.0.0.1:0"]),
        judges={
            "model": JudgeConfig(
                base_url=f"http://127.0.0.1:{_closed_port()}/v1", model="m", max_attempts=1
            ),
            "scripted": ScriptedJudgeConfig(kind="scripted"),
        },
        default_judge="model",
    )
    agreeing = _group(_verified("a", -1.0), _rollout("b", -1.0), reason="no variance")
    lone = _group(_rollout("c", 1.0), reason="1 of 1 members scored, fewer than 2")
    lone.id = "lone"
    async with RewardApplication(config).server() as server:
        await server.set_serving()
        address = server.addresses[0]
        ctx = _context(tmp_path, address, {"weight": 0.5, "judge": "builtin:scripted"})
        out = ctx.run.stage("rl")
        step = await rubric_rewards(ctx, [agreeing, lone], out, 1)
        log = step.log["rubric"]
        assert (log["graded"], log["excluded"]) == (3, 0)
        assert (log["groups_with_signal_by_outcome"], log["groups_with_signal"]) == (0, 1)
        assert log["outcome_mean"] == pytest.approx(-1 / 3) and 0 < log["rubric_mean"] < 1
        shaped, _ = step.groups
        assert shaped.no_signal_reason == ""
        verified, untested = shaped.trajectories
        assert verified.reward.components["rubric"] > untested.reward.components["rubric"]
        assert verified.reward.value > untested.reward.value
        records = [json.loads(line) for line in (out / RUBRIC_LOG).read_text().splitlines()]
        assert [(r["rollout_id"], r["step"]) for r in records] == [("a", 1), ("b", 1), ("c", 1)]
        assert set(records[0]["components"]) == {f"R{i}" for i in range(1, 8)}

        # A judge that answers nothing: every rollout excluded and counted, none scored 0.
        ctx = _context(tmp_path, address, {"weight": 0.5, "judge": "model"})
        step = await rubric_rewards(ctx, [agreeing], out, 2)
        log = step.log["rubric"]
        assert log["excluded_by_reason"] == {"judge_unavailable": 2} and log["graded"] == 0
        assert log["rubric_mean"] is None and log["groups_with_signal"] == 0
        assert all(
            t.reward.status == reward_pb2.REWARD_STATUS_EXCLUDED
            for t in step.groups[0].trajectories
        )
        assert len((out / RUBRIC_LOG).read_text().splitlines()) == 5  # step 2 appended

        # A judge the service does not have stops the run with what to fix.
        ctx = _context(tmp_path, address, {"weight": 0.5, "judge": "oracle"})
        with pytest.raises(RuntimeError, match=r"unknown judge 'oracle'.*fix stages\.rl\.rubric"):
            await rubric_rewards(ctx, [agreeing], out, 3)

    # The reward service gone: each rollout excluded for the failed call, the step goes on.
    ctx = _context(tmp_path, f"127.0.0.1:{_closed_port()}", {"weight": 0.5, "judge": "model"})
    step = await rubric_rewards(ctx, [agreeing], out, 4)
    assert step.log["rubric"]["excluded_by_reason"] == {"rpc_unavailable": 2}


async def test_without_a_rubric_the_step_s_groups_train_as_they_are(tmp_path: Path) -> None:
    recipe = Recipe.model_validate(
        {"name": "plain", "tasks": {"builtin": {"count": 12}}, "output_dir": tmp_path / "run"}
    )
    stack = StackEndpoints("127.0.0.1:1", "", "127.0.0.1:2", "", "127.0.0.1:3", "127.0.0.1:4")
    ctx = StageContext(recipe, RunDir.open(recipe), stack, {"rl": []})
    group = _group(_rollout("a", 1.0), _rollout("b", -1.0))
    step = await rubric_rewards(ctx, [group], tmp_path, 1)
    assert step.groups == [group] and step.log == {}
    assert not (tmp_path / RUBRIC_LOG).exists()
