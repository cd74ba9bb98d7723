"""A program that gives up because the policy's answer was cut at its tokens per call (Codex
ends the turn with "Incomplete response returned, reason: max_output_tokens" and exits 1; Claude
Code retries and exits 1 the same way) ended because of the policy: the rollout is scored as
truncated ("token_limit"), never excluded as an infrastructure failure. The policy is an untrained
`builtin:tiny-32k`-shaped model on the local engine behind the REAL capture proxy, whose answers
run to the cap; Codex runs unmodified in a REAL sandbox (orchard-env, local runtime; root)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchard.lm.model_folder import save_model_folder
from orchard.lm.models import tiny_causal_lm_for
from orchard.lm.tokenizer import build_tokenizer
from orchard.rollout.budgets import LayeredRetries, LayerRetry, RolloutBudget
from orchard.rollout.engines import create_engine
from orchard.rollout.engines.config import LocalEngineConfig
from orchard.rollout.harnesses.builtin_programs import program_harness
from orchard.rollout.harnesses.sandboxed import HarnessCache
from orchard.rollout.harnesses.tool_loop import ModelEndpoint
from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig
from orchard.rollout.results import GroupKey, RolloutStatus
from orchard.rollout.runner import ProxyCapture, RolloutRunner
from orchard.rollout.tasks import TaskSpec
from orchard.sdk import AsyncSandboxClient

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(300)]

CAP = 64
TASK = TaskSpec.from_settings(
    "say-hi", "Say hi.", {"check": {"command": "test -f /srv/never-written"}}
)


async def test_a_program_that_gives_up_on_a_cut_answer_is_scored_as_truncated(
    sandboxes: AsyncSandboxClient,
    harness_cache: HarnessCache,
    reachable_host: str,
    tmp_path: Path,
) -> None:
    tokenizer = build_tokenizer()
    model = tiny_causal_lm_for(tokenizer, seed=0, context=32768)
    folder = save_model_folder(tmp_path / "student", model, tokenizer)
    engine = create_engine(
        LocalEngineConfig(model_folder=str(folder), weight_version="v0", follow_registry=False)
    )
    config = CaptureProxyConfig(host=reachable_host, max_tokens_cap=CAP, settle_quiet_s=0.2)
    name = "program:codex"
    async with engine, CaptureProxy(engine, config) as proxy:
        run = RolloutRunner(
            sandboxes=sandboxes,
            endpoint=ModelEndpoint(base_url="unused", model="student"),
            harnesses={name: program_harness(name, harness_cache, wall_clock_s=180)},
            tasks={TASK.id: TASK},
            budget=RolloutBudget(max_duration_s=240),
            retries=LayeredRetries(
                sandbox_create=LayerRetry(attempts=1, timeout_s=60),
                reward=LayerRetry(attempts=1, timeout_s=60),
                create_spread_s=0.0,
            ),
            capture=ProxyCapture(proxy),
            seed=0,
        )
        result = await run(GroupKey(TASK.id, name), 0)
    record = result.payload
    [event] = record.tool_events
    assert event.exit_code != 0, event.output[-2000:]  # the program gave up
    assert record.calls and record.calls[-1].finish_reason == "length"
    assert len(record.calls[-1].output_token_ids) == CAP
    # The policy's outcome, scored: truncated, reward 0 by the task's check, not excluded.
    assert record.failure is None, record.failure
    assert result.status is RolloutStatus.TRUNCATED
    assert record.outcome == "token_limit"
    assert result.reward == 0.0
