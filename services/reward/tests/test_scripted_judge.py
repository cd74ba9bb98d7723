"""The scripted credit judge: its heuristic, and the real RewardService answering AssignCredit
with it in process (no chat endpoint anywhere: the model judge below points at a closed port)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.core.config import ConfigError, ServerConfig, load_config
from orchard.core.errors import error_info
from orchard.reward.config import (
    JudgeConfig,
    RewardConfig,
    RubricDimensionConfig,
    ScriptedJudgeConfig,
)
from orchard.reward.credit import credit_curve
from orchard.reward.main import RewardApplication
from orchard.reward.scripted_judge import judge_reply
from orchard.reward.v1 import reward_service_pb2 as api
from orchard.reward.v1 import reward_service_pb2_grpc
from orchard.types.v1 import reward_pb2, trajectory_pb2


def _transcript(actions: list[str]) -> str:
    return "\n\n".join(
        f"### Turn {i}\nAction:\n{a}\nObservation:\n(none)" for i, a in enumerate(actions)
    )


def test_the_scripted_judge_rises_on_reading_and_drops_at_the_last_edit() -> None:
    prompt = _transcript(
        [
            'tool call bash({"command": "cat src/*/rules.py"})',
            'tool call bash({"command": "python -m pytest -q"})',
            'tool call bash({"command": "sed -i \'s/a/b/\' src/*/rules.py"})',
            "tool call submit({})",
        ]
    )
    reply = judge_reply(prompt)
    assert reply["critical_turn"] == 2
    curve = credit_curve(json.dumps(reply), 4, epsilon=0.05)  # the reward library's own checks
    assert [(s.start, s.end) for s in curve.rise_segments] == [(1, 1)]
    assert curve.values[2] < curve.values[1] and curve.values[3] < 0.2
    with pytest.raises(ValueError, match="no '### Turn N'"):
        judge_reply("What is the capital of France?")


def _teacher_failure() -> trajectory_pb2.Trajectory:
    """A failed teacher trajectory as the collect stage records it: one bash call a turn."""
    message = trajectory_pb2.Trajectory(id="t-1", task_id="rules-3")
    message.reward.CopyFrom(
        reward_pb2.Reward(status=reward_pb2.REWARD_STATUS_SCORED, value=0.0, detail="1 failed")
    )
    commands = [
        "cat src/*/rules.py",
        "python -m pytest -q",
        "sed -i 's/a/b/' src/*/rules.py",
    ]
    for index, command in enumerate(commands):
        turn = message.turns.add(index=index, input_text=f"observation {index}")
        turn.tool_calls.add(name="bash", arguments_json=json.dumps({"command": command}))
    final = message.turns.add(index=len(commands), input_text="observation 3")
    final.tool_calls.add(name="submit", arguments_json="{}")
    return message


async def test_assign_credit_with_the_scripted_judge_gives_the_recipe_curve(
    scripted_stub: reward_service_pb2_grpc.RewardServiceStub,
) -> None:
    request = api.AssignCreditRequest(
        trajectory=_teacher_failure(), epsilon=0.05, task="fix rules", judge="scripted"
    )
    reply = await scripted_stub.AssignCredit(request, timeout=10)
    assert reply.reward.status == reward_pb2.REWARD_STATUS_SCORED, reply.reward
    assert reply.credit.estimator == "judge:scripted-judge"
    assert list(reply.credit.step_values) == pytest.approx([0.4, 0.5, 0.1, 0.05])
    assert [(s.start, s.end) for s in reply.credit.rise_segments] == [(1, 1)]
    # A trajectory without a climb: values, no rise segment, still scored.
    flat = trajectory_pb2.Trajectory(id="t-2", task_id="rules-3")
    for index in range(3):
        turn = flat.turns.add(index=index, input_text="x")
        turn.tool_calls.add(name="bash", arguments_json='{"command": "echo hi"}')
    reply = await scripted_stub.AssignCredit(
        api.AssignCreditRequest(trajectory=flat, judge="scripted")
    )
    assert reply.reward.status == reward_pb2.REWARD_STATUS_SCORED
    assert list(reply.credit.rise_segments) == []


async def _code(call: Any) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    info = error_info(caught.value)
    return caught.value.code(), caught.value.details() or "", info.reason if info else ""


async def test_the_scripted_judge_answers_credit_only(
    scripted_stub: reward_service_pb2_grpc.RewardServiceStub,
) -> None:
    code, details, reason = await _code(
        scripted_stub.JudgeOutcome(api.JudgeOutcomeRequest(intent="buy milk", judge="scripted"))
    )
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "FAILED_PRECONDITION")
    assert "answers AssignCredit and GradeRubric only" in details and "model" in details
    code, details, _ = await _code(
        scripted_stub.AssignCredit(
            api.AssignCreditRequest(trajectory=_teacher_failure(), judge="oracle")
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown judge 'oracle'" in details and "model, scripted" in details


async def test_a_scripted_default_judge_grades_rubrics_it_knows_and_answers_credit() -> None:
    config = RewardConfig(
        server=ServerConfig(listen=["127.0.0.1:0"]),
        judges={"default": ScriptedJudgeConfig(kind="scripted")},
    )
    async with RewardApplication(config).server() as server:
        await server.set_serving()
        async with grpc.aio.insecure_channel(server.addresses[0]) as channel:
            scripted_stub = reward_service_pb2_grpc.RewardServiceStub(channel)
            request = api.GradeRubricRequest(trajectory=_teacher_failure())
            reply = await scripted_stub.GradeRubric(request)
            assert reply.reward.status == reward_pb2.REWARD_STATUS_SCORED
            assert sorted(reply.reward.components) == [f"R{i}" for i in range(1, 8)]
            # The default judge answers credit with no name given.
            reply = await scripted_stub.AssignCredit(
                api.AssignCreditRequest(trajectory=_teacher_failure())
            )
            assert reply.credit.estimator == "judge:scripted-judge"
    # A configured rubric of other dimensions is the operator's to fix.
    config = config.model_copy(
        update={"rubric": [RubricDimensionConfig(id="Q1", text="Polite.", weight=1.0)]}
    )
    async with RewardApplication(config).server() as server:
        await server.set_serving()
        async with grpc.aio.insecure_channel(server.addresses[0]) as channel:
            scripted_stub = reward_service_pb2_grpc.RewardServiceStub(channel)
            request = api.GradeRubricRequest(trajectory=_teacher_failure())
            code, details, _ = await _code(scripted_stub.GradeRubric(request))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            assert "R1, R2, R3, R4, R5, R6, R7" in details and "Q1" in details


def test_every_service_has_the_scripted_judge_unless_its_judges_are_set() -> None:
    assert RewardConfig().judges["scripted"] == ScriptedJudgeConfig(kind="scripted")
    assert sorted(RewardConfig().judges) == ["default", "scripted"]


def test_judges_of_both_kinds_load_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "reward.yaml"
    path.write_text(
        "judges:\n"
        "  default: {base_url: 'http://judge.example:8000/v1', model: big}\n"
        "  scripted: {kind: scripted}\n"
    )
    config = load_config(RewardConfig, yaml_path=path, env={})
    assert isinstance(config.judges["default"], JudgeConfig)
    assert config.judges["scripted"] == ScriptedJudgeConfig(kind="scripted")
    path.write_text("judges:\n  default: {kind: oracle}\n")
    with pytest.raises(ConfigError, match="oracle"):
        load_config(RewardConfig, yaml_path=path, env={})
    path.write_text("judges:\n  default: {kind: scripted, base_url: 'http://x/v1'}\n")
    with pytest.raises(ConfigError, match="base_url"):
        load_config(RewardConfig, yaml_path=path, env={})
