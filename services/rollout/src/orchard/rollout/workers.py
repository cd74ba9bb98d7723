"""Rollout workers: where rollouts run. In this process by default, or in Ray actors when
configured (a local Ray in tests, a cluster address in production), with the same results.

A worker pool runs ``rollout(key, index) -> RolloutResult``, the signature samplers draw with.
What a rollout needs (sandbox client, model endpoint, harnesses, tasks, budgets) is described by
a `RunnerSpec`: plain, picklable data. Each Ray actor builds its own `RolloutRunner` from it
inside the actor's event loop (clients never cross a process boundary); the in-process pool
builds one here. Ray is an optional extra (``orchard-rollout[ray]``), imported only by
`RayWorkers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from orchard.rollout.budgets import LayeredRetries, RolloutBudget
from orchard.rollout.harnesses.tool_loop import ModelEndpoint, ToolCallingHarness
from orchard.rollout.results import GroupKey, RolloutResult
from orchard.rollout.runner import RolloutRunner
from orchard.rollout.tasks import TaskSpec
from orchard.sdk import AsyncSandboxClient

RAY_LOCAL_ENV = {
    # Bind the local Ray to 127.0.0.1 (not the machine's external address), no auth tokens, no
    # usage reporting.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}


class WorkersConfig(BaseModel):
    """Where rollouts run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["in_process", "ray"] = Field(
        default="in_process", description="`in_process` (the default) or `ray` actors."
    )
    concurrency: int = Field(
        default=8, ge=1, description="Most rollouts running at once in the whole pool."
    )
    ray_address: str | None = Field(
        default=None,
        description="A Ray cluster to join (e.g. ray://head:10001); unset starts a local Ray "
        "on 127.0.0.1 in this process.",
    )
    ray_actors: int = Field(default=2, ge=1, description="How many rollout actors to start.")
    ray_num_cpus: float = Field(
        default=0.5, gt=0, description="CPUs Ray reserves for each actor (rollouts mostly wait)."
    )
    ray_init_cpus: int | None = Field(
        default=None, ge=1, description="CPUs a local Ray offers (unset: the machine's)."
    )


@dataclass(frozen=True, slots=True)
class RunnerSpec:
    """Everything a worker needs to build a `RolloutRunner`; picklable."""

    profile: str | None
    """The env service's client profile (as for `AsyncSandboxClient(profile=...)`)."""
    endpoint: ModelEndpoint
    harnesses: Mapping[str, ToolCallingHarness]
    tasks: Mapping[str, TaskSpec]
    budget: RolloutBudget = field(default_factory=RolloutBudget)
    retries: LayeredRetries = field(default_factory=LayeredRetries)
    seed: int | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    def runner(self, sandboxes: AsyncSandboxClient) -> RolloutRunner:
        return RolloutRunner(
            sandboxes=sandboxes,
            endpoint=self.endpoint,
            harnesses=dict(self.harnesses),
            tasks=dict(self.tasks),
            budget=self.budget,
            retries=self.retries,
            seed=self.seed,
            labels=dict(self.labels),
        )

    def sandbox_client(self) -> AsyncSandboxClient:
        return AsyncSandboxClient(profile=Path(self.profile) if self.profile else None)


class RolloutWorkers(Protocol):
    """A pool: `async with pool:` starts it; `await pool.rollout(key, index)` runs one rollout."""

    async def rollout(self, key: GroupKey, index: int) -> RolloutResult: ...

    async def __aenter__(self) -> RolloutWorkers: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class InProcessWorkers:
    """Rollouts as tasks of this event loop, at most `concurrency` at once."""

    def __init__(self, spec: RunnerSpec, *, concurrency: int = 8) -> None:
        self.spec = spec
        self._limit = asyncio.Semaphore(concurrency)
        self._stack = contextlib.AsyncExitStack()
        self._runner: RolloutRunner | None = None

    async def __aenter__(self) -> InProcessWorkers:
        sandboxes = await self._stack.enter_async_context(self.spec.sandbox_client())
        self._runner = self.spec.runner(sandboxes)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._runner = None
        await self._stack.aclose()

    async def rollout(self, key: GroupKey, index: int) -> RolloutResult:
        if self._runner is None:
            raise RuntimeError("the worker pool is not started (use `async with`)")
        async with self._limit:
            return await self._runner(key, index)


class _RolloutActor:
    """The body of one Ray actor (made a remote class by `RayWorkers`): an async actor whose
    event loop owns its own sandbox client and runner."""

    def __init__(self, spec: RunnerSpec) -> None:
        self._spec = spec
        self._stack = contextlib.AsyncExitStack()
        self._runner: RolloutRunner | None = None
        self._lock: asyncio.Lock | None = None

    async def _ready(self) -> RolloutRunner:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._runner is None:
                sandboxes = await self._stack.enter_async_context(self._spec.sandbox_client())
                self._runner = self._spec.runner(sandboxes)
        return self._runner

    async def rollout(self, key: GroupKey, index: int) -> RolloutResult:
        runner = await self._ready()
        return await runner(key, index)

    async def pid(self) -> int:
        return os.getpid()

    async def close(self) -> None:
        self._runner = None
        await self._stack.aclose()


class RayWorkers:
    """Rollouts in `actors` Ray actors, handed out in turn, at most `concurrency` at once.

    Joins `address` when given; otherwise starts a local Ray bound to 127.0.0.1 (and shuts it
    down on exit).
    """

    def __init__(
        self,
        spec: RunnerSpec,
        *,
        actors: int = 2,
        concurrency: int = 8,
        address: str | None = None,
        num_cpus_per_actor: float = 0.5,
        init_cpus: int | None = None,
    ) -> None:
        self.spec = spec
        self.address = address
        self._count = actors
        self._cpus = num_cpus_per_actor
        self._init_cpus = init_cpus
        self._limit = asyncio.Semaphore(concurrency)
        self._actors: list[Any] = []
        self._turn: itertools.cycle[Any] | None = None
        self._started_ray = False

    async def __aenter__(self) -> RayWorkers:
        ray = _import_ray()
        if not ray.is_initialized():
            if self.address is None:
                for key, value in RAY_LOCAL_ENV.items():
                    os.environ.setdefault(key, value)
                await asyncio.to_thread(
                    ray.init,
                    num_cpus=self._init_cpus,
                    include_dashboard=False,
                    log_to_driver=False,
                )
            else:
                await asyncio.to_thread(ray.init, address=self.address, log_to_driver=False)
            self._started_ray = True
        actor_class = ray.remote(num_cpus=self._cpus)(_RolloutActor)
        self._actors = [actor_class.remote(self.spec) for _ in range(self._count)]
        self._turn = itertools.cycle(self._actors)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        ray = _import_ray()
        for actor in self._actors:
            with contextlib.suppress(Exception):
                await actor.close.remote()
            ray.kill(actor)
        self._actors.clear()
        self._turn = None
        if self._started_ray:
            await asyncio.to_thread(ray.shutdown)
            self._started_ray = False

    async def actor_pids(self) -> list[int]:
        """The process id of each actor (to show rollouts really ran elsewhere)."""
        return [int(await actor.pid.remote()) for actor in self._actors]

    async def rollout(self, key: GroupKey, index: int) -> RolloutResult:
        if self._turn is None:
            raise RuntimeError("the worker pool is not started (use `async with`)")
        actor = next(self._turn)
        async with self._limit:
            result: RolloutResult = await actor.rollout.remote(key, index)
        return result


def make_workers(config: WorkersConfig, spec: RunnerSpec) -> InProcessWorkers | RayWorkers:
    """The pool `config` asks for."""
    if config.kind == "ray":
        return RayWorkers(
            spec,
            actors=config.ray_actors,
            concurrency=config.concurrency,
            address=config.ray_address,
            num_cpus_per_actor=config.ray_num_cpus,
            init_cpus=config.ray_init_cpus,
        )
    return InProcessWorkers(spec, concurrency=config.concurrency)


def _import_ray() -> Any:
    try:
        ray = importlib.import_module("ray")
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise RuntimeError(
            "Ray workers need the ray extra: pip install 'orchard-rollout[ray]'"
        ) from exc
    return ray
