"""A job that brings a scripted policy (`PolicySpec.scripted`): the REAL rollout gRPC server plays
it itself, as an engine behind a capture proxy of the job's own, in sandboxes of the REAL
environment service (``orchard up``; root), with its job store in a real etcd. Nothing outside
the service serves the policy; bad scripts and services that take no job policies are refused
at CreateRolloutJob."""

from __future__ import annotations

import json
import os
import random
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.core.config import ServerConfig
from orchard.core.errors import error_info
from orchard.core.etcd import EmbeddedEtcd
from orchard.rollout.config import RolloutConfig
from orchard.rollout.main import RolloutApplication
from orchard.rollout.proxy.sessions import CaptureSession, rollout_draw_key
from orchard.rollout.v1 import rollout_service_pb2 as api
from orchard.rollout.v1 import rollout_service_pb2_grpc
from orchard.sdk import SandboxClient
from orchard.sdk.connection import read_profile
from orchard.types.v1 import reward_pb2

TOKEN_ENV = "ROLLOUT_SCRIPTED_TEST_TOKEN"
SEED = 5
GROUP = 4


def _task(task_id: str) -> api.RolloutTask:
    settings = {
        "setup": [f"mkdir -p /srv && echo pending > /srv/{task_id}"],
        "check": {"command": f"grep -q fixed /srv/{task_id}"},
    }
    return api.RolloutTask(
        id=task_id,
        instruction=f"Mark job {task_id} as fixed.",
        scorer_json=json.dumps(settings),
    )


def _step(thought: str, tool: str = "", **arguments: Any) -> api.ScriptedStep:
    return api.ScriptedStep(
        thought=thought, tool=tool, arguments_json=json.dumps(arguments) if tool else ""
    )


def _script(task_id: str, **changes: Any) -> api.ScriptedPolicy:
    plan = api.ScriptedPlan(
        match=f"job {task_id} ",
        solve_rate=0.5,
        solution=[
            _step("I mark it fixed.", "bash", command=f"echo fixed > /srv/{task_id}"),
            _step("Fixed; I submit.", "submit"),
        ],
        failure=[
            _step("I look around instead.", "bash", command="ls /srv"),
            _step("Done.", "submit"),
        ],
    )
    return api.ScriptedPolicy(model="teacher-7", plans=[plan], **changes)


def _spec(policy: api.PolicySpec, *task_ids: str) -> api.RolloutJobSpec:
    return api.RolloutJobSpec(
        tasks=[_task(t) for t in task_ids],
        harnesses=["builtin:bash"],
        policy_spec=policy,
        sampler=api.SamplerConfig(
            kind=api.SAMPLER_KIND_FIXED_N, group_size=GROUP, keep_uninformative_groups=True
        ),
        budget=api.RolloutBudget(max_steps=6),
        concurrency=GROUP,
    )


def _listening_sockets() -> int:
    """TCP sockets this process listens on (its gRPC server, and any policy server)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # closed since listed
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                count += 1
    return count


@pytest.fixture
def env_profile(env_service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """orchard-env's endpoint; its token where the rollout service reads it."""
    profile = read_profile(Path(env_service["profile"]))
    assert profile is not None
    monkeypatch.setenv(TOKEN_ENV, profile.token)
    yield profile.endpoint
    with SandboxClient(profile=env_service["profile"]) as client:
        assert list(client.list()) == [], "a job left sandboxes behind"


@asynccontextmanager
async def _rollout(
    etcd: EmbeddedEtcd, env_endpoint: str, folder: Path, **settings: Any
) -> AsyncIterator[rollout_service_pb2_grpc.RolloutServiceStub]:
    config = RolloutConfig(
        server=ServerConfig(listen=["127.0.0.1:0"]),
        artifacts={"root": (folder / "artifacts").as_uri()},
        etcd={"endpoints": [etcd.endpoint], "namespace": f"scripted-{os.urandom(4).hex()}/"},
        env={"endpoint": env_endpoint, "token_env": TOKEN_ENV},
        **settings,
    )
    async with RolloutApplication(config).server() as server:
        await server.set_serving()
        async with grpc.aio.insecure_channel(server.addresses[0]) as channel:
            yield rollout_service_pb2_grpc.RolloutServiceStub(channel)


async def _run_to_end(
    stub: rollout_service_pb2_grpc.RolloutServiceStub, spec: api.RolloutJobSpec
) -> tuple[api.RolloutJob, list[Any]]:
    created = await stub.CreateRolloutJob(
        api.CreateRolloutJobRequest(spec=spec, request_id=os.urandom(8).hex()), timeout=30
    )
    groups = [
        reply.group
        async for reply in stub.StreamGroups(
            api.StreamGroupsRequest(job_id=created.job.id), timeout=300
        )
    ]
    job = (await stub.GetRolloutJob(api.GetRolloutJobRequest(job_id=created.job.id))).job
    return job, groups


@pytest.mark.root
@pytest.mark.slow
async def test_the_service_plays_a_job_s_script_and_its_trajectories_carry_the_replies(
    etcd: EmbeddedEtcd, env_profile: str, tmp_path: Path
) -> None:
    async with _rollout(etcd, env_profile, tmp_path) as stub:
        listening = _listening_sockets()
        policy = api.PolicySpec(scripted=_script("a1", seed=SEED), temperature=0.0)
        job, groups = await _run_to_end(stub, _spec(policy, "a1"))
        assert job.state == api.ROLLOUT_JOB_STATE_SUCCEEDED, job.error
        assert job.spec.policy_spec.scripted.plans[0].match == "job a1 "
        # The policy server lived as long as the job: nothing listens for it any more.
        assert _listening_sockets() == listening

    [group] = groups
    assert len(group.trajectories) == GROUP
    # The seed decides each rollout's path from the rollout (task and index) and its first call,
    # whatever order the rollouts run in.
    assert sorted(rollout_draw_key(t.rollout_id) for t in group.trajectories) == [
        f"a1.{k}" for k in range(GROUP)
    ]
    for trajectory in group.trajectories:
        draw = random.Random(CaptureSession(trajectory.rollout_id).call_seed(SEED, 0)).random()
        assert trajectory.reward.value == (1.0 if draw < 0.5 else 0.0)
    for trajectory in group.trajectories:
        assert trajectory.reward.status == reward_pb2.REWARD_STATUS_SCORED
        # Captured like a model's rollout: turns in the built-in tokenizer, every call answered
        # by the script; the tool loop's conversation rides along for other tokenizers.
        assert trajectory.turns
        assert {t.weight_version for t in trajectory.turns} == {"scripted:teacher-7"}
        assert all(t.output_token_ids for t in trajectory.turns)
        conversation = json.loads(trajectory.conversation_json)
        replies = [m for m in conversation if m["role"] == "assistant"]
        solved = trajectory.reward.value == 1.0
        first = "I mark it fixed." if solved else "I look around instead."
        assert replies[0]["content"] == first
        assert replies[0]["tool_calls"][0]["function"]["name"] == "bash"
        assert replies[-1]["content"] == ("Fixed; I submit." if solved else "Done.")


async def _refused(call: Any) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    info = error_info(caught.value)
    return caught.value.code(), caught.value.details() or "", info.reason if info else ""


async def test_bad_scripts_are_invalid_argument_and_say_what_to_fix(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    same_start = _script("b1")
    same_start.plans[0].failure[0].thought = same_start.plans[0].solution[0].thought
    bad_arguments = _script("b1")
    bad_arguments.plans[0].solution[0].arguments_json = "[1, 2]"
    not_json = _script("b1")
    not_json.plans[0].failure[1].arguments_json = "{oops"
    no_failure = _script("b1")
    del no_failure.plans[0].failure[:]
    huge = _script("b1")
    huge.plans[0].solution[0].thought = "x" * 4096
    cases = [
        (api.ScriptedPolicy(), "plans is empty"),
        (api.ScriptedPolicy(plans=[api.ScriptedPlan(solve_rate=1)]), "match is empty"),
        (api.ScriptedPolicy(plans=[api.ScriptedPlan(match="x", solve_rate=1.5)]), "solve_rate"),
        (same_start, "first thoughts of solution and failure must differ"),
        (bad_arguments, "plans[0].solution[0].arguments_json must be a JSON object"),
        (not_json, "plans[0].failure[1].arguments_json is not JSON"),
        (no_failure, "needs a solution and a failure"),
        (huge, "more than this service takes (2048"),
    ]
    # No environment service is reached: every one is refused before a job exists.
    limits = {"max_script_bytes": 2048}
    async with _rollout(etcd, "127.0.0.1:9", tmp_path, job_policies=limits) as stub:
        for script, message in cases:
            request = api.CreateRolloutJobRequest(spec=_spec(api.PolicySpec(scripted=script), "b1"))
            code, details, reason = await _refused(stub.CreateRolloutJob(request, timeout=10))
            assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"), details
            assert "spec.policy_spec.scripted" in details and message in details, details
        listed = await stub.ListRolloutJobs(api.ListRolloutJobsRequest())
        assert list(listed.jobs) == []


async def test_a_service_that_takes_no_job_policies_refuses_a_script(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    async with _rollout(etcd, "127.0.0.1:9", tmp_path, job_policies={"allow": False}) as stub:
        request = api.CreateRolloutJobRequest(
            spec=_spec(api.PolicySpec(scripted=_script("c1")), "c1")
        )
        code, details, reason = await _refused(stub.CreateRolloutJob(request, timeout=10))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "FAILED_PRECONDITION")
    assert "job_policies.allow is false" in details
