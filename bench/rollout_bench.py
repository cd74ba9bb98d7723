"""Benchmark the rollout samplers: Balanced Adaptive Rollout against fixed-N with filtering.

    .venv/bin/python bench/rollout_bench.py [--budget 16000] [--seeds 3]

Every sampler gets the same trajectory budget and the same stream of simulated tasks (common
random numbers: rollout i of task t ends the same way under every sampler). Task pass rates
follow the U-shaped spread agent training sets show: many tasks the policy never solves, some it
always solves, the rest spread out and skewed hard. A few rollouts abort (infrastructure) and a
share of the failures are truncated by a budget.

Reported per sampler: usable groups (kept by the group filter) per 1,000 trajectories, the mean
positive fraction of kept groups, and the advantage mass per 1,000 trajectories — the sum over
kept groups of |reward - group mean|, the signal a group-relative gradient gets (it is largest
for balanced groups) — balanced groups (positive fraction in [0.375, 0.625]) per 1,000
trajectories, and usable groups per 100 tasks drawn (what a finite task set yields).

Part 2, the rollout manager's own overhead per agent step (needs root: it starts etcd and
orchard-env with the local runtime, as `orchard up` does): the bash harness runs rollouts of a
scripted policy whose every step is one shell command, through the rollout runner and the real
environment service. Beside it, the same work without the manager: each command run directly
with `sandbox.exec` in one sandbox (raw exec time), and each model call sent directly to the
scripted policy with the conversation the harness had at that step (raw model time). The
manager's overhead per step is the harness's time per step minus both; the target is at most 5%
of the raw exec time. `--skip-overhead` leaves part 2 out.

Part 3, rollout throughput by where rollouts run (same stack, root): the same rollouts of the
scripted policy (each a few shell steps in its own sandbox), at the same concurrency, in this
process (`InProcessWorkers`) and on two actors of a local Ray (`RayWorkers`), side by side.
Reported: rollouts and agent steps per second after a warm-up, and the pool's start time (Ray's
start included). `--skip-workers` leaves part 3 out.

Part 4, the capture proxy's overhead per model call in each API dialect (no root needed): the
local CPU engine on a small model built here, one prompt (a system prompt, a tool, a user turn)
sampled greedily to the same number of tokens, called directly on the engine and through the
proxy as chat completions, Responses and Anthropic Messages requests (plain HTTP, not streamed),
interleaved so every path sees the same load. Reported: p50 per call for each path, the
overhead of each dialect over the direct call (target at most 5%), and an empty HTTP round trip
to the proxy (`GET /health`) as the floor any HTTP server adds. `--skip-proxy` leaves part 4
out.

Writes bench/results/rollout.json (all parts) and prints tables.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import json
import os
import platform
import random
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchard.rollout.batches import GroupFilter
from orchard.rollout.harnesses.tool_loop import HarnessContext, HarnessOutcome, ToolCallingHarness
from orchard.rollout.results import GroupKey, RolloutResult, RolloutStatus
from orchard.rollout.samplers import (
    BalancedAdaptiveSampler,
    FixedNSampler,
    MemberChoice,
    Sampler,
    StopRule,
)

if TYPE_CHECKING:
    from orchard.rollout.workers import RolloutWorkers, RunnerSpec

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "rollout.json"

NEVER_SOLVED = 0.30
"""Share of tasks with pass rate 0."""
ALWAYS_SOLVED = 0.15
"""Share of tasks with pass rate in [0.9, 1]."""
ABORT_RATE = 0.03
TRUNCATED_SHARE_OF_FAILURES = 0.3
BALANCED = (0.375, 0.625)
"""A kept group counts as balanced when its positive fraction lies here (BAR's interval)."""


@dataclass(frozen=True, slots=True)
class SimulatedTask:
    task_id: str
    pass_rate: float


def task_stream(seed: int) -> list[SimulatedTask]:
    rng = random.Random(f"tasks-{seed}")
    tasks = []
    for i in range(20_000):
        u = rng.random()
        if u < NEVER_SOLVED:
            p = 0.0
        elif u < NEVER_SOLVED + ALWAYS_SOLVED:
            p = rng.uniform(0.9, 1.0)
        else:
            p = rng.betavariate(0.6, 0.9)
        tasks.append(SimulatedTask(f"s{seed}-t{i}", p))
    return tasks


class SimulatedRollouts:
    """Ends rollout i of a task from a generator seeded by (task, i): the same for every
    sampler."""

    def __init__(self, tasks: list[SimulatedTask]) -> None:
        self.pass_rate = {t.task_id: t.pass_rate for t in tasks}
        self.run_count = 0

    async def __call__(self, key: GroupKey, index: int) -> RolloutResult:
        self.run_count += 1
        rng = random.Random(f"{key.task_id}-{index}")
        length = int(rng.lognormvariate(7.0, 0.5))
        if rng.random() < ABORT_RATE:
            return RolloutResult(key, index, RolloutStatus.ABORTED, None, length)
        if rng.random() < self.pass_rate[key.task_id]:
            return RolloutResult(key, index, RolloutStatus.COMPLETED, 1.0, length)
        if rng.random() < TRUNCATED_SHARE_OF_FAILURES:
            return RolloutResult(key, index, RolloutStatus.TRUNCATED, 0.0, length * 2)
        return RolloutResult(key, index, RolloutStatus.COMPLETED, 0.0, length)


@dataclass(frozen=True, slots=True)
class SamplerScore:
    sampler: str
    settings: dict[str, Any]
    trajectories: int
    tasks: int
    kept_groups: int
    usable_groups_per_1000: float
    mean_positive_fraction_kept: float
    advantage_mass_per_1000: float
    balanced_groups_per_1000: float
    usable_groups_per_100_tasks: float


async def score(name: str, sampler: Sampler, budget: int, seed: int) -> SamplerScore:
    tasks = task_stream(seed)
    run = SimulatedRollouts(tasks)
    keep = GroupFilter()
    kept_fractions: list[float] = []
    mass = 0.0
    used_tasks = 0
    balanced = 0
    for task in tasks:
        if run.run_count >= budget:
            break
        used_tasks += 1
        group = await sampler.sample(GroupKey(task.task_id, "simulated"), run)
        if keep.drop_reason(group):
            continue
        rewards = [m.reward for m in group.members if m.reward is not None]
        mean = statistics.fmean(rewards)
        mass += sum(abs(r - mean) for r in rewards)
        kept_fractions.append(group.positive_fraction)
        if BALANCED[0] - 1e-9 <= group.positive_fraction <= BALANCED[1] + 1e-9:
            balanced += 1
    used = run.run_count
    settings = {
        k: v.value if isinstance(v, enum.Enum) else v
        for k, v in asdict(sampler).items()  # type: ignore[call-overload]
        if k != "name" and not k.startswith("_")
    }
    return SamplerScore(
        sampler=name,
        settings=settings,
        trajectories=used,
        tasks=used_tasks,
        kept_groups=len(kept_fractions),
        usable_groups_per_1000=1000 * len(kept_fractions) / used,
        mean_positive_fraction_kept=statistics.fmean(kept_fractions) if kept_fractions else 0.0,
        advantage_mass_per_1000=1000 * mass / used,
        balanced_groups_per_1000=1000 * balanced / used,
        usable_groups_per_100_tasks=100 * len(kept_fractions) / used_tasks,
    )


def average(scores: list[SamplerScore]) -> dict[str, Any]:
    first = scores[0]
    return {
        "sampler": first.sampler,
        "settings": first.settings,
        "trajectories": sum(s.trajectories for s in scores),
        "tasks": sum(s.tasks for s in scores),
        "kept_groups": sum(s.kept_groups for s in scores),
        "usable_groups_per_1000": statistics.fmean(s.usable_groups_per_1000 for s in scores),
        "mean_positive_fraction_kept": statistics.fmean(
            s.mean_positive_fraction_kept for s in scores
        ),
        "advantage_mass_per_1000": statistics.fmean(s.advantage_mass_per_1000 for s in scores),
        "balanced_groups_per_1000": statistics.fmean(s.balanced_groups_per_1000 for s in scores),
        "usable_groups_per_100_tasks": statistics.fmean(
            s.usable_groups_per_100_tasks for s in scores
        ),
    }


SAMPLERS: list[tuple[str, Sampler]] = [
    ("fixed_n N=8 + filter (baseline)", FixedNSampler(group_size=8)),
    ("bar defaults (N=8 Nmax=16 s=8, mixed stop, random members)", BalancedAdaptiveSampler()),
    ("bar s=16 (one stride)", BalancedAdaptiveSampler(stride=16)),
    ("bar s=4", BalancedAdaptiveSampler(stride=4)),
    (
        "bar band stop, ranked members, s=16 (the earlier default)",
        BalancedAdaptiveSampler(
            stride=16, stop_rule=StopRule.BAND, member_choice=MemberChoice.RANKED
        ),
    ),
]


async def sampler_comparison(budget: int, seeds: int) -> list[dict[str, Any]]:
    rows = []
    for name, sampler in SAMPLERS:
        scores = [await score(name, sampler, budget, seed) for seed in range(seeds)]
        rows.append(average(scores))
    return rows


# -- part 2: the manager's overhead per agent step ----------------------------------------

STEP_COMMANDS = (
    "ls -la /usr/bin | wc -l",
    "grep -c root /etc/passwd",
    "python3 -c 'import json; print(json.dumps({\"ok\": 1}))'",
    "cat /etc/os-release | head -n 3",
)


class TimedHarness:
    """Wraps a harness and adds up the time its runs take (the manager's part of a rollout:
    the loop, the tool dispatch, the provenance, the clients)."""

    def __init__(self, inner: ToolCallingHarness) -> None:
        self.inner = inner
        self.name = inner.name
        self.seconds = 0.0
        self.steps = 0

    def in_directory(self, workdir: str) -> TimedHarness:
        """As the runner asks of a harness; the bench task names no directory."""
        if workdir:
            raise ValueError("the bench task runs in the shell's own directory")
        return self

    async def run(self, ctx: HarnessContext) -> HarnessOutcome:
        started = time.perf_counter()
        try:
            return await self.inner.run(ctx)
        finally:
            self.seconds += time.perf_counter() - started
            self.steps += ctx.record.steps


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _overhead_run(endpoint: str, token: str, steps: int, rollouts: int) -> dict[str, Any]:
    import openai  # noqa: PLC0415

    from orchard.rollout.budgets import LayeredRetries, RolloutBudget  # noqa: PLC0415
    from orchard.rollout.harnesses.bash_react import bash_react_harness  # noqa: PLC0415
    from orchard.rollout.harnesses.tool_loop import ModelEndpoint  # noqa: PLC0415
    from orchard.rollout.runner import RolloutRunner  # noqa: PLC0415
    from orchard.rollout.scripted_policy import PolicyScript, ScriptedPolicyServer  # noqa: PLC0415
    from orchard.rollout.tasks import TaskSpec  # noqa: PLC0415
    from orchard.sdk import AsyncSandboxClient  # noqa: PLC0415

    commands = [STEP_COMMANDS[i % len(STEP_COMMANDS)] for i in range(steps)]
    solution = [
        {"thought": f"Step {i}.", "tool": "bash", "arguments": {"command": c}}
        for i, c in enumerate(commands)
    ]
    script = PolicyScript.from_json(
        {
            "plans": [
                {
                    "match": "bench task",
                    "solve_rate": 1.0,
                    "solution": [*solution, {"thought": "Done.", "tool": "submit"}],
                    "failure": [{"thought": "No."}],
                }
            ]
        }
    )
    harness = bash_react_harness()
    timed = TimedHarness(harness)
    task = TaskSpec.from_settings("bench", "Run the bench task.", {"check": {"command": "true"}})
    async with (
        ScriptedPolicyServer(script, seed=0) as policy,
        AsyncSandboxClient(endpoint, token=token) as sandboxes,
    ):
        runner = RolloutRunner(
            sandboxes=sandboxes,
            endpoint=ModelEndpoint(base_url=policy.base_url, model="teacher"),
            harnesses={"builtin:bash": timed},  # type: ignore[dict-item]
            tasks={"bench": task},
            budget=RolloutBudget(max_steps=steps + 2, max_duration_s=600),
            retries=LayeredRetries(create_spread_s=0.0),
            seed=0,
        )
        schemas = [tool.schema() for tool in harness.tools]
        client = openai.AsyncOpenAI(base_url=policy.base_url, api_key="bench", max_retries=0)
        try:
            # Warm-up of both paths: imports, connections, the runtime's first sandboxes.
            await runner(GroupKey("bench", "builtin:bash"), 0)
            await _raw_loop(sandboxes, client, schemas, harness.system_prompt, step_s=[], exec_s=[])
            timed.seconds, timed.steps = 0.0, 0
            records: list[Any] = []
            raw_step_s: list[float] = []
            raw_exec_s: list[float] = []
            for i in range(rollouts):  # interleaved, so both see the same machine load
                records.append((await runner(GroupKey("bench", "builtin:bash"), i + 1)).payload)
                await _raw_loop(
                    sandboxes,
                    client,
                    schemas,
                    harness.system_prompt,
                    step_s=raw_step_s,
                    exec_s=raw_exec_s,
                )
        finally:
            await client.close()
    for record in records:
        if record.failure is not None or record.steps != steps + 1:
            raise RuntimeError(f"bench rollout did not run as scripted: {record.failure}")
    harness_step_ms = timed.seconds / timed.steps * 1000
    tool_exec_ms = (
        statistics.fmean(e.latency_s for r in records for e in r.tool_events if e.tool == "bash")
        * 1000
    )
    raw_step_ms = statistics.fmean(raw_step_s) * 1000
    raw_exec_ms = statistics.fmean(raw_exec_s) * 1000
    overhead_ms = harness_step_ms - raw_step_ms
    return {
        "steps_per_rollout": steps + 1,
        "rollouts": rollouts,
        "commands": list(STEP_COMMANDS),
        "harness_step_ms": harness_step_ms,
        "harness_tool_exec_ms": tool_exec_ms,
        "raw_step_ms": raw_step_ms,
        "raw_exec_ms": raw_exec_ms,
        "overhead_per_step_ms": overhead_ms,
        "overhead_vs_raw_exec": overhead_ms / raw_exec_ms,
        "overhead_vs_raw_step": overhead_ms / raw_step_ms,
        "target_overhead_vs_raw_exec": 0.05,
    }


async def _raw_loop(
    sandboxes: Any,
    client: Any,
    schemas: list[dict[str, Any]],
    system_prompt: str,
    *,
    step_s: list[float],
    exec_s: list[float],
) -> None:
    """The same conversation without the manager: model call, `sandbox.exec`, append, repeat."""
    sandbox = await sandboxes.create(image="host")
    try:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": "Run the bench task."},
        ]
        while True:
            started = time.perf_counter()
            reply = await client.chat.completions.create(
                model="teacher", messages=messages, tools=schemas
            )
            message = reply.choices[0].message
            calls = list(message.tool_calls or [])
            messages.append(
                {
                    "role": "assistant",
                    "content": message.content or "",
                    "tool_calls": [c.model_dump() for c in calls],
                }
            )
            call = calls[0]
            arguments = json.loads(call.function.arguments or "{}")
            if call.function.name == "submit":
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "submitted"})
                step_s.append(time.perf_counter() - started)
                return
            exec_started = time.perf_counter()
            result = await sandbox.exec(["/bin/sh", "-c", arguments["command"]], timeout=60)
            exec_s.append(time.perf_counter() - exec_started)
            output = f"exit code {result.exit_code}\n{result.stdout_text}{result.stderr_text}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
            step_s.append(time.perf_counter() - started)
    finally:
        await sandbox.delete()


# -- part 3: rollout throughput in this process and on Ray workers ---------------------------

WORKERS_TOKEN_ENV = "ORCHARD_BENCH_ENV_TOKEN"


async def _pool_throughput(
    pool: RolloutWorkers, spec: RunnerSpec, rollouts: int, concurrency: int, started: float
) -> dict[str, Any]:
    async with pool, pool.job("bench", spec) as run:
        start_s = time.perf_counter() - started
        key = GroupKey("bench", "builtin:bash")
        # Warm-up: connections, the actors' clients, the runtime's first sandboxes.
        await asyncio.gather(*(run(key, i) for i in range(concurrency)))
        limit = asyncio.Semaphore(concurrency)

        async def one(index: int) -> RolloutResult:
            async with limit:
                return await run(key, index)

        began = time.perf_counter()
        results = await asyncio.gather(*(one(concurrency + i) for i in range(rollouts)))
        seconds = time.perf_counter() - began
    bad = [r for r in results if r.status is not RolloutStatus.COMPLETED or r.reward != 1.0]
    if bad:
        raise RuntimeError(f"bench rollouts did not run as scripted: {bad[0].payload.failure}")
    steps = sum(r.payload.steps for r in results)
    return {
        "rollouts": rollouts,
        "concurrency": concurrency,
        "seconds": seconds,
        "rollouts_per_s": rollouts / seconds,
        "steps_per_s": steps / seconds,
        "pool_start_s": start_s,
    }


async def _workers_run(
    endpoint: str, token: str, steps: int, rollouts: int, concurrency: int
) -> dict[str, Any]:
    from orchard.rollout.budgets import LayeredRetries, RolloutBudget  # noqa: PLC0415
    from orchard.rollout.harnesses.bash_react import bash_react_harness  # noqa: PLC0415
    from orchard.rollout.harnesses.tool_loop import ModelEndpoint  # noqa: PLC0415
    from orchard.rollout.scripted_policy import PolicyScript, ScriptedPolicyServer  # noqa: PLC0415
    from orchard.rollout.tasks import TaskSpec  # noqa: PLC0415
    from orchard.rollout.workers import (  # noqa: PLC0415
        InProcessWorkers,
        RayWorkers,
        RunnerSpec,
        WorkerServices,
    )
    from orchard.sdk.service_config import EnvClientConfig  # noqa: PLC0415

    commands = [STEP_COMMANDS[i % len(STEP_COMMANDS)] for i in range(steps)]
    solution = [
        {"thought": f"Step {i}.", "tool": "bash", "arguments": {"command": c}}
        for i, c in enumerate(commands)
    ]
    script = PolicyScript.from_json(
        {
            "plans": [
                {
                    "match": "bench task",
                    "solve_rate": 1.0,
                    "solution": [*solution, {"thought": "Done.", "tool": "submit"}],
                    "failure": [{"thought": "No."}],
                }
            ]
        }
    )
    # The token reaches the workers as the environment they inherit, never as data.
    os.environ[WORKERS_TOKEN_ENV] = token
    services = WorkerServices(
        env_endpoint=endpoint, env=EnvClientConfig(token_env=WORKERS_TOKEN_ENV)
    )
    task = TaskSpec.from_settings("bench", "Run the bench task.", {"check": {"command": "true"}})
    rows = {}
    async with ScriptedPolicyServer(script, seed=0) as policy:
        spec = RunnerSpec(
            endpoint=ModelEndpoint(base_url=policy.base_url, model="teacher"),
            harnesses={"builtin:bash": bash_react_harness()},
            tasks={"bench": task},
            budget=RolloutBudget(max_steps=steps + 2, max_duration_s=600),
            retries=LayeredRetries(create_spread_s=0.0),
        )
        pools: dict[str, Callable[[], RolloutWorkers]] = {
            "in_process": lambda: InProcessWorkers(services, concurrency=concurrency),
            "ray_2_actors": lambda: RayWorkers(
                services, actors=2, concurrency=concurrency, init_cpus=2
            ),
        }
        for name, make in pools.items():
            started = time.perf_counter()
            rows[name] = await _pool_throughput(make(), spec, rollouts, concurrency, started)
    base = rows["in_process"]["rollouts_per_s"]
    for row in rows.values():
        row["vs_in_process"] = row["rollouts_per_s"] / base
    return {"steps_per_rollout": steps + 1, "cpus": os.cpu_count(), "pools": rows}


def agent_step_overhead(steps: int, rollouts: int) -> dict[str, Any]:
    """Part 2 around a private etcd and orchard-env (the local runtime needs root)."""
    return on_local_env(lambda endpoint, token: _overhead_run(endpoint, token, steps, rollouts))


def workers_throughput(steps: int, rollouts: int, concurrency: int) -> dict[str, Any]:
    """Part 3 around a private etcd and orchard-env (the local runtime needs root)."""
    return on_local_env(
        lambda endpoint, token: _workers_run(endpoint, token, steps, rollouts, concurrency)
    )


def on_local_env(
    work: Callable[[str, str], Coroutine[Any, Any, dict[str, Any]]],
) -> dict[str, Any]:
    """`work(endpoint, token)` against a private etcd and orchard-env with the local runtime."""
    if os.geteuid() != 0:
        return {"skipped": "needs root (the local runtime of orchard-env)"}
    from orchard.sdk.cli.host_probe import remove_cgroup_parent  # noqa: PLC0415
    from orchard.sdk.cli.stack import LocalStack  # noqa: PLC0415

    state = Path(tempfile.mkdtemp(prefix="orchard-rollout-bench-"))
    run_dir = Path(tempfile.mkdtemp(prefix="orb-"))
    cgroup_parent = f"orchard-bench-{uuid.uuid4().hex[:8]}"
    token = secrets.token_urlsafe(16)
    stack = LocalStack(
        state,
        listen=f"127.0.0.1:{_free_port()}",
        token=token,
        runtime={"cgroup_parent": cgroup_parent, "run_dir": str(run_dir)},
    )
    try:
        stack.start()
        return asyncio.run(work(stack.endpoint, token))
    finally:
        stack.stop()
        remove_cgroup_parent(cgroup_parent)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)


# -- part 4: the capture proxy's overhead per call, by dialect ------------------------------

PROXY_SYSTEM = "You are a careful shell agent. Think briefly, then call one tool per step."
PROXY_USER = "List the files in the working directory and count the Python modules among them."
PROXY_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


def _dialect_bodies(max_tokens: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """The same conversation as each dialect's request (path under the session, body)."""
    function = PROXY_TOOL["function"]
    return {
        "chat_completions": (
            "/v1/chat/completions",
            {
                "model": "policy",
                "messages": [
                    {"role": "system", "content": PROXY_SYSTEM},
                    {"role": "user", "content": PROXY_USER},
                ],
                "tools": [PROXY_TOOL],
                "temperature": 0,
                "max_tokens": max_tokens,
            },
        ),
        "responses": (
            "/v1/responses",
            {
                "model": "policy",
                "instructions": PROXY_SYSTEM,
                "input": [{"role": "user", "content": PROXY_USER}],
                "tools": [{"type": "function", **function}],
                "temperature": 0,
                "max_output_tokens": max_tokens,
                "store": False,
            },
        ),
        "messages": (
            "/v1/messages",
            {
                "model": "policy",
                "system": PROXY_SYSTEM,
                "messages": [{"role": "user", "content": PROXY_USER}],
                "tools": [
                    {
                        "name": function["name"],
                        "description": function["description"],
                        "input_schema": function["parameters"],
                    }
                ],
                "temperature": 0,
                "max_tokens": max_tokens,
            },
        ),
    }


async def _proxy_overhead_run(calls: int, max_tokens: int) -> dict[str, Any]:
    import aiohttp  # noqa: PLC0415

    from orchard.lm.chat import ChatRenderer  # noqa: PLC0415
    from orchard.lm.model_folder import save_model_folder  # noqa: PLC0415
    from orchard.lm.models import tiny_causal_lm_for  # noqa: PLC0415
    from orchard.lm.tokenizer import build_tokenizer  # noqa: PLC0415
    from orchard.rollout.engines.base import SamplingParams  # noqa: PLC0415
    from orchard.rollout.engines.local import LocalEngine, LocalEngineConfig  # noqa: PLC0415
    from orchard.rollout.proxy.server import CaptureProxy  # noqa: PLC0415

    tokenizer = build_tokenizer()
    folder = Path(tempfile.mkdtemp(prefix="orchard-proxy-bench-"))
    try:
        model = tiny_causal_lm_for(tokenizer, seed=0, context=512)
        saved = save_model_folder(folder / "model", model, tokenizer)
        config = LocalEngineConfig(model_folder=str(saved), weight_version="bench-v1")
        async with (
            LocalEngine(config) as engine,
            CaptureProxy(engine) as proxy,
            aiohttp.ClientSession() as http,
        ):
            renderer = ChatRenderer(engine.tokenizer)
            prompt = renderer.render(
                [
                    {"role": "system", "content": PROXY_SYSTEM},
                    {"role": "user", "content": PROXY_USER},
                ],
                [PROXY_TOOL],
            ).token_ids
            params = SamplingParams(
                max_tokens=max_tokens, temperature=0, stop_token_ids=renderer.stop_token_ids
            )
            bodies = _dialect_bodies(max_tokens)
            endpoint = proxy.open_session("bench")
            seconds: dict[str, list[float]] = {"direct": [], **{name: [] for name in bodies}}
            output_tokens: dict[str, set[int]] = {name: set() for name in seconds}

            async def direct() -> None:
                output_tokens["direct"].add(len((await engine.generate(prompt, params)).token_ids))

            async def through(name: str) -> None:
                path, body = bodies[name]
                async with http.post(endpoint.anthropic_base_url + path, json=body) as response:
                    if response.status != 200:
                        raise RuntimeError(
                            f"{name}: HTTP {response.status}: {await response.text()}"
                        )
                    await response.read()

            async def floor() -> None:
                async with http.get(f"{proxy.url}/health") as response:
                    await response.read()

            floor_s: list[float] = []
            for index in range(calls + 3):  # three warm-up rounds
                for name, samples in seconds.items():
                    began = time.perf_counter()
                    await (direct() if name == "direct" else through(name))
                    if index >= 3:
                        samples.append(time.perf_counter() - began)
                began = time.perf_counter()
                await floor()
                if index >= 3:
                    floor_s.append(time.perf_counter() - began)
            records = await proxy.settle("bench", timeout=30)
            for record in records:
                name = record.metadata["api"]
                output_tokens[name].add(len(record.output_token_ids))
                if record.prompt_token_ids != prompt:
                    raise RuntimeError(f"{name}: the proxy rendered another prompt")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    direct_ms = statistics.median(seconds["direct"]) * 1000
    rows = {}
    for name, values in seconds.items():
        p50 = statistics.median(values) * 1000
        rows[name] = {
            "p50_ms": p50,
            "p90_ms": statistics.quantiles(values, n=10)[-1] * 1000,
            "output_tokens": sorted(output_tokens[name]),
            "overhead_ms": p50 - direct_ms,
            "overhead_vs_direct": p50 / direct_ms - 1,
        }
    return {
        "calls": calls,
        "prompt_tokens": len(prompt),
        "max_tokens": max_tokens,
        "http_round_trip_p50_ms": statistics.median(floor_s) * 1000,
        "paths": rows,
        "target_overhead_vs_direct": 0.05,
    }


def proxy_overhead(calls: int, max_tokens: int) -> dict[str, Any]:
    """Part 4: the local engine on a small model built here, with and without the proxy."""
    return asyncio.run(_proxy_overhead_run(calls, max_tokens))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=16_000, help="trajectories per sampler")
    parser.add_argument("--seeds", type=int, default=3, help="task streams averaged")
    parser.add_argument("--steps", type=int, default=20, help="part 2: commands per rollout")
    parser.add_argument("--rollouts", type=int, default=5, help="part 2: rollouts measured")
    parser.add_argument("--skip-overhead", action="store_true", help="leave part 2 out")
    parser.add_argument("--worker-steps", type=int, default=4, help="part 3: commands per rollout")
    parser.add_argument("--worker-rollouts", type=int, default=32, help="part 3: rollouts timed")
    parser.add_argument("--worker-concurrency", type=int, default=8, help="part 3: at once")
    parser.add_argument("--skip-workers", action="store_true", help="leave part 3 out")
    parser.add_argument("--proxy-calls", type=int, default=40, help="part 4: calls per path")
    parser.add_argument("--proxy-max-tokens", type=int, default=32, help="part 4: tokens a call")
    parser.add_argument("--skip-proxy", action="store_true", help="leave part 4 out")
    args = parser.parse_args(argv)

    rows = asyncio.run(sampler_comparison(args.budget, args.seeds))
    baseline = rows[0]
    for row in rows:
        row["advantage_mass_vs_baseline"] = (
            row["advantage_mass_per_1000"] / baseline["advantage_mass_per_1000"]
        )
        row["usable_groups_vs_baseline"] = (
            row["usable_groups_per_1000"] / baseline["usable_groups_per_1000"]
        )
    result: dict[str, Any] = {
        "benchmark": "rollout",
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "samplers": {
            "budget_trajectories_per_seed": args.budget,
            "seeds": args.seeds,
            "task_spread": {
                "never_solved": NEVER_SOLVED,
                "always_solved": ALWAYS_SOLVED,
                "others": "pass rate ~ Beta(0.6, 0.9)",
                "abort_rate": ABORT_RATE,
                "truncated_share_of_failures": TRUNCATED_SHARE_OF_FAILURES,
            },
            "rows": rows,
        },
    }
    if not args.skip_overhead:
        result["agent_step_overhead"] = agent_step_overhead(args.steps, args.rollouts)
    elif RESULTS.exists():
        previous = json.loads(RESULTS.read_text()).get("agent_step_overhead")
        if previous is not None:
            result["agent_step_overhead"] = previous
    if not args.skip_workers:
        result["workers_throughput"] = workers_throughput(
            args.worker_steps, args.worker_rollouts, args.worker_concurrency
        )
    elif RESULTS.exists():
        previous = json.loads(RESULTS.read_text()).get("workers_throughput")
        if previous is not None:
            result["workers_throughput"] = previous
    if not args.skip_proxy:
        result["proxy_overhead"] = proxy_overhead(args.proxy_calls, args.proxy_max_tokens)
    elif RESULTS.exists():
        previous = json.loads(RESULTS.read_text()).get("proxy_overhead")
        if previous is not None:
            result["proxy_overhead"] = previous
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")

    print(f"Samplers at equal budget ({args.budget} trajectories x {args.seeds} task streams)")
    header = (
        f"  {'sampler':<34} {'groups/1k':>9} {'x base':>7} {'pos.frac':>8} "
        f"{'adv.mass/1k':>11} {'x base':>7} {'bal./1k':>7} {'groups/100 tasks':>16}"
    )
    print(header)
    for row in rows:
        print(
            f"  {row['sampler']:<34} {row['usable_groups_per_1000']:>9.1f} "
            f"{row['usable_groups_vs_baseline']:>7.2f} {row['mean_positive_fraction_kept']:>8.3f} "
            f"{row['advantage_mass_per_1000']:>11.1f} {row['advantage_mass_vs_baseline']:>7.2f} "
            f"{row['balanced_groups_per_1000']:>7.1f} {row['usable_groups_per_100_tasks']:>16.1f}"
        )
    overhead = result.get("agent_step_overhead")
    if overhead and "skipped" not in overhead:
        print(
            f"Agent step through the rollout manager ({overhead['rollouts']} rollouts x "
            f"{overhead['steps_per_rollout']} steps, scripted policy, real orchard-env)"
        )
        print(
            f"  step through the manager {overhead['harness_step_ms']:.2f} ms, raw loop "
            f"{overhead['raw_step_ms']:.2f} ms (raw exec {overhead['raw_exec_ms']:.2f} ms): "
            f"overhead {overhead['overhead_per_step_ms']:.2f} ms per step, "
            f"{overhead['overhead_vs_raw_exec']:.1%} of raw exec (target 5%)"
        )
    elif overhead:
        print(f"Agent step overhead: skipped ({overhead['skipped']})")
    workers = result.get("workers_throughput")
    if workers and "skipped" not in workers:
        first = next(iter(workers["pools"].values()))
        print(
            f"Rollout throughput by where rollouts run ({first['rollouts']} rollouts x "
            f"{workers['steps_per_rollout']} steps, {first['concurrency']} at once, "
            f"{workers['cpus']} CPUs, scripted policy, real orchard-env)"
        )
        print(
            f"  {'workers':<14} {'rollouts/s':>10} {'steps/s':>8} {'x in-proc':>9} {'start s':>8}"
        )
        for name, row in workers["pools"].items():
            print(
                f"  {name:<14} {row['rollouts_per_s']:>10.2f} {row['steps_per_s']:>8.1f} "
                f"{row['vs_in_process']:>9.2f} {row['pool_start_s']:>8.2f}"
            )
    elif workers:
        print(f"Rollout throughput by workers: skipped ({workers['skipped']})")
    proxy = result.get("proxy_overhead")
    if proxy:
        print(
            f"Capture proxy per call by dialect ({proxy['calls']} calls a path, "
            f"{proxy['prompt_tokens']} prompt tokens, {proxy['max_tokens']} sampled greedily, "
            "local CPU engine, not streamed)"
        )
        print(f"  {'path':<18} {'p50 ms':>8} {'p90 ms':>8} {'overhead ms':>11} {'overhead':>9}")
        for name, row in proxy["paths"].items():
            print(
                f"  {name:<18} {row['p50_ms']:>8.2f} {row['p90_ms']:>8.2f} "
                f"{row['overhead_ms']:>11.2f} {row['overhead_vs_direct']:>9.1%}"
            )
        print(
            f"  (target: at most 5% over the direct call; an empty HTTP round trip on this "
            f"loop takes {proxy['http_round_trip_p50_ms']:.2f} ms p50)"
        )
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
