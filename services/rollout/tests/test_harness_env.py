"""Harnesses driven against the scripted policy over HTTP, their tools run in REAL sandboxes
through the environment service (``orchard up``; root): solved and failed tasks, budgets, an
unreachable model endpoint, the generic loop with a tool the task declares, and a BAR group."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from orchard.rollout.budgets import LayeredRetries, LayerRetry, RolloutBudget
from orchard.rollout.harnesses.bash_react import bash_react_harness, generic_tool_harness
from orchard.rollout.harnesses.tool_loop import ModelEndpoint
from orchard.rollout.provenance import FailureLayer, render_rollout
from orchard.rollout.results import GroupKey, RolloutStatus
from orchard.rollout.runner import RolloutRunner
from orchard.rollout.samplers import BalancedAdaptiveSampler
from orchard.rollout.scripted_policy import PolicyScript, ScriptedPolicyServer
from orchard.rollout.tasks import TaskSpec
from orchard.sdk import AsyncSandboxClient, RetryPolicy

pytestmark = [pytest.mark.root, pytest.mark.slow]

CALC = "/srv/task/calc.py"
SHOW_SUM = "import sys; sys.path.insert(0, '/srv/task'); import calc; print(calc.add(2, 3))"
CALC_TASK = TaskSpec.from_settings(
    "calc",
    "Please fix calc: add(a, b) in /srv/task/calc.py must return the sum.",
    {
        "setup": [f"mkdir -p /srv/task && printf 'def add(a, b):\\n    return a - b\\n' > {CALC}"],
        "check": {
            "command": "cd /srv/task && python3 -c 'import calc; assert calc.add(2, 3) == 5'"
        },
    },
)
LOOKUP_TASK = TaskSpec.from_settings(
    "lookup",
    "Record the answer for the key abc with the record tool.",
    {
        "check": {"command": "grep -q '\"abc\"' /srv/answer.json"},
        "tools": [
            {
                "name": "record",
                "description": "store an answer",
                "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
                "command": [
                    "/bin/sh",
                    "-c",
                    "mkdir -p /srv && cat > /srv/answer.json && echo stored",
                ],
            }
        ],
    },
)


def plans(calc_rate: float) -> PolicyScript:
    return PolicyScript.from_json(
        {
            "plans": [
                {
                    "match": "fix calc",
                    "solve_rate": calc_rate,
                    "solution": [
                        {"thought": "Let me read the code.", "tool": "view",
                         "arguments": {"path": CALC}},
                        {"thought": "It subtracts.", "tool": "edit",
                         "arguments": {"path": CALC, "old_text": "a - b", "new_text": "a + b"}},
                        {"thought": "Check it.", "tool": "bash",
                         "arguments": {"command": f"python3 -c {SHOW_SUM!r}"}},
                        {"thought": "Fixed.", "tool": "submit", "arguments": {"summary": "a + b"}},
                    ],
                    "failure": [
                        {"thought": "Probably the order is wrong.", "tool": "edit",
                         "arguments": {"path": CALC, "old_text": "a - b", "new_text": "b - a"}},
                        {"thought": "Done.", "tool": "submit", "arguments": {}},
                    ],
                },
                {
                    "match": "key abc",
                    "solve_rate": 1.0,
                    "solution": [
                        {"thought": "Record it.", "tool": "record", "arguments": {"key": "abc"}},
                        {"thought": "The answer is recorded."},
                    ],
                    "failure": [{"thought": "No idea."}],
                },
            ]
        }
    )  # fmt: skip


FAST_RETRIES = LayeredRetries(
    sandbox_create=LayerRetry(attempts=2, timeout_s=60, initial_backoff_s=0.01),
    inference=LayerRetry(attempts=2, timeout_s=10, initial_backoff_s=0.01),
    tool_exec=LayerRetry(attempts=1, timeout_s=60),
    reward=LayerRetry(attempts=1, timeout_s=60),
    create_spread_s=0.05,
)


@pytest.fixture
async def sandboxes(env_service: dict[str, Any]) -> AsyncIterator[AsyncSandboxClient]:
    async with AsyncSandboxClient(
        profile=env_service["profile"], retry=RetryPolicy(initial_backoff=0.05)
    ) as client:
        yield client
        # Every rollout deletes its sandbox.
        assert [s.id async for s in client.list()] == []


def runner(
    sandboxes: AsyncSandboxClient, base_url: str, *, budget: RolloutBudget | None = None
) -> RolloutRunner:
    return RolloutRunner(
        sandboxes=sandboxes,
        endpoint=ModelEndpoint(base_url=base_url, model="teacher"),
        harnesses={"builtin:bash": bash_react_harness(), "builtin:tools": generic_tool_harness()},
        tasks={"calc": CALC_TASK, "lookup": LOOKUP_TASK},
        budget=budget or RolloutBudget(max_steps=10, max_duration_s=120),
        retries=FAST_RETRIES,
        seed=3,
    )


async def test_a_solved_task_is_completed_scored_one_and_recorded_in_order(
    sandboxes: AsyncSandboxClient,
) -> None:
    async with ScriptedPolicyServer(plans(1.0)) as policy:
        run = runner(sandboxes, policy.base_url)
        result = await run(GroupKey("calc", "builtin:bash"), 0)
    record = result.payload
    assert (result.status, result.reward) == (RolloutStatus.COMPLETED, 1.0)
    assert record.outcome == "submitted"
    assert [e.tool for e in record.tool_events] == ["view", "edit", "bash", "submit"]
    assert "return a - b" in record.tool_events[0].output
    assert record.tool_events[2].output.splitlines() == ["exit code 0", "5"]
    assert len(record.sandbox_ids) == 1
    assert record.tool_events[0].sandbox_id == record.sandbox_ids[0]
    assert record.steps == 4
    assert record.messages[-1] == {
        "role": "tool",
        "tool_call_id": record.tool_events[-1].call_id,
        "content": "submitted",
    }
    assert record.reward.evidence[0].title.startswith("$ cd /srv/task")
    shown = render_rollout(record)
    assert shown.index("tool view") < shown.index("tool edit") < shown.index("tool submit")
    assert "reward 1 by command_check" in shown


async def test_a_failed_task_is_a_policy_failure_scored_zero(sandboxes: AsyncSandboxClient) -> None:
    async with ScriptedPolicyServer(plans(0.0)) as policy:
        result = await runner(sandboxes, policy.base_url)(GroupKey("calc", "builtin:bash"), 0)
    assert (result.status, result.reward) == (RolloutStatus.COMPLETED, 0.0)
    assert result.payload.failure is None
    assert "exited 1" in result.payload.reward.detail


async def test_the_step_budget_truncates_and_the_rollout_is_still_scored(
    sandboxes: AsyncSandboxClient,
) -> None:
    async with ScriptedPolicyServer(plans(1.0)) as policy:
        run = runner(sandboxes, policy.base_url, budget=RolloutBudget(max_steps=2))
        result = await run(GroupKey("calc", "builtin:bash"), 0)
    # The fix was made in step 2, but the loop stopped before it could submit.
    assert (result.status, result.reward) == (RolloutStatus.TRUNCATED, 1.0)
    assert result.payload.outcome == "step_limit"
    assert [e.tool for e in result.payload.tool_events] == ["view", "edit"]


async def test_an_unreachable_model_aborts_the_rollout_as_an_inference_failure(
    sandboxes: AsyncSandboxClient,
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    result = await runner(sandboxes, closed)(GroupKey("calc", "builtin:bash"), 0)
    assert (result.status, result.reward) == (RolloutStatus.ABORTED, None)
    failure = result.payload.failure
    assert failure.layer is FailureLayer.INFERENCE
    assert failure.attempts == 2
    assert "APIConnectionError" in failure.error
    assert "infrastructure failure in inference" in render_rollout(result.payload)


async def test_the_generic_loop_runs_a_tool_the_task_declares(
    sandboxes: AsyncSandboxClient,
) -> None:
    async with ScriptedPolicyServer(plans(1.0)) as policy:
        result = await runner(sandboxes, policy.base_url)(GroupKey("lookup", "builtin:tools"), 0)
    assert (result.status, result.reward) == (RolloutStatus.COMPLETED, 1.0)
    assert result.payload.outcome == "stopped"
    event = result.payload.tool_events[0]
    assert (event.tool, event.arguments, event.exit_code) == ("record", {"key": "abc"}, 0)
    assert event.output.endswith("stored")


async def test_bar_assembles_a_group_from_real_rollouts(sandboxes: AsyncSandboxClient) -> None:
    async with ScriptedPolicyServer(plans(0.5), seed=11) as policy:
        run = runner(sandboxes, policy.base_url)
        sampler = BalancedAdaptiveSampler(group_size=4, max_rollouts=8, stride=4)
        group = await sampler.sample(GroupKey("calc", "builtin:bash"), run)
    assert len(group.members) == 4
    for member in [*group.rollouts]:
        solved_path = member.payload.tool_events[0].tool == "view"
        assert member.reward == (1.0 if solved_path else 0.0)
    assert len(run.records) == len(group.rollouts)
    assert len({r.sandbox_ids[0] for r in run.records}) == len(run.records)
