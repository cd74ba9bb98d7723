"""The real RewardService server on loopback, judged by the scripted test chat server.

Every call goes through gRPC (health, reflection, the error interceptor, metrics) and the
official ``openai`` client; metrics are read from the server's real /metrics endpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchard.core.config import ConfigError, ServerConfig, load_config
from orchard.core.errors import error_info
from orchard.reward.config import JudgeConfig, RewardConfig
from orchard.reward.main import RewardApplication
from orchard.reward.v1 import reward_service_pb2 as api
from orchard.reward.v1 import reward_service_pb2_grpc
from orchard.types.v1 import reward_pb2, trajectory_pb2

from .scripted_chat_server import ScriptedChatServer, Step, scripted_chat_server

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
REWARD = str(Path(sys.executable).parent / "orchard-reward")


@pytest.fixture
def chat() -> Iterator[ScriptedChatServer]:
    with scripted_chat_server() as server:
        yield server


class Running:
    def __init__(self, app: RewardApplication, metrics_address: str, channel: Any) -> None:
        self.app = app
        self.metrics_address = metrics_address
        self.channel = channel
        self.stub = reward_service_pb2_grpc.RewardServiceStub(channel)

    def metric(self, name: str, **labels: str) -> float:
        """The current value of one sample on the real /metrics endpoint (0 when absent)."""
        url = f"http://{self.metrics_address}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            sample, value = line.rsplit(" ", 1)
            metric_name, _, rest = sample.partition("{")
            found = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
            if metric_name == name and found == wanted:
                return float(value)
        return 0.0


@pytest.fixture
async def reward(chat: ScriptedChatServer) -> AsyncIterator[Running]:
    config = RewardConfig(
        server=ServerConfig(listen=["127.0.0.1:0"], metrics_address="127.0.0.1:0"),
        judges={
            "default": JudgeConfig(base_url=chat.base_url, model="judge-test", timeout_s=1.0),
            "patient": JudgeConfig(base_url=chat.base_url, model="judge-b", max_attempts=1),
        },
    )
    app = RewardApplication(config)
    async with app.server() as server:
        await server.set_serving()
        assert server.metrics_address is not None
        async with grpc.aio.insecure_channel(server.addresses[0]) as channel:
            yield Running(app, server.metrics_address, channel)


def _trajectory(*turns: tuple[str, str]) -> trajectory_pb2.Trajectory:
    message = trajectory_pb2.Trajectory(id="t-1", task_id="fix-add")
    for index, (input_text, output_text) in enumerate(turns):
        message.turns.add(index=index, input_text=input_text, output_text=output_text)
    return message


TRAJECTORY = _trajectory(
    ("Fix add() in calc.py", "cat calc.py"),
    ("def add(a, b): return a - b", "sed -i 's/a - b/a + b/' calc.py"),
    ("(no output)", "pytest -q"),
    ("1 passed", "submit"),
)


async def _code(call: Any) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    info = error_info(caught.value)
    return caught.value.code(), caught.value.details() or "", info.reason if info else ""


async def test_health_and_reflection(reward: Running) -> None:
    health = health_pb2_grpc.HealthStub(reward.channel)
    reply = await health.Check(
        health_pb2.HealthCheckRequest(service="orchard.reward.v1.RewardService")
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_judge_outcome_retries_then_scores_and_counts(
    reward: Running, chat: ScriptedChatServer
) -> None:
    chat.play(Step(status=500), Step(reply='Sure. {"success": true, "reason": "order placed"}'))
    request = api.JudgeOutcomeRequest(
        intent="buy milk", final_response="done", screenshots=[PNG] * 5
    )
    reply = await reward.stub.JudgeOutcome(request)
    assert reply.reward.status == reward_pb2.REWARD_STATUS_SCORED
    assert (reply.reward.value, reply.reward.scorer) == (1.0, "judge")
    images = [p for p in chat.requests[-1]["messages"][1]["content"] if p["type"] == "image_url"]
    assert len(images) == 3  # the configured last_screenshots
    name = "orchard_reward_judge_retries_total"
    assert reward.metric(name, judge="default", reason="http_error") == 1
    assert reward.metric("orchard_reward_rewards_total", scorer="judge", status="scored") == 1
    assert reward.metric("orchard_reward_scorer_seconds_count", scorer="judge") == 1


async def test_judge_giving_nothing_is_excluded_never_zero(
    reward: Running, chat: ScriptedChatServer
) -> None:
    chat.play(Step(raw_body=b"<html>busy</html>"), Step(reply="I think so"), Step(delay_s=1.5))
    reply = await reward.stub.JudgeOutcome(
        api.JudgeOutcomeRequest(intent="book a room", format_variant=True)
    )
    assert reply.reward.status == reward_pb2.REWARD_STATUS_EXCLUDED
    assert reply.reward.exclusion == reward_pb2.EXCLUSION_REASON_JUDGE_UNAVAILABLE
    assert reply.reward.value == 0.0
    assert len(reply.reward.evidence) == 3
    excluded = reward.metric(
        "orchard_reward_exclusions_total", scorer="judge", reason="judge_unavailable"
    )
    assert excluded == 1
    retries = "orchard_reward_judge_retries_total"
    assert reward.metric(retries, judge="default", reason="bad_response") == 1
    assert reward.metric(retries, judge="default", reason="malformed") == 1
    assert reward.metric(retries, judge="default", reason="timeout") == 0  # the last: no retry


async def test_format_variant_through_the_service(
    reward: Running, chat: ScriptedChatServer
) -> None:
    chat.play(
        Step(reply='{"success": false, "reason": "no"}'),
        Step(reply='{"success": false, "reason": "no"}'),
        Step(reply='{"success": true, "reason": "yes"}'),
        Step(reply='{"success": true, "reason": "yes"}'),
    )
    few = api.JudgeOutcomeRequest(intent="x", format_variant=True, policy_format_failures=2)
    many = api.JudgeOutcomeRequest(
        intent="x", format_variant=True, policy_format_failures=3, judge="patient"
    )
    assert (await reward.stub.JudgeOutcome(few)).reward.value == 0.0
    assert (await reward.stub.JudgeOutcome(many)).reward.value == -1.0
    assert chat.requests[-1]["model"] == "judge-b"
    # A success is +1 only when every turn parsed.
    clean = api.JudgeOutcomeRequest(intent="x", format_variant=True)
    assert (await reward.stub.JudgeOutcome(clean)).reward.value == 1.0
    one = api.JudgeOutcomeRequest(intent="x", format_variant=True, policy_format_failures=1)
    assert (await reward.stub.JudgeOutcome(one)).reward.value == 0.0


async def test_rubric_from_a_trajectory(reward: Running, chat: ScriptedChatServer) -> None:
    grades = {
        "fix": {"score": 1.0, "evidence": "sed fixed the sign", "turn": 1},
        "verify": {"score": 0.5, "evidence": "ran pytest once", "turn": 2},
    }
    chat.play(Step(reply=json.dumps({"grades": grades})))
    request = api.GradeRubricRequest(trajectory=TRAJECTORY)
    request.dimensions.add(id="fix", text="correct fix", weight=0.25)
    request.dimensions.add(id="verify", text="ran the tests", weight=0.75)
    reply = await reward.stub.GradeRubric(request)
    assert reply.reward.value == pytest.approx(0.25 + 0.375)
    assert dict(reply.reward.components) == {"fix": 1.0, "verify": 0.5}
    assert [e.turn_index for e in reply.reward.evidence] == [1, 2]
    prompt = chat.requests[-1]["messages"][1]["content"]
    assert "Fix add() in calc.py" in prompt  # the task from the first turn's input
    assert "def add(a, b): return a - b" in prompt  # turn 0's observation is turn 1's input


async def test_default_rubric_is_the_configured_seven(
    reward: Running, chat: ScriptedChatServer
) -> None:
    grades = {f"R{i}": {"score": 1.0 if i == 1 else 0.0, "evidence": "seen"} for i in range(1, 8)}
    chat.play(Step(reply=json.dumps({"grades": grades})))
    reply = await reward.stub.GradeRubric(api.GradeRubricRequest(trajectory=TRAJECTORY))
    assert reply.reward.value == pytest.approx(0.15)
    assert sorted(reply.reward.components) == [f"R{i}" for i in range(1, 8)]


async def test_credit_assignment_and_its_exclusion(
    reward: Running, chat: ScriptedChatServer
) -> None:
    annotation = {
        "values": [{"turn": 0, "value": 0.4}, {"turn": 2, "value": 0.7}, {"turn": 3, "value": 0.1}],
        "critical_turn": 3,
    }
    chat.play(Step(reply="Reasoning backward... " + json.dumps(annotation)))
    request = api.AssignCreditRequest(trajectory=TRAJECTORY, failure="2 tests fail")
    reply = await reward.stub.AssignCredit(request)
    assert list(reply.credit.step_values) == pytest.approx([0.4, 0.55, 0.7, 0.1])
    assert [(s.start, s.end) for s in reply.credit.rise_segments] == [(1, 2)]
    assert reply.credit.epsilon == pytest.approx(0.05)
    assert reply.credit.estimator == "judge:judge-test"
    assert reply.reward.status == reward_pb2.REWARD_STATUS_SCORED
    assert "2 tests fail" in chat.requests[-1]["messages"][1]["content"]

    chat.play(Step(reply='{"values": [{"turn": 0, "value": 0.9}]}'), Step(status=502), Step())
    reply = await reward.stub.AssignCredit(request)
    assert not reply.HasField("credit")
    assert reply.reward.exclusion == reward_pb2.EXCLUSION_REASON_JUDGE_UNAVAILABLE
    metric = "orchard_reward_exclusions_total"
    assert reward.metric(metric, scorer="credit", reason="judge_unavailable") == 1
    assert reward.metric("orchard_reward_rewards_total", scorer="credit", status="scored") == 1


async def test_credit_is_refused_for_a_trajectory_at_or_above_the_success_threshold(
    reward: Running, chat: ScriptedChatServer
) -> None:
    """The success threshold travels in the request (unset: 0.5); a reward exactly at it is a
    success, so it gets no credit."""
    scored = trajectory_pb2.Trajectory()
    scored.CopyFrom(TRAJECTORY)
    scored.reward.status = reward_pb2.REWARD_STATUS_SCORED
    scored.reward.value = 0.5
    for request in (
        api.AssignCreditRequest(trajectory=scored),
        api.AssignCreditRequest(trajectory=scored, success_threshold=0.5),
    ):
        code, details, reason = await _code(reward.stub.AssignCredit(request))
        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
        assert "at or above the success threshold 0.5" in details
    assert not chat.requests  # refused before the judge was asked
    annotation = {"values": [{"turn": 0, "value": 0.4}, {"turn": 3, "value": 0.1}]}
    chat.play(Step(reply=json.dumps(annotation)))
    # A pass mark of 0.75 (a Claw suite's): a reward of 0.5 failed.
    request = api.AssignCreditRequest(trajectory=scored, success_threshold=0.75)
    reply = await reward.stub.AssignCredit(request)
    assert reply.reward.status == reward_pb2.REWARD_STATUS_SCORED
    assert len(reply.credit.step_values) == 4


async def test_bad_input_is_invalid_argument_with_a_message(reward: Running) -> None:
    stub = reward.stub
    weights = api.GradeRubricRequest(trajectory=TRAJECTORY)
    weights.dimensions.add(id="a", text="x", weight=0.5)
    task = api.TestTask(fail_to_pass=["tests/test_x.py::test_a"], image="host")
    too_long = api.ScoreTestsRequest(task=task, timeout=duration_pb2.Duration(seconds=10**6))
    cases = [
        (stub.JudgeOutcome(api.JudgeOutcomeRequest(intent=" ")), "intent is empty"),
        (stub.JudgeOutcome(api.JudgeOutcomeRequest(intent="x", judge="gpt")), "unknown judge"),
        (
            stub.JudgeOutcome(api.JudgeOutcomeRequest(intent="x", screenshots=[b"GIF89a"])),
            "PNG or JPEG",
        ),
        (
            stub.JudgeOutcome(api.JudgeOutcomeRequest(intent="x", policy_format_failures=-1)),
            "must not be negative",
        ),
        (stub.GradeRubric(weights), "sum to 1"),
        (stub.GradeRubric(api.GradeRubricRequest()), "trajectory is empty"),
        (stub.AssignCredit(api.AssignCreditRequest()), "trajectory is empty"),
        (stub.AssignCredit(api.AssignCreditRequest(trajectory=TRAJECTORY, epsilon=1.5)), "epsilon"),
        (
            stub.AssignCredit(
                api.AssignCreditRequest(trajectory=TRAJECTORY, success_threshold=float("nan"))
            ),
            "success_threshold must lie in [0, 1]",
        ),
        (stub.ScoreTests(api.ScoreTestsRequest()), "task is required"),
        (
            stub.ScoreTests(api.ScoreTestsRequest(task=api.TestTask(image="host"))),
            "no FAIL_TO_PASS",
        ),
        (
            stub.ScoreTests(
                api.ScoreTestsRequest(task=api.TestTask(fail_to_pass=["t"], parser="nose"))
            ),
            "unknown test output parser",
        ),
        (stub.ScoreTests(too_long), "timeout must lie in"),
        (
            stub.ScoreTests(api.ScoreTestsRequest(task=api.TestTask(fail_to_pass=["t"]))),
            "sandbox_id",
        ),
        (stub.ScoreTask(api.ScoreTaskRequest(task_id="inbox-1")), "unknown task_id"),
    ]
    for call, message in cases:
        code, details, reason = await _code(call)
        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"), details
        assert message in details


async def test_sandbox_rpcs_without_an_environment_service(reward: Running) -> None:
    task = api.TestTask(fail_to_pass=["tests/test_x.py::test_a"], image="host")
    code, details, _ = await _code(reward.stub.ScoreTests(api.ScoreTestsRequest(task=task)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "env.endpoint" in details


def test_config_checks_rubric_and_judge_names() -> None:
    with pytest.raises(ConfigError, match="sum to 1"):
        load_config(
            RewardConfig, argv=["--set", 'rubric=[{"id": "a", "text": "t", "weight": 0.4}]']
        )
    with pytest.raises(ConfigError, match="default_judge 'big' is not in judges"):
        load_config(RewardConfig, argv=["--set", "default_judge=big"])
    with pytest.raises(ConfigError, match="environment variable name"):
        load_config(RewardConfig, argv=["--set", "env.token_env=not a name"])
    with pytest.raises(ConfigError, match="built-in GUI state judge"):
        load_config(
            RewardConfig, argv=["--set", 'judges={"builtin:gui-state": {"kind": "scripted"}}']
        )
    config = load_config(RewardConfig, argv=["--set", "judges.default.api_key_env=JUDGE_KEY"])
    with pytest.raises(ValueError, match="JUDGE_KEY is not set"):
        config.judges["default"].endpoint(environ={})
    assert config.judges["default"].endpoint(environ={"JUDGE_KEY": "k"}).api_key == "k"


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_")}


def test_the_process_rejects_a_bad_config_and_names_the_key() -> None:
    done = subprocess.run(
        [REWARD, "--set", "tests.default_timeout_s=-1"],
        capture_output=True, text=True, env=_clean_env(), timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "tests.default_timeout_s" in done.stderr


def test_the_process_serves_and_drains_on_sigterm(tmp_path: Path) -> None:
    socket_path = tmp_path / "reward.sock"
    process = subprocess.Popen(
        [REWARD, "--listen", f"unix:{socket_path}", "--grace-period-s", "1"],
        stderr=subprocess.PIPE, env=_clean_env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        with grpc.insecure_channel(f"unix:{socket_path}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                assert process.poll() is None, process.stderr and process.stderr.read()
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, "orchard-reward did not serve within 30 s"
                time.sleep(0.05)
            stub = reward_service_pb2_grpc.RewardServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.JudgeOutcome(api.JudgeOutcomeRequest(intent=""), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert not socket_path.exists()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
