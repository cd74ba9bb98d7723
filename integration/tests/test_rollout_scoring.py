"""Rollouts scored through the real reward service: SWE-style tests on the sandbox's diff,
reward-service task checks, and exclusions that never become policy failures.

Real processes: etcd and ``orchard-env`` with the local runtime (root), ``orchard-reward``
talking to it. The rollout runner drives the bash harness against the scripted policy; its
sandboxes run on the ``host`` image, which sees the task repositories built with git on the host
copy-on-write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchard.reward.swe_instances import SweInstance
from orchard.reward.swe_tasks import build_instances
from orchard.rollout.budgets import LayeredRetries, LayerRetry, RolloutBudget
from orchard.rollout.harnesses.bash_react import bash_react_harness
from orchard.rollout.harnesses.tool_loop import ModelEndpoint
from orchard.rollout.provenance import FailureLayer
from orchard.rollout.results import GroupKey, RolloutStatus
from orchard.rollout.runner import RolloutRunner
from orchard.rollout.scoring import RewardServiceScorer
from orchard.rollout.scripted_policy import PolicyScript, ScriptedPolicyServer
from orchard.rollout.tasks import TaskSpec
from orchard.sdk import AsyncSandboxClient

from .conftest import EnvStack, free_port

pytestmark = [pytest.mark.root, pytest.mark.slow]

BIN = Path(sys.executable).parent
STATS = "orchard-tasks__stats-1"
REPORT_TASK = {
    "completion": [{"name": "report says done", "command": "grep -q done /srv/report.txt"}],
    "safety": [{"name": "hostname kept", "command": "test -s /etc/hostname"}],
}
FAST_RETRIES = LayeredRetries(
    sandbox_create=LayerRetry(attempts=2, timeout_s=60, initial_backoff_s=0.01),
    inference=LayerRetry(attempts=2, timeout_s=10, initial_backoff_s=0.01),
    tool_exec=LayerRetry(attempts=1, timeout_s=60),
    reward=LayerRetry(attempts=2, timeout_s=120, initial_backoff_s=0.05),
    create_spread_s=0.05,
)


def wait_serving(address: str, process: subprocess.Popen[bytes], log: Path) -> None:
    """Until the process's gRPC health says SERVING (fails with its log if it exits)."""
    deadline = time.monotonic() + 60
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)


def stop_process(process: subprocess.Popen[bytes], log: Path) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            assert process.wait(30) == 0, log.read_text()[-3000:]
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


@dataclass
class RewardStack:
    env: EnvStack
    reward_endpoint: str
    instances: dict[str, SweInstance]


def start_reward(
    root: Path, env: EnvStack, **sections: Any
) -> tuple[str, subprocess.Popen[bytes], Path]:
    """orchard-reward on loopback, reaching ``env``; ``sections`` are more top-level config
    sections (e.g. ``judges``)."""
    address = f"127.0.0.1:{free_port()}"
    config = {
        "server": {"listen": [address], "grace_period_s": 2},
        "env": {"endpoint": env.endpoint, "token_env": "ROLLOUT_TEST_ENV_TOKEN"},
        "tests": {"default_timeout_s": 120, "sandbox_heartbeat_timeout_s": 30},
        "tasks": {"write-report": REPORT_TASK},
        **sections,
    }
    config_path = root / "reward.json"
    config_path.write_text(json.dumps(config))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ORCHARD_")}
    environ["ROLLOUT_TEST_ENV_TOKEN"] = env.token
    log = root / "reward.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            [str(BIN / "orchard-reward"), "--config", str(config_path)], stderr=out, env=environ
        )
    wait_serving(address, process, log)
    return address, process, log


@pytest.fixture(scope="module")
def reward_stack(
    tmp_path_factory: pytest.TempPathFactory, env_stack: EnvStack
) -> Iterator[RewardStack]:
    root = tmp_path_factory.mktemp("rollout-scoring")
    instances = {i.instance_id: i for i in build_instances(root / "repos")}
    address, process, log = start_reward(root, env_stack)
    try:
        yield RewardStack(env_stack, address, instances)
    finally:
        stop_process(process, log)


def swe_settings(instance: SweInstance, **extra: Any) -> dict[str, Any]:
    """scorer_json for a SWE instance: its TestTask fields and where its repository is."""
    task = json_format.MessageToDict(instance.to_task(), preserving_proto_field_name=True)
    return {"tests": {**task, "repo_path": instance.repo_path, **extra}}


def stats_script(repo: str, solve_rate: float) -> PolicyScript:
    stats = f"{repo}/stats.py"
    return PolicyScript.from_json(
        {
            "plans": [
                {
                    "match": "mean drops",
                    "solve_rate": solve_rate,
                    "solution": [
                        {"thought": "Divide exactly.", "tool": "edit",
                         "arguments": {"path": stats, "old_text": "// len", "new_text": "/ len"}},
                        {"thought": "Done.", "tool": "submit", "arguments": {}},
                    ],
                    "failure": [
                        {"thought": "Round it instead.", "tool": "edit",
                         "arguments": {"path": stats, "old_text": "total(values) // len(values)",
                                       "new_text": "round(total(values) / len(values))"}},
                        {"thought": "Done.", "tool": "submit", "arguments": {}},
                    ],
                },
                {
                    "match": "report",
                    "solve_rate": solve_rate,
                    "solution": [
                        {"thought": "Write it.", "tool": "bash",
                         "arguments": {"command": "mkdir -p /srv && echo done > /srv/report.txt"}},
                        {"thought": "Written."},
                    ],
                    "failure": [{"thought": "Nothing to do."}],
                },
            ]
        }
    )  # fmt: skip


@pytest.fixture
async def sandboxes(reward_stack: RewardStack) -> AsyncIterator[AsyncSandboxClient]:
    async with AsyncSandboxClient(reward_stack.env.endpoint, token=reward_stack.env.token) as c:
        yield c
        assert [s.id async for s in c.list({"orchard-test": "scoring"})] == []


@pytest.fixture
async def scorer(reward_stack: RewardStack) -> AsyncIterator[RewardServiceScorer]:
    async with RewardServiceScorer(reward_stack.reward_endpoint) as scorer:
        yield scorer


def runner(
    sandboxes: AsyncSandboxClient, scorer: RewardServiceScorer, base_url: str, task: TaskSpec
) -> RolloutRunner:
    return RolloutRunner(
        sandboxes=sandboxes,
        endpoint=ModelEndpoint(base_url=base_url, model="teacher"),
        harnesses={"builtin:bash": bash_react_harness()},
        tasks={task.id: task},
        budget=RolloutBudget(max_steps=6, max_duration_s=120),
        retries=FAST_RETRIES,
        scorer=scorer,
        labels={"orchard-test": "scoring"},
        seed=1,
    )


def stats_task(instance: SweInstance, **extra: Any) -> TaskSpec:
    return TaskSpec.from_settings(
        "stats", instance.problem_statement, swe_settings(instance, **extra)
    )


@pytest.mark.parametrize(("solve_rate", "reward"), [(1.0, 1.0), (0.0, -1.0)])
async def test_the_sandbox_diff_is_scored_by_the_tests(
    reward_stack: RewardStack,
    sandboxes: AsyncSandboxClient,
    scorer: RewardServiceScorer,
    solve_rate: float,
    reward: float,
) -> None:
    instance = reward_stack.instances[STATS]
    async with ScriptedPolicyServer(stats_script(instance.repo_path, solve_rate)) as policy:
        run = runner(sandboxes, scorer, policy.base_url, stats_task(instance))
        result = await run(GroupKey("stats", "builtin:bash"), 0)
    record = result.payload
    assert record.failure is None, record.failure
    assert (result.status, result.reward) == (RolloutStatus.COMPLETED, reward)
    assert record.reward.scorer == "tests"
    assert [e.tool for e in record.tool_events] == ["edit", "submit"]
    # The evidence shows the candidate patch was the policy's edit, applied by the service.
    evidence = "\n".join(f"{e.title}\n{e.text}" for e in record.reward.evidence)
    assert "test_mean_keeps_the_fraction" in evidence


async def test_a_test_run_past_its_time_limit_is_excluded_not_a_policy_failure(
    reward_stack: RewardStack, sandboxes: AsyncSandboxClient, scorer: RewardServiceScorer
) -> None:
    instance = reward_stack.instances[STATS]
    async with ScriptedPolicyServer(stats_script(instance.repo_path, 1.0)) as policy:
        task = stats_task(instance, timeout_s=0.01)
        result = await runner(sandboxes, scorer, policy.base_url, task)(
            GroupKey("stats", "builtin:bash"), 0
        )
    assert (result.status, result.reward) == (RolloutStatus.ABORTED, None)
    failure = result.payload.failure
    assert failure.layer is FailureLayer.REWARD
    assert "reward excluded (timeout)" in failure.error


# safety x (0.8 completion + 0.2 robustness); no robustness checks count 1.0.
@pytest.mark.parametrize(("solve_rate", "reward"), [(1.0, 1.0), (0.0, 0.2)])
async def test_a_reward_service_task_is_scored_by_its_checks(
    reward_stack: RewardStack,
    sandboxes: AsyncSandboxClient,
    scorer: RewardServiceScorer,
    solve_rate: float,
    reward: float,
) -> None:
    task = TaskSpec.from_settings("report", "Write the report.", {"score_task": "write-report"})
    async with ScriptedPolicyServer(stats_script("/unused", solve_rate)) as policy:
        result = await runner(sandboxes, scorer, policy.base_url, task)(
            GroupKey("report", "builtin:bash"), 0
        )
    assert (result.status, result.reward) == (RolloutStatus.COMPLETED, reward)
    assert result.payload.reward.scorer == "task_score"


async def test_an_unknown_reward_task_aborts_with_the_services_message(
    reward_stack: RewardStack, sandboxes: AsyncSandboxClient, scorer: RewardServiceScorer
) -> None:
    task = TaskSpec.from_settings("report", "Write the report.", {"score_task": "no-such-task"})
    async with ScriptedPolicyServer(stats_script("/unused", 1.0)) as policy:
        result = await runner(sandboxes, scorer, policy.base_url, task)(
            GroupKey("report", "builtin:bash"), 0
        )
    assert (result.status, result.reward) == (RolloutStatus.ABORTED, None)
    failure = result.payload.failure
    assert failure.layer is FailureLayer.REWARD
    assert "INVALID_ARGUMENT" in failure.error and "no-such-task" in failure.error
