"""A program that ends without one model call reaching the capture proxy (it could not reach
it, or failed before asking) is an infrastructure failure, never a policy outcome to score:
hermes, for one, prints "Connection error" and exits 0 when its endpoint does not answer."""

from __future__ import annotations

import dataclasses

import pytest

from orchard.lm.tokenizer import build_tokenizer
from orchard.rollout.budgets import LayeredRetries, LayerRetry, RolloutBudget
from orchard.rollout.engines.scripted import ScriptedEngine
from orchard.rollout.harnesses.builtin_programs import program_harness
from orchard.rollout.harnesses.sandboxed import HarnessCache
from orchard.rollout.harnesses.tool_loop import ModelEndpoint
from orchard.rollout.provenance import FailureLayer
from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig
from orchard.rollout.results import GroupKey, RolloutStatus
from orchard.rollout.runner import ProxyCapture, RolloutRunner
from orchard.rollout.scripted_policy import PolicyScript
from orchard.rollout.tasks import TaskSpec
from orchard.sdk import AsyncSandboxClient

pytestmark = [pytest.mark.root, pytest.mark.timeout(120)]

TASK = TaskSpec.from_settings("noop", "Do nothing.", {"check": {"command": "true"}})
SCRIPT = PolicyScript.from_json(
    {"plans": [{"match": "Do", "solve_rate": 1.0, "solution": [{"thought": "ok"}],
                "failure": [{"thought": "no"}]}]}
)  # fmt: skip


async def test_a_program_that_never_asked_the_model_is_not_scored(
    sandboxes: AsyncSandboxClient, harness_cache: HarnessCache, reachable_host: str
) -> None:
    silent = dataclasses.replace(
        program_harness("program:hermes", harness_cache),
        command=("sh", "-c", "echo 'API call failed after 3 retries: Connection error.'"),
    )
    engine = ScriptedEngine(SCRIPT, build_tokenizer())
    async with CaptureProxy(engine, CaptureProxyConfig(host=reachable_host)) as proxy:
        run = RolloutRunner(
            sandboxes=sandboxes,
            endpoint=ModelEndpoint(base_url="unused", model="teacher"),
            harnesses={"program:hermes": silent},
            tasks={"noop": TASK},
            budget=RolloutBudget(max_duration_s=60),
            retries=LayeredRetries(
                sandbox_create=LayerRetry(attempts=1, timeout_s=60),
                reward=LayerRetry(attempts=1, timeout_s=60),
                create_spread_s=0.0,
            ),
            capture=ProxyCapture(proxy, settle_timeout_s=5),
            seed=0,
        )
        result = await run(GroupKey("noop", "program:hermes"), 0)
    assert result.status is RolloutStatus.ABORTED
    assert result.reward is None
    failure = result.payload.failure
    assert failure is not None and failure.layer is FailureLayer.INFERENCE
    assert "without one model call" in failure.error and "Connection error" in failure.error
    assert engine.turns == 0
