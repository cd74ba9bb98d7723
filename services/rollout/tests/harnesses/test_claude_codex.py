"""Claude Code (Anthropic Messages) and Codex (OpenAI Responses), unmodified from the harness
cache, run inside a REAL sandbox (orchard-env, local runtime; root) and write a file through
their own shell tool (`Bash`, `shell`), driven by a scripted teacher behind the capture proxy:
the task's check passes and every call comes back as a CallRecord in the tokenizer's tokens."""

from __future__ import annotations

import dataclasses

import pytest

from orchard.lm.tokenizer import build_tokenizer
from orchard.rollout.engines.scripted import ScriptedEngine
from orchard.rollout.harnesses.builtin_programs import program_harness
from orchard.rollout.harnesses.sandboxed import HarnessCache
from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig
from orchard.rollout.results import GroupKey, RolloutStatus
from orchard.rollout.runner import ProxyCapture
from orchard.rollout.scripted_policy import PolicyScript
from orchard.rollout.tasks import TaskSpec
from orchard.sdk import AsyncSandboxClient

from .test_openclaw import runner

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(300)]

GREETING = "hello from a program"
WRITE = f"printf '%s\\n' '{GREETING}' > /srv/work/greeting.txt"
TASK = TaskSpec.from_settings(
    "greet-shell",
    "Write the words 'hello from a program' into the file /srv/work/greeting.txt.",
    {"check": {"command": f"test \"$(cat /srv/work/greeting.txt)\" = '{GREETING}'"},
     "workdir": "/srv/work",
     "setup": ["mkdir -p /srv/work"]},
)  # fmt: skip
SCRIPT = PolicyScript.from_json(
    {
        "plans": [
            {
                "match": "into the file /srv/work/greeting.txt",
                "solve_rate": 1.0,
                "solution": [
                    # The abstract shell step: the teacher puts it in the harness's shell tool.
                    {"thought": "I will write the file.", "tool": "shell",
                     "arguments": {"command": WRITE}},
                    {"thought": "The file is written."},
                ],
                "failure": [{"thought": "I cannot."}],
            }
        ]
    }
)  # fmt: skip


@pytest.mark.parametrize(
    ("name", "api"), [("program:claude-code", "messages"), ("program:codex", "responses")]
)
async def test_program_writes_a_file_through_its_shell_tool_and_its_calls_are_captured(
    name: str,
    api: str,
    sandboxes: AsyncSandboxClient,
    harness_cache: HarnessCache,
    reachable_host: str,
) -> None:
    tokenizer = build_tokenizer()
    engine = ScriptedEngine(SCRIPT, tokenizer, seed=0)
    harness = program_harness(name, harness_cache, wall_clock_s=180)
    async with CaptureProxy(
        engine, CaptureProxyConfig(host=reachable_host, settle_quiet_s=0.2)
    ) as proxy:
        run = dataclasses.replace(
            runner(sandboxes, harness_cache, "unused", capture=ProxyCapture(proxy)),
            harnesses={name: harness},
            tasks={TASK.id: TASK},
        )
        result = await run(GroupKey(TASK.id, name), 0)
    record = result.payload
    assert record.failure is None, record.failure
    assert (result.status, result.reward) == (RolloutStatus.COMPLETED, 1.0)
    [event] = record.tool_events
    assert (event.tool, event.exit_code) == (name, 0), event.output[-2000:]
    # The teacher answered every call that reached it (the tool call, then the final answer;
    # a program may make side calls, e.g. a title), and the proxy captured each in tokens.
    assert engine.turns >= 2
    assert len(record.calls) == engine.turns
    for call in record.calls:
        assert call.prompt_token_ids and call.output_token_ids
        assert call.metadata["api"] == api
        assert call.weight_version == engine.weight_version
