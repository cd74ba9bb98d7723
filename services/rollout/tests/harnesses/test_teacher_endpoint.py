"""A teacher that is an endpoint drives unmodified agent programs through the REAL rollout gRPC
server: Claude Code (Anthropic Messages) and Codex (the Responses API), from the harness cache,
in sandboxes of the REAL environment service (``orchard up``; root), reach a capture proxy of the
job's own, which asks the endpoint in chat completions (`RelayEngine`) and answers each program
in its own dialect. The endpoint here is a real HTTP server on loopback that only this process
reaches (`ScriptedPolicyServer`, playing a script in chat completions as a hosted model would).
The programs' calls are captured: trajectories carry turns in tokens and their conversation."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.core.config import ServerConfig
from orchard.core.etcd import EmbeddedEtcd
from orchard.rollout.config import RolloutConfig
from orchard.rollout.harnesses.sandboxed import HarnessCache
from orchard.rollout.main import RolloutApplication
from orchard.rollout.scripted_policy import ScriptedPolicyServer
from orchard.rollout.v1 import rollout_service_pb2 as api
from orchard.rollout.v1 import rollout_service_pb2_grpc
from orchard.sdk.connection import read_profile
from orchard.types.v1 import reward_pb2

from .test_claude_codex import GREETING, SCRIPT, TASK

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(300)]

TOKEN_ENV = "ROLLOUT_TEACHER_ENDPOINT_TEST_TOKEN"
PROGRAMS = ("program:claude-code", "program:codex")


@asynccontextmanager
async def _rollout(
    etcd: EmbeddedEtcd, env: dict[str, Any], cache: HarnessCache, host: str, folder: Path
) -> AsyncIterator[rollout_service_pb2_grpc.RolloutServiceStub]:
    profile = read_profile(Path(env["profile"]))
    assert profile is not None
    os.environ[TOKEN_ENV] = profile.token
    config = RolloutConfig(
        server=ServerConfig(listen=["127.0.0.1:0"]),
        artifacts={"root": (folder / "artifacts").as_uri()},
        etcd={"endpoints": [etcd.endpoint], "namespace": f"relay-{os.urandom(4).hex()}/"},
        env={"endpoint": profile.endpoint, "token_env": TOKEN_ENV},
        # The programs reach the job's proxy at this host's address (an egress rule of their
        # sandbox); the endpoint itself stays on loopback, reached by this process only.
        proxy={"host": host, "settle_quiet_s": 0.2},
        harnesses={"cache_dir": cache.path},
    )
    try:
        async with RolloutApplication(config).server() as server:
            await server.set_serving()
            async with grpc.aio.insecure_channel(server.addresses[0]) as channel:
                yield rollout_service_pb2_grpc.RolloutServiceStub(channel)
    finally:
        os.environ.pop(TOKEN_ENV, None)


def _spec(base_url: str) -> api.RolloutJobSpec:
    return api.RolloutJobSpec(
        tasks=[TASK.to_proto()],  # the task test_claude_codex.py runs in-process
        harnesses=list(PROGRAMS),
        policy_spec=api.PolicySpec(
            endpoint=api.ChatEndpoint(base_url=base_url, model="hosted-teacher"),
            temperature=0.0,
            max_tokens_per_call=512,
        ),
        sampler=api.SamplerConfig(
            kind=api.SAMPLER_KIND_FIXED_N, group_size=2, keep_uninformative_groups=True
        ),
        budget=api.RolloutBudget(max_steps=8),
        concurrency=2,
    )


async def test_an_endpoint_teacher_drives_programs_of_other_dialects_and_is_captured(
    etcd: EmbeddedEtcd,
    env_service: dict[str, Any],
    harness_cache: HarnessCache,
    reachable_host: str,
    tmp_path: Path,
) -> None:
    async with (
        ScriptedPolicyServer(SCRIPT, seed=0) as teacher,
        _rollout(etcd, env_service, harness_cache, reachable_host, tmp_path) as stub,
    ):
        created = await stub.CreateRolloutJob(
            api.CreateRolloutJobRequest(spec=_spec(teacher.base_url), request_id="relay-1"),
            timeout=30,
        )
        groups = [
            reply.group
            async for reply in stub.StreamGroups(
                api.StreamGroupsRequest(job_id=created.job.id), timeout=280
            )
        ]
        job = (await stub.GetRolloutJob(api.GetRolloutJobRequest(job_id=created.job.id))).job
    assert job.state == api.ROLLOUT_JOB_STATE_SUCCEEDED, job.error
    assert {g.harness for g in groups} == set(PROGRAMS)
    turns = 0
    for group in groups:
        assert len(group.trajectories) == 2, group.harness
        for trajectory in group.trajectories:
            assert trajectory.reward.status == reward_pb2.REWARD_STATUS_SCORED
            assert trajectory.reward.value == 1.0, (group.harness, trajectory.reward)
            # Captured as a model's calls: turns in the built-in tokenizer, each decided by
            # the endpoint, in the program's own dialect.
            assert trajectory.turns, group.harness
            assert {t.weight_version for t in trajectory.turns} == {"endpoint:hosted-teacher"}
            assert all(t.input_token_ids and t.output_token_ids for t in trajectory.turns)
            turns += len(trajectory.turns)
            # The endpoint's words reached the program in its own tool: the shell step the
            # script wrote is a tool call of the program's (Claude Code's `Bash`, Codex's
            # `shell`), and it ran in the sandbox (the check passed).
            calls = [c for t in trajectory.turns for c in t.tool_calls]
            assert any(GREETING in c.arguments_json for c in calls), calls
    # Every program call went to the endpoint, in chat completions, and was answered there.
    assert teacher.requests >= turns > 0
