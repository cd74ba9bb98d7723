"""mini-swe-agent (the PyPI package, unmodified) as a black-box harness: its model endpoint is the
capture proxy in front of the local engine with a tiny model trained here, its commands run in
a REAL sandbox through the environment service (``orchard up``; root)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

# The mini-swe-agent extra of orchard-rollout (`make setup` installs it).
from minisweagent.models.utils.actions_toolcall import BASH_TOOL

from orchard.lm.chat import IM_END, ChatRenderer, ToolCall, format_assistant_text
from orchard.lm.model_folder import save_model_folder
from orchard.lm.models import tiny_causal_lm_for
from orchard.lm.tokenizer import build_tokenizer
from orchard.rollout.budgets import LayeredRetries, RolloutBudget
from orchard.rollout.engines.local import LocalEngine, LocalEngineConfig
from orchard.rollout.harnesses.mini_swe import SUBMIT_MARKER, MiniSweAgentHarness
from orchard.rollout.harnesses.tool_loop import HarnessContext, ModelEndpoint
from orchard.rollout.provenance import RolloutRecord
from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig
from orchard.sdk import AsyncSandboxClient, RetryPolicy

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(900)]

SYSTEM = "You are a software engineer. Run one bash command per step."
INSTANCE = "Task: {{task}}"
TASK = "Report the answer stored in /srv/task."
ANSWER_FILE = "/srv/task/answer.txt"
LOOK = "ls"
SUBMIT = "sh submit.sh"
WORKDIR = "/srv/task"
"""The harness runs every command there."""
SETUP = (
    f"mkdir -p /srv/task && echo forty-two > {ANSWER_FILE}"
    f" && printf 'echo {SUBMIT_MARKER}\\ncat {ANSWER_FILE}\\n' > /srv/task/submit.sh"
)
"""The task's machine holds the answer and a script that submits it the mini-swe-agent way."""
VERSION = "mini-swe-test-v1"


def _answer(command: str) -> str:
    return format_assistant_text("", [ToolCall("bash", json.dumps({"command": command}))])


def _conversations(task: str, seen: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The first prompt of a task, and the second after `ls` showed `seen` (mini-swe-agent's
    tool-calling observation: a JSON object with the output)."""
    first = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Task: {task}"},
    ]
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "bash", "arguments": json.dumps({"command": LOOK})},
    }
    observation = '{\n  "returncode": 0,\n  "output": ' + json.dumps(seen + "\n") + "\n}"
    later = [
        *first,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": observation},
    ]
    return first, later


def _train(model: Any, tokenizer: Any, max_passes: int = 200) -> None:
    """SFT until the model answers every prompt by running the task's submit script: passes
    over the samples until every one's loss is small."""
    renderer = ChatRenderer(tokenizer)
    samples = []
    for task, seen in ((TASK, "answer.txt\nsubmit.sh"), ("List the files.", "notes.txt")):
        first, later = _conversations(task, seen)
        samples += [(first, SUBMIT), (later, SUBMIT)]
    encoded = []
    for messages, command in samples:
        prompt = list(renderer.render(messages, [BASH_TOOL]).token_ids)
        target = tokenizer.encode(_answer(command) + IM_END, add_special_tokens=False)
        encoded.append((prompt, target))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    model.train()
    for _ in range(max_passes):
        losses = []
        for prompt, target in encoded:
            ids = torch.tensor([prompt + target])
            labels = torch.tensor([[-100] * len(prompt) + target])
            optimizer.zero_grad()
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        if max(losses) < 0.001:
            break
    model.train(False)


@pytest.fixture(scope="module")
def trained_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = tiny_causal_lm_for(tokenizer, seed=0, context=1024)
    _train(model, tokenizer)
    return save_model_folder(tmp_path_factory.mktemp("models") / "mini-swe", model, tokenizer)


@pytest.fixture
async def proxy(trained_folder: Path) -> AsyncIterator[CaptureProxy]:
    config = LocalEngineConfig(model_folder=str(trained_folder), weight_version=VERSION)
    async with (
        LocalEngine(config) as engine,
        CaptureProxy(engine, CaptureProxyConfig(settle_quiet_s=0.05)) as proxy,
    ):
        yield proxy


@pytest.fixture
async def sandboxes(env_service: dict[str, Any]) -> AsyncIterator[AsyncSandboxClient]:
    async with AsyncSandboxClient(
        profile=env_service["profile"], retry=RetryPolicy(initial_backoff=0.05)
    ) as client:
        yield client


async def _run(
    proxy: CaptureProxy, sandboxes: AsyncSandboxClient, rollout_id: str, max_steps: int
) -> tuple[Any, RolloutRecord]:
    endpoint = proxy.open_session(rollout_id)
    model_endpoint = ModelEndpoint(
        base_url=endpoint.base_url,
        model="policy",
        api_key=endpoint.api_key,
        temperature=0,
        max_tokens_per_call=96,
    )
    harness = MiniSweAgentHarness(system_template=SYSTEM, instance_template=INSTANCE, cwd=WORKDIR)
    record = RolloutRecord(rollout_id=rollout_id, task_id="answer", harness=harness.name)
    sandbox = await sandboxes.create(image="host")
    try:
        setup = await sandbox.exec(["/bin/sh", "-c", SETUP])
        assert setup.ok, setup.stderr_text
        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.api_key
        ) as client:
            ctx = HarnessContext(
                rollout_id=rollout_id,
                instruction=TASK,
                sandbox=sandbox,
                client=client,
                endpoint=model_endpoint,
                budget=RolloutBudget(max_steps=max_steps),
                retries=LayeredRetries(),
                record=record,
                rng=random.Random(0),
            )
            outcome = await asyncio.wait_for(harness.run(ctx), timeout=300)
        record.calls = list(await proxy.settle(rollout_id, timeout=10))
    finally:
        await sandbox.delete()
    record.sandbox_ids.append(sandbox.id)
    return outcome, record


async def test_mini_swe_agent_runs_in_the_sandbox_and_its_call_is_captured(
    proxy: CaptureProxy, sandboxes: AsyncSandboxClient, trained_folder: Path
) -> None:
    outcome, record = await _run(proxy, sandboxes, "mini-swe-1", max_steps=5)

    tokenizer = build_tokenizer()
    sampled = "\n----\n".join(
        f"{tokenizer.decode(list(c.prompt_token_ids))[-600:]}\n=> {c.output_text[:200]}"
        for c in record.calls
    )
    assert (outcome.outcome, outcome.truncated) == ("submitted", False), sampled
    # The command the agent chose ran in the sandbox, through the env service, in its cwd.
    assert [e.arguments["command"] for e in record.tool_events] == [SUBMIT]
    assert {e.sandbox_id for e in record.tool_events} == set(record.sandbox_ids)
    assert record.tool_events[0].output.splitlines() == [SUBMIT_MARKER, "forty-two"]
    assert [e.exit_code for e in record.tool_events] == [0]
    # mini-swe-agent's own exit message carries the submission: the file from the sandbox.
    assert record.messages[-1] == {"role": "exit", "content": "forty-two\n"}
    assert record.steps == 1

    # The model call was captured with exact tokens and the weight version.
    [call] = record.calls
    assert (call.seq, call.weight_version) == (0, VERSION)
    renderer = ChatRenderer(tokenizer)
    assert call.request_messages[0] == {"role": "system", "content": SYSTEM}
    assert call.request_messages[1] == {"role": "user", "content": f"Task: {TASK}"}
    assert (
        call.prompt_token_ids == renderer.render(list(call.request_messages), [BASH_TOOL]).token_ids
    )
    assert call.tool_calls[0]["function"]["arguments"] == json.dumps({"command": SUBMIT})
    assert record.tool_events[0].call_id == call.tool_calls[0]["id"]
    assert len(call.output_logprobs) == len(call.output_token_ids) > 0
    assert all(lp <= 0 for lp in call.output_logprobs)
    assert record.sampled_tokens == len(call.output_token_ids)
