"""Rollout workers in this process and as Ray actors (a local Ray on 127.0.0.1) give the same
results: the same rollouts through the REAL environment service (``orchard up``; root) against
the scripted policy. What reaches the actors is addresses and settings; the token stays in the
environment."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from orchard.rollout.budgets import LayeredRetries, LayerRetry, RolloutBudget
from orchard.rollout.harnesses.bash_react import bash_react_harness
from orchard.rollout.harnesses.tool_loop import ModelEndpoint
from orchard.rollout.results import GroupKey, RolloutResult
from orchard.rollout.scripted_policy import PolicyScript, ScriptedPolicyServer
from orchard.rollout.tasks import TaskSpec
from orchard.rollout.workers import (
    InProcessWorkers,
    RayWorkers,
    RunnerSpec,
    WorkersConfig,
    WorkerServices,
    make_workers,
)
from orchard.sdk import AsyncSandboxClient
from orchard.sdk.connection import read_profile
from orchard.sdk.service_config import EnvClientConfig

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(600)]

TOKEN_ENV = "ROLLOUT_WORKERS_TEST_TOKEN"

FILE = "/srv/task/greeting.txt"
TASKS = {
    "greet": TaskSpec.from_settings(
        "greet",
        "Please write hello into /srv/task/greeting.txt.",
        {"setup": ["mkdir -p /srv/task"], "check": {"command": f"grep -qx hello {FILE}"}},
    ),
    "count": TaskSpec.from_settings(
        "count",
        "Please count the lines of /etc/hostname into /srv/task/count.txt.",
        {
            "setup": ["mkdir -p /srv/task"],
            "check": {"command": "test -s /srv/task/count.txt && grep -qx 7 /srv/task/count.txt"},
        },
    ),
}
SCRIPT = PolicyScript.from_json(
    {
        "plans": [
            {
                "match": "write hello",
                "solve_rate": 1.0,
                "solution": [
                    {"thought": "Write it.", "tool": "bash",
                     "arguments": {"command": f"echo hello > {FILE} && cat {FILE}"}},
                    {"thought": "Done.", "tool": "submit", "arguments": {}},
                ],
                "failure": [{"thought": "No."}],
            },
            {
                "match": "count the lines",
                "solve_rate": 0.0,
                "solution": [{"thought": "Skip."}],
                "failure": [
                    {"thought": "Count them.", "tool": "bash",
                     "arguments": {"command": "wc -l < /etc/hostname > /srv/task/count.txt"}},
                    {"thought": "Done.", "tool": "submit", "arguments": {}},
                ],
            },
        ]
    }
)  # fmt: skip
KEYS = [(GroupKey("greet", "builtin:bash"), i) for i in range(3)] + [
    (GroupKey("count", "builtin:bash"), i) for i in range(3)
]


def services(endpoint: str) -> WorkerServices:
    return WorkerServices(env_endpoint=endpoint, env=EnvClientConfig(token_env=TOKEN_ENV))


def spec(base_url: str) -> RunnerSpec:
    return RunnerSpec(
        endpoint=ModelEndpoint(base_url=base_url, model="teacher"),
        harnesses={"builtin:bash": bash_react_harness()},
        tasks=TASKS,
        budget=RolloutBudget(max_steps=6, max_duration_s=120),
        retries=LayeredRetries(
            sandbox_create=LayerRetry(attempts=2, timeout_s=60, initial_backoff_s=0.01),
            inference=LayerRetry(attempts=2, timeout_s=10, initial_backoff_s=0.01),
            create_spread_s=0.05,
        ),
        seed=5,
    )


def summary(result: RolloutResult) -> tuple[Any, ...]:
    record = result.payload
    return (
        result.key,
        result.index,
        result.status,
        result.reward,
        record.outcome,
        [(e.tool, e.arguments, e.exit_code, e.output) for e in record.tool_events],
        len(record.sandbox_ids),
        record.failure,
    )


def test_the_default_is_in_process() -> None:
    pool = make_workers(WorkersConfig(), services("127.0.0.1:1"))
    assert isinstance(pool, InProcessWorkers)
    ray_pool = make_workers(WorkersConfig(kind="ray", ray_actors=3), services("127.0.0.1:1"))
    assert isinstance(ray_pool, RayWorkers)


async def test_ray_actors_give_the_same_results_as_in_process(
    env_service: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray  # the ray extra of orchard-rollout; `make setup` installs it

    profile = read_profile(Path(env_service["profile"]))
    assert profile is not None
    # Set before Ray starts: the local Ray's workers inherit this environment.
    monkeypatch.setenv(TOKEN_ENV, profile.token)
    where = services(profile.endpoint)
    async with ScriptedPolicyServer(SCRIPT) as policy:
        job = spec(policy.base_url)
        async with InProcessWorkers(where, concurrency=4) as pool, pool.job("j1", job) as run:
            local = list(await asyncio.gather(*(run(k, i) for k, i in KEYS)))
        ray_pool = RayWorkers(where, actors=2, concurrency=4, init_cpus=2)
        async with ray_pool, ray_pool.job("j1", job) as run:
            pids = await ray_pool.actor_pids()
            remote = list(await asyncio.gather(*(run(k, i) for k, i in KEYS)))
            served = await ray_pool.served()
        assert not ray.is_initialized()

    # The rollouts really ran in two other processes.
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert sum(served) == len(KEYS)
    assert [summary(r) for r in remote] == [summary(r) for r in local]
    assert [r.reward for r in local] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert local[0].payload.tool_events[0].output.splitlines() == ["exit code 0", "hello"]
    # Every rollout deleted its sandbox, whichever process ran it.
    async with AsyncSandboxClient(profile=env_service["profile"]) as client:
        assert [s.id async for s in client.list()] == []
