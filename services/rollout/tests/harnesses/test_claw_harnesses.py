"""A Claw task end to end through unmodified agent programs: OpenClaw and Claude Code, each in a
REAL sandbox (orchard-env, local runtime; root) holding the task's tools from an artifact store,
driven by the claw teacher (`teacher_script`, always on its solution path) behind the capture
proxy, and scored by a REAL orchard-reward's ScoreTask through the rollout runner. The captured
calls of a mixed group (the same task through both programs) rebuild into trajectories."""

from __future__ import annotations

import os
import shlex
from collections.abc import AsyncIterator, Awaitable, Mapping
from pathlib import Path
from typing import Any, Protocol

import pytest

from orchard.core.artifacts import ArtifactStore
from orchard.core.config import ServerConfig
from orchard.lm.tokenizer import build_tokenizer
from orchard.reward.config import EnvServiceConfig, RewardConfig
from orchard.reward.main import RewardApplication
from orchard.rollout.budgets import RolloutBudget
from orchard.rollout.engines.scripted import ScriptedEngine
from orchard.rollout.export import rollout_rows
from orchard.rollout.harnesses.builtin_programs import program_harness
from orchard.rollout.harnesses.sandboxed import HarnessCache
from orchard.rollout.harnesses.tool_loop import ModelEndpoint
from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig
from orchard.rollout.results import GroupKey, RolloutResult, RolloutStatus
from orchard.rollout.runner import ProxyCapture, RolloutRunner
from orchard.rollout.scoring import RewardServiceScorer
from orchard.rollout.scripted_policy import PolicyScript
from orchard.rollout.task_files import StoreFiles
from orchard.rollout.trajectory_tree import build_tree, tree_trajectories
from orchard.sdk import AsyncSandboxClient
from orchard.sdk.connection import read_profile
from orchard.tasks.claw.specs import publish_archives, task_spec
from orchard.tasks.claw.suite import make_task
from orchard.tasks.claw.teacher import teacher_script
from orchard.types.v1 import trajectory_pb2

from .test_openclaw import RETRIES

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(300)]

TOKEN_ENV = "CLAW_HARNESS_TEST_ENV_TOKEN"
# Difficulty 1, no seeded fault: `mail search`, then `mail reply`.
TASK = make_task(0, "reply_mail", 0)
PROGRAMS = ("program:openclaw", "program:claude-code")
PASS_MARK = 0.75
# A claw id holds '/', which a capture session's id cannot: the rollout id replaces it.
KEY = TASK.id


def _script() -> PolicyScript:
    script = teacher_script([TASK])
    for plan in script["plans"]:
        plan["solve_rate"] = 1.0  # always the reference solution
    return PolicyScript.from_json(script)


@pytest.fixture
async def reward_target(env_service: Mapping[str, Any]) -> AsyncIterator[str]:
    """A real orchard-reward in this process, scoring through the test's orchard-env."""
    profile = read_profile(Path(env_service["profile"]))
    assert profile is not None
    os.environ[TOKEN_ENV] = profile.token
    config = RewardConfig(
        server=ServerConfig(listen=["127.0.0.1:0"]),
        env=EnvServiceConfig(endpoint=profile.endpoint, token_env=TOKEN_ENV),
    )
    try:
        async with RewardApplication(config).server() as server:
            await server.set_serving()
            yield server.addresses[0]
    finally:
        os.environ.pop(TOKEN_ENV, None)


class RunGroup(Protocol):
    def __call__(
        self, names: tuple[str, ...], *, script: PolicyScript | None = None, mcp: bool = False
    ) -> Awaitable[tuple[list[RolloutResult], ScriptedEngine]]: ...


@pytest.fixture
def run_group(
    sandboxes: AsyncSandboxClient,
    harness_cache: HarnessCache,
    reachable_host: str,
    reward_target: str,
    tmp_path: Path,
) -> RunGroup:
    """Runs one rollout of the task per program named, in that order; the results and the
    teacher."""

    async def run_group(
        names: tuple[str, ...], *, script: PolicyScript | None = None, mcp: bool = False
    ) -> tuple[list[RolloutResult], ScriptedEngine]:
        store = ArtifactStore(f"file://{tmp_path / 'store'}")
        spec = task_spec(TASK, publish_archives(store, mcp=mcp), mcp=mcp)
        engine = ScriptedEngine(script or _script(), build_tokenizer(), seed=0)
        config = CaptureProxyConfig(host=reachable_host, settle_quiet_s=0.2)
        async with (
            CaptureProxy(engine, config) as proxy,
            RewardServiceScorer(reward_target, call_timeout_s=120) as scorer,
        ):
            run = RolloutRunner(
                sandboxes=sandboxes,
                endpoint=ModelEndpoint(base_url="unused", model="teacher"),
                harnesses={n: program_harness(n, harness_cache, wall_clock_s=180) for n in names},
                tasks={KEY: spec},
                budget=RolloutBudget(max_duration_s=240),
                retries=RETRIES,
                capture=ProxyCapture(proxy),
                scorer=scorer,
                files=StoreFiles(store),
                seed=1,
            )
            results = [await run(GroupKey(KEY, name), 0) for name in names]
        return results, engine

    return run_group


def _assert_solved(result: RolloutResult, name: str) -> None:
    record = result.payload
    assert record.failure is None, record.failure
    assert result.status is RolloutStatus.COMPLETED
    [event] = record.tool_events
    assert (event.tool, event.exit_code) == (name, 0), event.output[-2000:]
    assert record.reward is not None and record.reward.scorer, record.reward
    assert result.reward is not None and result.reward >= PASS_MARK, record.reward
    # The solution's two commands and the final answer, each a captured call in tokens.
    assert len(record.calls) >= len(TASK.solution) + 1
    for call in record.calls:
        assert call.prompt_token_ids and call.output_token_ids
        assert len(call.output_logprobs) == len(call.output_token_ids)


@pytest.mark.parametrize("name", PROGRAMS)
async def test_a_program_solves_a_claw_task_scored_by_the_reward_service(
    name: str, run_group: RunGroup
) -> None:
    [result], engine = await run_group((name,))
    _assert_solved(result, name)
    assert len(result.payload.calls) == engine.turns
    api = "messages" if name == "program:claude-code" else "chat_completions"
    assert {c.metadata["api"] for c in result.payload.calls} == {api}
    # The task's own instruction reached the teacher in the program's prompt.
    assert TASK.instruction in str(result.payload.calls[0].request_messages)


async def test_a_mixed_group_of_programs_rebuilds_into_trajectories(run_group: RunGroup) -> None:
    results, _ = await run_group(PROGRAMS)
    for name, result in zip(PROGRAMS, results, strict=True):
        _assert_solved(result, name)
        record = result.payload
        tree = build_tree(record.calls)
        assert not tree.discard_reason, tree.discard_reason
        trajectories = tree_trajectories(
            tree,
            task_id=TASK.id,
            harness=name,
            outcome=trajectory_pb2.TRAJECTORY_OUTCOME_COMPLETED,
        )
        assert trajectories, name
        for trajectory in trajectories:
            assert trajectory.turns and all(t.output_token_ids for t in trajectory.turns)
            assert trajectory.turns[0].input_token_ids
        # As a dataset: each trajectory's tokens with the rollout's reward, trainable.
        rows = rollout_rows(record)
        assert len(rows) == len(trajectories)
        for row in rows:
            assert row["token_ids"] and row["reward"] >= PASS_MARK and row["trainable"], row
        # Every call is in a trajectory. Claude Code's loop is one main line (the solution,
        # then the answer); OpenClaw adds a block of internal context after the conversation
        # in each request and drops it from the next, so its calls do not extend each other's
        # prompts and each is a trajectory of its own.
        in_paths = {i for t in trajectories for i in t.metadata["call_ids"].split(",")}
        assert in_paths == {c.call_id for c in record.calls}
        if name == "program:claude-code":
            main = [len(t.turns) for t in trajectories if "branch" not in t.metadata]
            assert max(main) >= len(TASK.solution) + 1, main


def _mcp_script() -> PolicyScript:
    """The reference solution said in the Claw MCP server's tools instead of the shell: the
    teacher finds `mail_search` and `mail_reply` among the tools the program offers (Claude
    Code's `mcp__claw__mail_reply`), which only a configured MCP server puts there."""
    search, reply = (shlex.split(command) for command in TASK.solution)
    assert search[:2] == ["mail", "search"] and reply[:2] == ["mail", "reply"], TASK.solution
    body = reply[reply.index("--body") + 1]
    return PolicyScript.from_json(
        {
            "plans": [
                {
                    "match": TASK.instruction[:40],
                    "solve_rate": 1.0,
                    "solution": [
                        {"thought": "I look for the mail.", "tool": "mail_search",
                         "arguments": {"query": search[2]}},
                        {"thought": "I reply.", "tool": "mail_reply",
                         "arguments": {"id": reply[2], "body": body}},
                        {"thought": "I replied."},
                    ],
                    "failure": [{"thought": "I cannot."}],
                }
            ]
        }
    )  # fmt: skip


async def test_claude_code_uses_the_claw_tools_through_the_mcp_server_the_task_declares(
    run_group: RunGroup,
) -> None:
    name = "program:claude-code"
    [result], _ = await run_group((name,), script=_mcp_script(), mcp=True)
    record = result.payload
    assert record.failure is None, record.failure
    [event] = record.tool_events
    assert event.exit_code == 0, event.output[-2000:]
    assert result.reward is not None and result.reward >= PASS_MARK, record.reward
    # The two steps were calls of the MCP server's tools, not of the program's shell.
    called = [c["function"]["name"] for call in record.calls for c in call.tool_calls]
    assert len(called) == 2, called
    assert called[0].endswith("mail_search") and called[1].endswith("mail_reply"), called
    assert all(tool.startswith("mcp__claw__") for tool in called), called
