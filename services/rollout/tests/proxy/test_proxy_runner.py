"""The runner with the capture proxy as its capture source: the bash harness talks to the local
engine through the proxy, its tools run in REAL sandboxes (``orchard up``; root), and the
rollout's record holds the exact captured tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from orchard.lm.chat import ChatRenderer
from orchard.rollout.budgets import LayeredRetries, LayerRetry, RolloutBudget
from orchard.rollout.harnesses.tool_loop import ModelEndpoint, ToolCallingHarness
from orchard.rollout.harnesses.tools import BashTool
from orchard.rollout.results import GroupKey, RolloutStatus
from orchard.rollout.runner import ProxyCapture, RolloutRunner
from orchard.rollout.tasks import TaskSpec
from orchard.rollout.trajectory_tree import build_tree
from orchard.sdk import AsyncSandboxClient, RetryPolicy

from .conftest import WEIGHT_VERSION

pytestmark = [pytest.mark.root, pytest.mark.slow]

# One tool and a short prompt: the tiny model's context is 512 tokens.
HARNESS = ToolCallingHarness("builtin:bash", "Use bash.", tools=(BashTool(cwd="/srv"),))
TASK = TaskSpec.from_settings(
    "listing",
    "List the files.",
    {"setup": ["mkdir -p /srv && touch /srv/a.txt"], "check": {"command": "test -f /srv/b"}},
)


@pytest.fixture
async def sandboxes(env_service: dict[str, Any]) -> AsyncIterator[AsyncSandboxClient]:
    async with AsyncSandboxClient(
        profile=env_service["profile"], retry=RetryPolicy(initial_backoff=0.05)
    ) as client:
        yield client
        assert [s.id async for s in client.list({"orchard-test": "proxy-runner"})] == []


async def test_calls_through_the_proxy_are_captured_with_exact_tokens(
    proxy: Any, sandboxes: AsyncSandboxClient
) -> None:
    runner = RolloutRunner(
        sandboxes=sandboxes,
        endpoint=ModelEndpoint(
            base_url="unused", model="policy", temperature=0.0, max_tokens_per_call=64
        ),
        harnesses={"builtin:bash": HARNESS},
        tasks={TASK.id: TASK},
        budget=RolloutBudget(max_steps=3, max_duration_s=120),
        retries=LayeredRetries(
            sandbox_create=LayerRetry(attempts=2, timeout_s=60, initial_backoff_s=0.01),
            inference=LayerRetry(attempts=1, timeout_s=60),
            create_spread_s=0.01,
        ),
        capture=ProxyCapture(proxy, settle_timeout_s=10),
        labels={"orchard-test": "proxy-runner"},
        seed=0,
    )
    result = await runner(GroupKey("listing", "builtin:bash"), 0)
    record = result.payload
    assert record.failure is None, record.failure
    # Greedy: the model calls `ls` first (as trained); it may stop or hit the step budget after.
    assert result.status in (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED)
    assert result.reward == 0.0
    assert record.tool_events[0].tool == "bash" and "a.txt" in record.tool_events[0].output
    # One captured call per harness step, in order, each with the engine's weight version.
    assert [c.seq for c in record.calls] == list(range(record.steps))
    assert {c.weight_version for c in record.calls} == {WEIGHT_VERSION}
    assert [len(c.output_logprobs) for c in record.calls] == [
        len(c.output_token_ids) for c in record.calls
    ]
    first = record.calls[0]
    # The first prompt is exactly the chat template over what the harness sent.
    rendered = ChatRenderer(proxy.engine.tokenizer).render(
        list(first.request_messages), [t.schema() for t in HARNESS.tools]
    )
    assert first.prompt_token_ids == tuple(rendered.token_ids)
    # Each later prompt extends the one before with its sampled tokens: one path, no retries.
    assert record.steps >= 2
    second = record.calls[1]
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    tree = build_tree(record.calls)
    assert len(tree.paths) == 1 and len(tree.paths[0].nodes) == record.steps
    assert result.length == sum(len(c.output_token_ids) for c in record.calls)
    # The session is closed once the rollout ends.
    with pytest.raises(KeyError):
        proxy.session(record.rollout_id)
