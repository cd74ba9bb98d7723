"""OpenClaw, unmodified from the harness cache, runs inside a REAL sandbox (orchard-env, local
runtime; root) and writes a file through its own `write` tool, its model a scripted teacher
reached through the sandbox's expiring egress rule; and its calls through the capture proxy in
front of a local engine come back as CallRecords with token ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchard.lm.model_folder import save_model_folder
from orchard.lm.models import tiny_causal_lm_for
from orchard.lm.tokenizer import build_tokenizer
from orchard.rollout.budgets import LayeredRetries, LayerRetry, RolloutBudget
from orchard.rollout.engines.local import LocalEngine, LocalEngineConfig
from orchard.rollout.harnesses.builtin_programs import program_harness
from orchard.rollout.harnesses.sandboxed import HarnessCache
from orchard.rollout.harnesses.tool_loop import ModelEndpoint
from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig
from orchard.rollout.results import GroupKey, RolloutStatus
from orchard.rollout.runner import ProxyCapture, RolloutRunner
from orchard.rollout.scripted_policy import PolicyScript, ScriptedPolicyServer
from orchard.rollout.tasks import TaskSpec
from orchard.sdk import AsyncSandboxClient

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(300)]

GREETING = "hello from openclaw"
TASK = TaskSpec.from_settings(
    "greet",
    "Write the words 'hello from openclaw' into the file greeting.txt.",
    {"check": {"command": f"test \"$(cat /srv/work/greeting.txt)\" = '{GREETING}'"},
     "workdir": "/srv/work",
     "setup": ["mkdir -p /srv/work"]},
)  # fmt: skip
SCRIPT = PolicyScript.from_json(
    {
        "plans": [
            {
                "match": "into the file greeting.txt",
                "solve_rate": 1.0,
                "solution": [
                    # OpenClaw's own file tool: `write` {path, content}.
                    {"thought": "I will write the file.", "tool": "write",
                     "arguments": {"path": "greeting.txt", "content": GREETING}},
                    {"thought": "The file is written."},
                ],
                "failure": [{"thought": "I cannot."}],
            }
        ]
    }
)  # fmt: skip
RETRIES = LayeredRetries(
    sandbox_create=LayerRetry(attempts=2, timeout_s=60, initial_backoff_s=0.01),
    reward=LayerRetry(attempts=1, timeout_s=60),
    create_spread_s=0.0,
)


def runner(
    sandboxes: AsyncSandboxClient, cache: HarnessCache, base_url: str, **kwargs: object
) -> RolloutRunner:
    return RolloutRunner(
        sandboxes=sandboxes,
        endpoint=ModelEndpoint(base_url=base_url, model="teacher", max_tokens_per_call=64),
        harnesses={"program:openclaw": program_harness("program:openclaw", cache)},
        tasks={"greet": TASK},
        budget=RolloutBudget(max_duration_s=240),
        retries=RETRIES,
        seed=1,
        **kwargs,  # type: ignore[arg-type]
    )


async def test_openclaw_writes_a_file_through_its_own_tool_in_the_sandbox(
    sandboxes: AsyncSandboxClient, harness_cache: HarnessCache, reachable_host: str
) -> None:
    async with ScriptedPolicyServer(SCRIPT, host=reachable_host) as teacher:
        result = await runner(sandboxes, harness_cache, teacher.base_url)(
            GroupKey("greet", "program:openclaw"), 0
        )
        requests = teacher.requests
    record = result.payload
    assert record.failure is None, record.failure
    assert (result.status, result.reward) == (RolloutStatus.COMPLETED, 1.0)
    assert requests == 2
    [event] = record.tool_events
    assert (event.tool, event.exit_code) == ("program:openclaw", 0)
    printed = json.loads(event.output)
    assert printed["ok"] is True
    assert record.messages[-1] == {"role": "assistant", "content": "The file is written."}


async def test_openclaw_calls_through_the_capture_proxy_are_captured_with_token_ids(
    sandboxes: AsyncSandboxClient,
    harness_cache: HarnessCache,
    reachable_host: str,
    tmp_path: Path,
) -> None:
    # A tiny model with a context for OpenClaw's prompt (~13k tokens of system prompt and tool
    # schemas); untrained, it answers without valid tool calls, so OpenClaw ends its turn.
    tokenizer = build_tokenizer()
    model = tiny_causal_lm_for(tokenizer, seed=0, context=65536)
    folder = save_model_folder(tmp_path / "tiny", model, tokenizer)
    config = LocalEngineConfig(model_folder=str(folder), weight_version="tiny-v1")
    async with (
        LocalEngine(config) as engine,
        CaptureProxy(engine, CaptureProxyConfig(host=reachable_host, settle_quiet_s=0.2)) as proxy,
    ):
        run = runner(sandboxes, harness_cache, "unused", capture=ProxyCapture(proxy))
        result = await run(GroupKey("greet", "program:openclaw"), 0)
    record = result.payload
    assert record.failure is None, record.failure
    assert result.status is RolloutStatus.COMPLETED
    assert record.tool_events[0].exit_code == 0
    assert record.calls, "no call was captured"
    for call in record.calls:
        assert call.prompt_token_ids and call.output_token_ids
        assert len(call.output_logprobs) == len(call.output_token_ids)
        assert call.weight_version == "tiny-v1"
    # What OpenClaw sent is what the model saw: its system prompt, the task, its own tools.
    assert "greeting.txt" in json.dumps(record.calls[0].request_messages)
