"""Rollout jobs on Ray workers (``workers.kind = ray``): the REAL rollout gRPC service starts a
local Ray on 127.0.0.1 with two rollout actors, runs jobs of a scripted policy in sandboxes of
the REAL environment service (``orchard up``; root), keeps every rollout accounted for when an
actor process is killed mid-job, and ends every process of its Ray when it closes.

One service (one Ray) serves the whole module: Ray starts in seconds and takes about 1.3 GB.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
import pytest_asyncio

from orchard.core.config import ServerConfig
from orchard.core.etcd import EmbeddedEtcd
from orchard.rollout.config import RolloutConfig
from orchard.rollout.main import RolloutApplication
from orchard.rollout.v1 import rollout_service_pb2 as api
from orchard.rollout.v1 import rollout_service_pb2_grpc
from orchard.rollout.workers import RayWorkers, WorkerServices
from orchard.sdk import AsyncSandboxClient
from orchard.sdk.connection import read_profile
from orchard.types.v1 import reward_pb2

pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.asyncio(loop_scope="module"),
]

TOKEN_ENV = "ROLLOUT_RAY_TEST_TOKEN"
JOB_LABEL = "orchard-rollout-job"
WEIGHT_VERSION = "tiny-ray-v1"


def _task(task_id: str) -> api.RolloutTask:
    settings = {
        "setup": [f"mkdir -p /srv && echo pending > /srv/{task_id}"],
        "check": {"command": f"grep -q fixed /srv/{task_id}"},
    }
    return api.RolloutTask(
        id=task_id, instruction=f"Mark job {task_id} as fixed.", scorer_json=json.dumps(settings)
    )


def _step(thought: str, tool: str = "", **arguments: Any) -> api.ScriptedStep:
    return api.ScriptedStep(
        thought=thought, tool=tool, arguments_json=json.dumps(arguments) if tool else ""
    )


def _plan(task_id: str, solve_rate: float, sleep_s: float = 0) -> api.ScriptedPlan:
    path = f"/srv/{task_id}"
    return api.ScriptedPlan(
        match=f"job {task_id} ",
        solve_rate=solve_rate,
        solution=[
            _step("I mark it fixed.", "bash", command=f"sleep {sleep_s}; echo fixed > {path}"),
            _step("Fixed; I submit.", "submit"),
        ],
        failure=[
            _step("I look around instead.", "bash", command="ls /srv"),
            _step("Done.", "submit"),
        ],
    )


def _spec(plans: dict[str, api.ScriptedPlan], group: int) -> api.RolloutJobSpec:
    script = api.ScriptedPolicy(model="teacher-7", plans=list(plans.values()))
    return api.RolloutJobSpec(
        tasks=[_task(t) for t in plans],
        harnesses=["builtin:bash"],
        policy_spec=api.PolicySpec(scripted=script, temperature=0.0),
        sampler=api.SamplerConfig(
            kind=api.SAMPLER_KIND_FIXED_N, group_size=group, keep_uninformative_groups=True
        ),
        budget=api.RolloutBudget(max_steps=6),
        concurrency=group,
    )


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                if int(stat[stat.rfind(")") + 2 :].split()[1]) == pid:
                    found.add(int(entry.name))
    return found


def _tree(pids: set[int]) -> set[int]:
    found, frontier = set(pids), set(pids)
    while frontier:
        frontier = {c for p in frontier for c in _children(p)} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] != "Z"


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
"""127.0.0.1, ::ffff:127.0.0.1 and ::1 as /proc/net/tcp{,6} write them."""


def _listening_addresses(pids: set[int]) -> set[str]:
    """The local addresses the processes `pids` listen on (TCP), as /proc/net writes them."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                found.add(fields[1].split(":")[0])
    return found


@dataclass
class Service:
    app: RolloutApplication
    stub: rollout_service_pb2_grpc.RolloutServiceStub
    env_endpoint: str
    etcd: EmbeddedEtcd
    artifacts: Path
    before: set[int]
    """This process's children before the service started (etcd, ...)."""
    close: Any

    @property
    def workers(self) -> RayWorkers:
        assert self.app.manager is not None
        return cast(RayWorkers, self.app.manager.workers)

    def sandboxes(self) -> AsyncSandboxClient:
        return AsyncSandboxClient(self.env_endpoint, token=os.environ.get(TOKEN_ENV) or None)


def _config(service_etcd: EmbeddedEtcd, env_endpoint: str, artifacts: Path, **more: Any) -> Any:
    return RolloutConfig(
        server=ServerConfig(listen=["127.0.0.1:0"]),
        artifacts={"root": artifacts.as_uri()},
        etcd={"endpoints": [service_etcd.endpoint], "namespace": f"ray-{os.urandom(4).hex()}/"},
        env={"endpoint": env_endpoint, "token_env": TOKEN_ENV},
        **more,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(
    env_service: dict[str, Any], etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Service]:
    profile = read_profile(Path(env_service["profile"]))
    assert profile is not None
    # Set before Ray starts: the local Ray's workers inherit the service's environment.
    previous = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = profile.token
    artifacts = tmp_path_factory.mktemp("ray-rollouts")
    from orchard.lm.model_folder import save_model_folder
    from orchard.lm.models import tiny_causal_lm_for
    from orchard.lm.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    folder = save_model_folder(
        artifacts / "tiny", tiny_causal_lm_for(tokenizer, context=2048, seed=3), tokenizer
    )
    before = _children(os.getpid())
    config = _config(
        etcd,
        profile.endpoint,
        artifacts,
        workers={"kind": "ray", "ray_actors": 2, "ray_init_cpus": 2, "rollout_attempts": 2},
        policies={
            "tiny": {
                "kind": "local",
                "engine": {"model_folder": str(folder), "weight_version": WEIGHT_VERSION},
                "max_tokens_per_call": 16,
            }
        },
        default_policy="tiny",
    )
    app = RolloutApplication(config)
    stack = contextlib.AsyncExitStack()
    try:
        server = await stack.enter_async_context(app.server())
        await server.set_serving()
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(server.addresses[0]))
        yield Service(
            app,
            rollout_service_pb2_grpc.RolloutServiceStub(channel),
            profile.endpoint,
            etcd,
            artifacts,
            before,
            stack.aclose,
        )
    finally:
        await stack.aclose()
        if previous is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = previous


async def _run_to_end(
    stub: rollout_service_pb2_grpc.RolloutServiceStub, spec: api.RolloutJobSpec
) -> tuple[api.RolloutJob, list[Any]]:
    created = await stub.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec), timeout=30)
    groups = [
        reply.group
        async for reply in stub.StreamGroups(
            api.StreamGroupsRequest(job_id=created.job.id), timeout=300
        )
    ]
    job = (await stub.GetRolloutJob(api.GetRolloutJobRequest(job_id=created.job.id))).job
    return job, groups


def _summary(groups: list[Any]) -> list[Any]:
    """What a job's groups say, without ids and timings."""
    out = []
    for group in sorted(groups, key=lambda g: g.task_id):
        rows = []
        for t in group.trajectories:
            replies = [m for m in json.loads(t.conversation_json) if m["role"] == "assistant"]
            rows.append(
                (
                    t.reward.status,
                    t.reward.value,
                    t.outcome,
                    t.metadata["status"],
                    [m["content"] for m in replies],
                )
            )
        out.append((group.task_id, group.rollouts_run, sorted(rows)))
    return out


async def test_a_job_on_ray_workers_gives_the_results_it_gives_in_process(
    service: Service,
) -> None:
    spec = _spec({"r1": _plan("r1", 1.0), "r2": _plan("r2", 0.0)}, group=3)
    served_before = sum(await service.workers.served())
    job, groups = await _run_to_end(service.stub, spec)
    assert job.state == api.ROLLOUT_JOB_STATE_SUCCEEDED, job.error
    assert (job.rollouts_started, job.rollouts_done, job.rollouts_excluded) == (6, 6, 0)
    # Every rollout ran in an actor process, none in the service's.
    assert sum(await service.workers.served()) - served_before == 6
    assert os.getpid() not in await service.workers.actor_pids()

    config = _config(service.etcd, service.env_endpoint, service.artifacts)
    async with RolloutApplication(config).server() as server:
        await server.set_serving()
        async with grpc.aio.insecure_channel(server.addresses[0]) as channel:
            in_process = rollout_service_pb2_grpc.RolloutServiceStub(channel)
            local_job, local_groups = await _run_to_end(in_process, spec)
    assert local_job.state == api.ROLLOUT_JOB_STATE_SUCCEEDED, local_job.error

    assert _summary(groups) == _summary(local_groups)
    [solved, failed] = _summary(groups)
    assert [row[1] for row in solved[2]] == [1.0, 1.0, 1.0]
    assert [row[1] for row in failed[2]] == [0.0, 0.0, 0.0]
    assert solved[2][0][4] == ["I mark it fixed.", "Fixed; I submit."]
    async with service.sandboxes() as client:
        assert [s.id async for s in client.list({JOB_LABEL: job.id})] == []


async def test_calls_through_the_capture_proxy_are_captured_for_rollouts_on_ray(
    service: Service,
) -> None:
    # The local engine and its capture proxy stay in the service; the actors' harnesses call
    # the proxy at their rollout's session URL, and the service takes the calls.
    hello = api.RolloutTask(
        id="hello", instruction="Say hi.", scorer_json=json.dumps({"check": {"command": "false"}})
    )
    spec = api.RolloutJobSpec(
        tasks=[hello],
        harnesses=["builtin:tools"],
        policy="tiny",
        sampler=api.SamplerConfig(
            kind=api.SAMPLER_KIND_FIXED_N, group_size=2, keep_uninformative_groups=True
        ),
        budget=api.RolloutBudget(max_steps=2),
    )
    served_before = sum(await service.workers.served())
    job, groups = await _run_to_end(service.stub, spec)
    assert job.state == api.ROLLOUT_JOB_STATE_SUCCEEDED, job.error
    assert sum(await service.workers.served()) - served_before == 2
    [group] = groups
    assert len(group.trajectories) == 2
    for trajectory in group.trajectories:
        assert trajectory.reward.status == reward_pb2.REWARD_STATUS_SCORED, trajectory.reward
        assert trajectory.turns, "the calls through the proxy were captured"
        for turn in trajectory.turns:
            assert turn.weight_version == WEIGHT_VERSION
            assert len(turn.input_token_ids) > 0 and len(turn.output_token_ids) > 0
            assert len(turn.output_logprobs) == len(turn.output_token_ids)
        assert trajectory.metadata["weight_versions"] == WEIGHT_VERSION


async def test_a_killed_actor_s_rollouts_are_tried_again_on_another(service: Service) -> None:
    group = 4
    spec = _spec({"k1": _plan("k1", 1.0, sleep_s=4)}, group=group)
    created = await service.stub.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec))
    job_id = created.job.id
    pids = await service.workers.actor_pids()
    # Every rollout has its sandbox (the actors are inside their rollouts): kill one actor.
    async with service.sandboxes() as client:
        deadline = time.monotonic() + 60
        while len([s async for s in client.list({JOB_LABEL: job_id})]) < group:
            assert time.monotonic() < deadline, "the job's rollouts did not start"
            await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)
    os.kill(pids[0], signal.SIGKILL)

    groups = [
        reply.group
        async for reply in service.stub.StreamGroups(
            api.StreamGroupsRequest(job_id=job_id), timeout=300
        )
    ]
    job = (await service.stub.GetRolloutJob(api.GetRolloutJobRequest(job_id=job_id))).job
    assert job.state == api.ROLLOUT_JOB_STATE_SUCCEEDED, job.error
    [emitted] = groups
    # Every rollout is accounted for: the killed actor's were run again, and scored.
    assert len(emitted.trajectories) == group
    assert all(t.reward.status == reward_pb2.REWARD_STATUS_SCORED for t in emitted.trajectories)
    assert [t.reward.value for t in emitted.trajectories] == [1.0] * group
    lost = [
        t.metadata["lost_attempts"] for t in emitted.trajectories if "lost_attempts" in t.metadata
    ]
    assert len(lost) >= 1
    assert job.rollouts_done == group and job.rollouts_excluded == 0
    assert job.rollouts_started == group + len(lost)
    # The actor came back in a new process; nothing the lost rollouts made is left.
    new_pids = await service.workers.actor_pids()
    assert new_pids[0] != pids[0] and new_pids[1] == pids[1]
    async with service.sandboxes() as client:
        assert [s.id async for s in client.list({JOB_LABEL: job_id})] == []


async def test_a_rollout_whose_worker_dies_on_every_try_is_excluded_with_the_reason(
    service: Service,
) -> None:
    spec = _spec({"x1": _plan("x1", 1.0, sleep_s=30)}, group=1)
    created = await service.stub.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec))
    job_id = created.job.id
    killed = 0
    seen: set[str] = set()
    async with service.sandboxes() as client:
        deadline = time.monotonic() + 120
        # Each try runs in a new sandbox: kill both actors whenever one appears (two tries).
        while killed < 2:
            assert time.monotonic() < deadline, f"{killed} tries seen"
            fresh = {s.id async for s in client.list({JOB_LABEL: job_id})} - seen
            if fresh:
                seen |= fresh
                for pid in await service.workers.actor_pids():
                    os.kill(pid, signal.SIGKILL)
                killed += 1
            await asyncio.sleep(0.1)
    groups = [
        reply.group
        async for reply in service.stub.StreamGroups(
            api.StreamGroupsRequest(job_id=job_id), timeout=300
        )
    ]
    job = (await service.stub.GetRolloutJob(api.GetRolloutJobRequest(job_id=job_id))).job
    assert job.state == api.ROLLOUT_JOB_STATE_SUCCEEDED, job.error
    assert (job.rollouts_started, job.rollouts_done, job.rollouts_excluded) == (2, 1, 1)
    [trajectory] = groups[0].trajectories
    assert trajectory.reward.status == reward_pb2.REWARD_STATUS_EXCLUDED
    assert trajectory.reward.exclusion == reward_pb2.EXCLUSION_REASON_ABORTED
    assert "worker was lost on each of 2 tries" in trajectory.reward.detail
    assert "Ray worker was lost" in trajectory.reward.detail
    assert trajectory.metadata["status"] == "aborted"
    async with service.sandboxes() as client:
        assert [s.id async for s in client.list({JOB_LABEL: job_id})] == []


async def test_a_cancelled_job_stops_its_rollouts_in_the_actors(service: Service) -> None:
    spec = _spec({"c1": _plan("c1", 1.0, sleep_s=60)}, group=2)
    created = await service.stub.CreateRolloutJob(api.CreateRolloutJobRequest(spec=spec))
    job_id = created.job.id
    deadline = time.monotonic() + 60
    while sum(await service.workers.running()) < 2:
        assert time.monotonic() < deadline, "the job's rollouts did not start"
        await asyncio.sleep(0.1)
    cancelled = await service.stub.CancelRolloutJob(api.CancelRolloutJobRequest(job_id=job_id))
    assert cancelled.job.state == api.ROLLOUT_JOB_STATE_CANCELLED
    # The actors' rollouts stop (long before their 60 s command ends) and leave no sandbox.
    deadline = time.monotonic() + 20
    while sum(await service.workers.running()) > 0:
        assert time.monotonic() < deadline, await service.workers.running()
        await asyncio.sleep(0.1)
    async with service.sandboxes() as client:
        assert [s.id async for s in client.list({JOB_LABEL: job_id})] == []


async def test_actors_ray_cannot_place_fail_the_start_saying_why(service: Service) -> None:
    import ray

    # A second pool on the service's Ray: it leaves that Ray running when it fails.
    pool = RayWorkers(
        WorkerServices(env_endpoint=service.env_endpoint),
        actors=1,
        num_cpus_per_actor=64,
        start_timeout_s=3,
    )
    with pytest.raises(RuntimeError, match=r"did not start 1 rollout actors of 64 CPU") as caught:
        await pool.__aenter__()
    assert "workers.ray_num_cpus" in str(caught.value)
    assert ray.is_initialized()
    assert len(await service.workers.actor_pids()) == 2


async def test_the_service_ends_its_ray_and_every_process_it_started(service: Service) -> None:
    import ray

    started = _tree(_children(os.getpid()) - service.before)
    actors = set(await service.workers.actor_pids())
    assert actors <= started, "the actors run below this process's local Ray"
    assert ray.is_initialized()
    # The local Ray is reachable from this machine only.
    listening = _listening_addresses(started)
    assert listening and listening <= LOOPBACK, listening
    await service.close()
    assert not ray.is_initialized()
    assert [pid for pid in started if _alive(pid)] == []
