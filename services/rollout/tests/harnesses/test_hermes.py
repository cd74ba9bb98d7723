"""hermes-agent, unmodified from the harness cache, runs inside a REAL sandbox (orchard-env,
local runtime; root) and writes a file through its own `write_file` tool, its model a scripted
teacher reached through the sandbox's expiring egress rule."""

from __future__ import annotations

import pytest

from orchard.rollout.budgets import LayeredRetries, LayerRetry, RolloutBudget
from orchard.rollout.harnesses.builtin_programs import program_harness
from orchard.rollout.harnesses.sandboxed import HarnessCache
from orchard.rollout.harnesses.tool_loop import ModelEndpoint
from orchard.rollout.results import GroupKey, RolloutStatus
from orchard.rollout.runner import RolloutRunner
from orchard.rollout.scripted_policy import PolicyScript, ScriptedPolicyServer
from orchard.rollout.tasks import TaskSpec
from orchard.sdk import AsyncSandboxClient

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(300)]

NOTE = "hermes was here"
TASK = TaskSpec.from_settings(
    "note",
    "Put the sentence 'hermes was here' in the file /srv/work/note.txt.",
    {"check": {"command": f"test \"$(cat /srv/work/note.txt)\" = '{NOTE}'"},
     "workdir": "/srv/work", "setup": ["mkdir -p /srv/work"]},
)  # fmt: skip
SCRIPT = PolicyScript.from_json(
    {
        "plans": [
            {
                "match": "in the file /srv/work/note.txt",
                "solve_rate": 1.0,
                "solution": [
                    # hermes's own file tool: `write_file` {path, content}.
                    {"thought": "Writing the note.", "tool": "write_file",
                     "arguments": {"path": "/srv/work/note.txt", "content": NOTE}},
                    {"thought": "The note is in place."},
                ],
                "failure": [{"thought": "I cannot."}],
            }
        ]
    }
)  # fmt: skip


async def test_hermes_writes_a_file_through_its_own_tool_in_the_sandbox(
    sandboxes: AsyncSandboxClient, harness_cache: HarnessCache, reachable_host: str
) -> None:
    async with ScriptedPolicyServer(SCRIPT, host=reachable_host) as teacher:
        run = RolloutRunner(
            sandboxes=sandboxes,
            endpoint=ModelEndpoint(base_url=teacher.base_url, model="teacher"),
            harnesses={"program:hermes": program_harness("program:hermes", harness_cache)},
            tasks={"note": TASK},
            budget=RolloutBudget(max_duration_s=240),
            retries=LayeredRetries(
                sandbox_create=LayerRetry(attempts=2, timeout_s=60, initial_backoff_s=0.01),
                reward=LayerRetry(attempts=1, timeout_s=60),
                create_spread_s=0.0,
            ),
            seed=1,
        )
        result = await run(GroupKey("note", "program:hermes"), 0)
        requests = teacher.requests
    record = result.payload
    assert record.failure is None, record.failure
    assert (result.status, result.reward) == (RolloutStatus.COMPLETED, 1.0)
    assert requests >= 2
    [event] = record.tool_events
    assert (event.tool, event.exit_code) == ("program:hermes", 0)
    assert "The note is in place." in event.output
