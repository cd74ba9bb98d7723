"""Rollout workers: where rollouts run. In this process by default, or in Ray actors when
configured (a local Ray on 127.0.0.1 that the pool starts, or a cluster address), with the same
results.

A pool serves the jobs of a process: `pool.job(job_id, spec, ...)` gives the `RunRollout`
callable (``rollout(key, index) -> RolloutResult``) that a job's sampler draws with. What
crosses to a worker is plain, picklable data: the services' addresses and settings
(`WorkerServices`), once per worker, and per job a `RunnerSpec` (model endpoint URL, harnesses,
tasks, budgets). Each Ray actor opens its own clients inside its own event loop (clients never
cross a process boundary) and builds one `RolloutRunner` per job. The capture proxy stays in
the service's process: it opens each rollout's capture session, hands the actor the session's
URL and takes the calls once the actor is done (`collect_calls`).

A rollout whose actor dies (killed, out of memory, its node gone) raises `WorkerLost` after the
sandbox it left is deleted and its capture session closed; the job retries it as a new rollout
or excludes it with the reason (`orchard.rollout.runs.JobRun`). Actors restart by themselves;
rollouts go to the least busy actor, avoiding one that just died.

Ray is an optional extra (``orchard-rollout[ray]``), imported only by `RayWorkers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import Field, model_validator

from orchard.core.artifacts import ArtifactsConfig, ArtifactStore
from orchard.core.config import ConfigModel
from orchard.core.local_ray import RAY_LOCAL_ENV, children, descendants, end_processes, import_ray
from orchard.rollout.budgets import LayeredRetries, RolloutBudget
from orchard.rollout.harnesses.kinds import Harness
from orchard.rollout.harnesses.tool_loop import ModelEndpoint
from orchard.rollout.results import GroupKey, RolloutResult, RunRollout
from orchard.rollout.runner import (
    ROLLOUT_LABEL,
    CaptureSource,
    RolloutRunner,
    RolloutSession,
    collect_calls,
    new_rollout_id,
    rollout_label,
)
from orchard.rollout.scoring import LocalScorer, RewardServiceScorer, TaskScorer
from orchard.rollout.task_files import FileSource, StoreFiles
from orchard.rollout.tasks import TaskSpec
from orchard.rollout.trails import TrailWriter
from orchard.sdk import AsyncSandboxClient
from orchard.sdk import errors as sdk_errors
from orchard.sdk.service_config import EnvClientConfig

if TYPE_CHECKING:
    from orchard.rollout.config import RolloutConfig

__all__ = [
    "RAY_LOCAL_ENV",
    "InProcessWorkers",
    "RayWorkers",
    "RolloutWorkers",
    "RunnerSpec",
    "WorkerLost",
    "WorkerServices",
    "WorkersConfig",
    "make_workers",
]

log = logging.getLogger(__name__)

ACTOR_START_TIMEOUT_S = 120.0
"""How long a pool's start (the service's) waits for its rollout actors."""
RECENTLY_LOST_S = 30.0
"""An actor that lost a rollout this recently gets new ones only when every actor did."""


class WorkersConfig(ConfigModel):
    """Where rollouts run."""

    kind: Literal["in_process", "ray"] = Field(
        default="in_process",
        description="`in_process` (the default: rollouts are tasks of the service's event loop) "
        "or `ray` actors.",
    )
    concurrency: int = Field(
        default=64,
        ge=1,
        description="Most rollouts running at once in the whole pool, over all jobs (each job "
        "also keeps to its own concurrency).",
    )
    ray_address: str | None = Field(
        default=None,
        description="A Ray cluster to join (e.g. ray://head:10001); unset starts a local Ray "
        "on 127.0.0.1 in the service's process, ended with the service. On a cluster, the "
        "environment and reward services, the artifact store and the capture proxy "
        "(`proxy.public_url`) must be reachable from the Ray nodes.",
    )
    ray_actors: int = Field(default=2, ge=1, description="How many rollout actors to start.")
    ray_num_cpus: float = Field(
        default=0.5, gt=0, description="CPUs Ray reserves for each actor (rollouts mostly wait)."
    )
    ray_init_cpus: int | None = Field(
        default=None, ge=1, description="CPUs a local Ray offers (unset: the machine's)."
    )
    rollout_attempts: int = Field(
        default=3,
        ge=1,
        description="Tries of a rollout whose worker was lost (killed, out of memory, its node "
        "gone), each a new rollout in a new sandbox; after the last it is excluded with the "
        "reason.",
    )

    @model_validator(mode="after")
    def _ray_installed(self) -> WorkersConfig:
        # Refused with the configuration, before the service connects anywhere.
        if self.kind == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(
                "workers.kind ray needs Ray, which is not installed here: "
                "pip install 'orchard-rollout[ray]'"
            )
        return self


@dataclass(frozen=True, slots=True)
class WorkerServices:
    """The services a worker's rollouts use, as addresses and settings (picklable): each worker
    opens its own clients from these. Secrets stay in the environment: the env service's token
    is read, in the worker, from the variable `env.token_env` names."""

    env_endpoint: str
    """gRPC address of orchard-env."""
    env: EnvClientConfig = field(default_factory=EnvClientConfig)
    reward_endpoint: str | None = None
    """gRPC address of orchard-reward; None scores command checks in the sandbox only."""
    reward_timeout_s: float = 3600.0
    artifacts: ArtifactsConfig | None = None
    """The artifact store task archives are read from; None: tasks bring no files."""

    @classmethod
    def of(cls, config: RolloutConfig) -> WorkerServices:
        env = config.env.model_dump(exclude={"endpoint"})
        return cls(
            env_endpoint=config.env.endpoint,
            env=EnvClientConfig.model_construct(**env),
            reward_endpoint=config.reward.endpoint,
            reward_timeout_s=config.reward.call_timeout_s,
            artifacts=config.artifacts,
        )

    async def open(
        self, stack: contextlib.AsyncExitStack
    ) -> tuple[AsyncSandboxClient, TaskScorer, FileSource | None]:
        """This worker's clients, closed with `stack`."""
        sandboxes = await stack.enter_async_context(self.env.client(self.env_endpoint))
        scorer: TaskScorer = LocalScorer()
        if self.reward_endpoint:
            scorer = await stack.enter_async_context(
                RewardServiceScorer(self.reward_endpoint, call_timeout_s=self.reward_timeout_s)
            )
        files = StoreFiles(self.artifacts.store()) if self.artifacts is not None else None
        return sandboxes, scorer, files

    def trail_store(self) -> ArtifactStore | None:
        """Where this worker writes GUI trails (the artifact store); None without one."""
        return self.artifacts.store() if self.artifacts is not None else None


@dataclass(frozen=True, slots=True)
class RunnerSpec:
    """What a job's rollouts need beyond the services (picklable): where the model is, the
    harnesses, the tasks and the budgets."""

    endpoint: ModelEndpoint
    harnesses: Mapping[str, Harness]
    tasks: Mapping[str, TaskSpec]
    budget: RolloutBudget = field(default_factory=RolloutBudget)
    retries: LayeredRetries = field(default_factory=LayeredRetries)
    seed: int | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    """Labels put on every sandbox (e.g. the job id)."""
    trails_job_id: str = ""
    """The job whose GUI trails are kept (`RolloutJobSpec.keep_gui_trails`); empty: none."""

    def runner(
        self,
        sandboxes: AsyncSandboxClient,
        *,
        scorer: TaskScorer | None = None,
        files: FileSource | None = None,
        capture: CaptureSource | None = None,
        trail_store: ArtifactStore | None = None,
    ) -> RolloutRunner:
        """The job's runner; its GUI trails go to `trail_store` when the job keeps them."""
        trails = None
        if self.trails_job_id and trail_store is not None:
            trails = TrailWriter(trail_store, self.trails_job_id)
        return RolloutRunner(
            sandboxes=sandboxes,
            endpoint=self.endpoint,
            harnesses=dict(self.harnesses),
            tasks=dict(self.tasks),
            budget=self.budget,
            retries=self.retries,
            capture=capture,
            scorer=scorer or LocalScorer(),
            seed=self.seed,
            labels=dict(self.labels),
            files=files,
            keep_records=False,
            trails=trails,
        )


class WorkerLost(Exception):
    """The worker running a rollout died before it ended (what it left is cleaned up)."""

    def __init__(self, rollout_id: str, reason: str) -> None:
        super().__init__(f"rollout {rollout_id}: {reason}")
        self.rollout_id = rollout_id
        self.reason = reason


class JobRollouts(Protocol):
    """A job's rollouts on a pool: `async with pool.job(...) as run:`, `await run(key, i)`."""

    async def __call__(self, key: GroupKey, index: int) -> RolloutResult: ...

    async def __aenter__(self) -> RunRollout: ...

    async def __aexit__(self, *exc_info: object) -> None: ...


class RolloutWorkers(Protocol):
    """A pool: `async with pool:` starts it; `pool.job(...)` runs a job's rollouts on it."""

    kind: str

    def job(
        self,
        job_id: str,
        spec: RunnerSpec,
        *,
        capture: CaptureSource | None = None,
        sandboxes: AsyncSandboxClient | None = None,
    ) -> JobRollouts: ...

    async def __aenter__(self) -> RolloutWorkers: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


# -- in this process --------------------------------------------------------------------------


class InProcessWorkers:
    """Rollouts as tasks of this event loop, at most `concurrency` at once."""

    kind = "in_process"

    def __init__(self, services: WorkerServices, *, concurrency: int = 64) -> None:
        self.services = services
        self._limit = asyncio.Semaphore(concurrency)
        self._stack = contextlib.AsyncExitStack()
        self._opened: tuple[AsyncSandboxClient, TaskScorer, FileSource | None] | None = None

    async def __aenter__(self) -> InProcessWorkers:
        self._opened = await self.services.open(self._stack)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._opened = None
        await self._stack.aclose()

    def job(
        self,
        job_id: str,
        spec: RunnerSpec,
        *,
        capture: CaptureSource | None = None,
        sandboxes: AsyncSandboxClient | None = None,
    ) -> _InProcessJob:
        if self._opened is None:
            raise RuntimeError("the worker pool is not started (use `async with`)")
        own, scorer, files = self._opened
        runner = spec.runner(
            own,
            scorer=scorer,
            files=files,
            capture=capture,
            trail_store=self.services.trail_store(),
        )
        return _InProcessJob(runner, self._limit)


@dataclass
class _InProcessJob:
    runner: RolloutRunner
    limit: asyncio.Semaphore

    async def __call__(self, key: GroupKey, index: int) -> RolloutResult:
        async with self.limit:
            return await self.runner(key, index)

    async def __aenter__(self) -> _InProcessJob:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        return None


# -- in Ray actors ----------------------------------------------------------------------------


class _RolloutActor:
    """The body of one Ray actor (made a remote class by `RayWorkers`): an async actor whose
    event loop owns its clients and one runner per job."""

    def __init__(self, services: WorkerServices) -> None:
        self._services = services
        self._stack = contextlib.AsyncExitStack()
        self._opened: tuple[AsyncSandboxClient, TaskScorer, FileSource | None] | None = None
        self._lock: asyncio.Lock | None = None
        self._runners: dict[str, RolloutRunner] = {}
        self._running: set[asyncio.Task[Any]] = set()
        self._served = 0

    async def _runner(self, job_id: str, spec: RunnerSpec) -> RolloutRunner:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._opened is None:
                self._opened = await self._services.open(self._stack)
            runner = self._runners.get(job_id)
            if runner is None:
                sandboxes, scorer, files = self._opened
                runner = self._runners[job_id] = spec.runner(
                    sandboxes,
                    scorer=scorer,
                    files=files,
                    trail_store=self._services.trail_store(),
                )
            return runner

    async def rollout(
        self, job_id: str, spec: RunnerSpec, key: GroupKey, index: int, session: RolloutSession
    ) -> RolloutResult:
        task = asyncio.current_task()
        if task is not None:
            self._running.add(task)
        try:
            runner = await self._runner(job_id, spec)
            result = await runner(key, index, session=session)
            self._served += 1
            return result
        finally:
            if task is not None:
                self._running.discard(task)

    async def forget(self, job_id: str) -> None:
        self._runners.pop(job_id, None)

    async def pid(self) -> int:
        return os.getpid()

    async def served(self) -> int:
        """Rollouts this actor process ran to their end."""
        return self._served

    async def running(self) -> int:
        """Rollouts this actor process runs now."""
        return len(self._running)

    async def close(self, timeout_s: float = 30.0) -> None:
        """Cancels the running rollouts (each deletes its sandbox), then closes the clients."""
        running = list(self._running)
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=timeout_s)
        self._runners.clear()
        self._opened = None
        await self._stack.aclose()


@dataclass(eq=False)
class _Actor:
    handle: Any
    index: int
    in_flight: int = 0
    lost_at: float = float("-inf")
    suspect: bool = False
    """It lost a rollout: answered again (restarted) before it gets another."""
    started: bool = False

    async def ready(self, timeout_s: float = 120.0) -> None:
        """Returns once the actor answers; while Ray restarts it, calls fail at once."""
        if not self.suspect:
            return
        ray = _import_ray()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self.handle.pid.remote()
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
            else:
                self.suspect = False
                return


class RayWorkers:
    """Rollouts in `actors` Ray actors, each to the least busy one, at most `concurrency` at
    once over all jobs.

    Joins `address` when given; otherwise starts a local Ray bound to 127.0.0.1 and, on exit,
    shuts it down and waits until every process it started has ended. A Ray that this process
    already runs (`ray.is_initialized()`) is used as it is and left running.
    """

    kind = "ray"

    def __init__(
        self,
        services: WorkerServices,
        *,
        actors: int = 2,
        concurrency: int = 64,
        address: str | None = None,
        num_cpus_per_actor: float = 0.5,
        init_cpus: int | None = None,
        start_timeout_s: float = ACTOR_START_TIMEOUT_S,
    ) -> None:
        self.services = services
        self.start_timeout_s = start_timeout_s
        self.address = address
        self._count = actors
        self._cpus = num_cpus_per_actor
        self._init_cpus = init_cpus
        self._limit = asyncio.Semaphore(concurrency)
        self._actors: list[_Actor] = []
        self._turn = 0
        self._started_ray = False
        self._ray_children: set[int] = set()

    @classmethod
    def of(cls, config: WorkersConfig, services: WorkerServices) -> RayWorkers:
        return cls(
            services,
            actors=config.ray_actors,
            concurrency=config.concurrency,
            address=config.ray_address,
            num_cpus_per_actor=config.ray_num_cpus,
            init_cpus=config.ray_init_cpus,
        )

    async def __aenter__(self) -> RayWorkers:
        ray = _import_ray(local=self.address is None)
        if not ray.is_initialized():
            before = children(os.getpid())
            if self.address is None:
                await asyncio.to_thread(
                    ray.init,
                    num_cpus=self._init_cpus,
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                )
            else:
                await asyncio.to_thread(
                    ray.init, address=self.address, log_to_driver=False, configure_logging=False
                )
            self._started_ray = True
            # What ray.init started (the node's processes; the workers run below them).
            self._ray_children = children(os.getpid()) - before
        try:
            # Ray restarts a dead actor; the rollout it ran is retried by the job as a new one
            # (never by Ray: a rerun would mix its calls with the lost run's).
            actor_class = ray.remote(num_cpus=self._cpus, max_restarts=-1, max_task_retries=0)(
                _RolloutActor
            )
            self._actors = [
                _Actor(actor_class.remote(self.services), i) for i in range(self._count)
            ]
            # Started before the first job: a bad setting fails the service's start, not a job.
            pids = asyncio.gather(*(actor.handle.pid.remote() for actor in self._actors))
            try:
                await asyncio.wait_for(pids, self.start_timeout_s)
                for actor in self._actors:
                    actor.started = True
            except TimeoutError:
                cpus = ray.cluster_resources().get("CPU", 0)
                raise RuntimeError(
                    f"Ray did not start {self._count} rollout actors of {self._cpus} CPU each "
                    f"within {self.start_timeout_s:g} s; the Ray cluster offers {cpus:g} CPUs "
                    "(workers.ray_actors, workers.ray_num_cpus, workers.ray_init_cpus)"
                ) from None
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        log.info(
            "rollout workers: %d Ray actors on %s",
            self._count,
            self.address or "a local Ray on 127.0.0.1",
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        ray = _import_ray()
        actors, self._actors = self._actors, []
        # An actor that never started has nothing to close (and would not answer).
        closing = [asyncio.wait_for(a.handle.close.remote(), 60) for a in actors if a.started]
        await asyncio.gather(*closing, return_exceptions=True)
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor.handle, no_restart=True)
        if self._started_ray:
            self._started_ray = False
            started = set(self._ray_children)
            for child in self._ray_children:
                started |= descendants(child)
            await asyncio.to_thread(ray.shutdown)
            if self.address is None:
                await asyncio.to_thread(end_processes, started)

    async def actor_pids(self) -> list[int]:
        """The process id of each actor, in actor order (rollouts run in these processes)."""
        return [int(await self._ask(actor, "pid")) for actor in self._actors]

    async def served(self) -> list[int]:
        """How many rollouts each actor's current process ran to their end, in actor order."""
        return [int(await self._ask(actor, "served")) for actor in self._actors]

    async def running(self) -> list[int]:
        """How many rollouts each actor runs now, in actor order."""
        return [int(await self._ask(actor, "running")) for actor in self._actors]

    async def _ask(self, actor: _Actor, method: str) -> Any:
        ray = _import_ray()
        for _ in range(600):
            try:
                return await getattr(actor.handle, method).remote()
            except ray.exceptions.ActorUnavailableError:
                await asyncio.sleep(0.2)  # restarting
        return await getattr(actor.handle, method).remote()

    def job(
        self,
        job_id: str,
        spec: RunnerSpec,
        *,
        capture: CaptureSource | None = None,
        sandboxes: AsyncSandboxClient | None = None,
    ) -> _RayJob:
        if not self._actors:
            raise RuntimeError("the worker pool is not started (use `async with`)")
        return _RayJob(self, job_id, spec, capture, sandboxes)

    def _pick(self) -> _Actor:
        now = time.monotonic()
        self._turn += 1
        count = len(self._actors)
        return min(
            self._actors,
            key=lambda a: (
                now - a.lost_at < RECENTLY_LOST_S,
                a.in_flight,
                (a.index - self._turn) % count,
            ),
        )


class _RayJob:
    """A job's rollouts on the actors: its spec stored once in Ray's object store."""

    def __init__(
        self,
        pool: RayWorkers,
        job_id: str,
        spec: RunnerSpec,
        capture: CaptureSource | None,
        sandboxes: AsyncSandboxClient | None,
    ) -> None:
        self.pool = pool
        self.job_id = job_id
        self.spec = spec
        self.capture = capture
        self.sandboxes = sandboxes
        self._spec_ref: Any = None

    async def __aenter__(self) -> _RayJob:
        ray = _import_ray()
        self._spec_ref = await asyncio.to_thread(ray.put, self.spec)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._spec_ref = None
        for actor in self.pool._actors:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(actor.handle.forget.remote(self.job_id), 10)

    async def __call__(self, key: GroupKey, index: int) -> RolloutResult:
        if self._spec_ref is None:
            raise RuntimeError("use the job's rollouts inside `async with pool.job(...)`")
        ray = _import_ray()
        rollout_id = new_rollout_id(key, index)
        if self.capture is not None:
            base_url = self.capture.open(rollout_id)
        else:
            base_url = self.spec.endpoint.for_rollout(rollout_id)
        session = RolloutSession(rollout_id, base_url)
        actor: _Actor | None = None
        try:
            async with self.pool._limit:
                actor = self.pool._pick()
                actor.in_flight += 1
                try:
                    await actor.ready()
                    ref = actor.handle.rollout.remote(
                        self.job_id, self._spec_ref, key, index, session
                    )
                    try:
                        result: RolloutResult = await ref
                    except asyncio.CancelledError:
                        ray.cancel(ref)  # the actor's rollout stops and deletes its sandbox
                        raise
                finally:
                    actor.in_flight -= 1
            if self.capture is not None:
                result = await collect_calls(result, self.capture)
            return result
        except ray.exceptions.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None  # the rollout's own error, as in-process
        except _lost_errors(ray) as exc:
            if actor is not None:
                actor.lost_at = time.monotonic()
                actor.suspect = True
            reason = f"its Ray worker was lost ({type(exc).__name__}: {_first_line(exc)})"
            log.warning("rollout %s of job %s: %s", rollout_id, self.job_id, reason)
            await self._delete_sandboxes(rollout_id)
            raise WorkerLost(rollout_id, reason) from None
        finally:
            if self.capture is not None:
                self.capture.close(rollout_id)

    async def _delete_sandboxes(self, rollout_id: str) -> None:
        """The sandbox a lost rollout left (its worker could not delete it)."""
        if self.sandboxes is None:
            return
        try:
            async for info in self.sandboxes.list({ROLLOUT_LABEL: rollout_label(rollout_id)}):
                with contextlib.suppress(sdk_errors.OrchardSDKError):
                    await self.sandboxes.delete(info.id)
        except sdk_errors.OrchardSDKError as exc:
            log.warning("rollout %s: its sandboxes were not listed: %s", rollout_id, exc)


def make_workers(config: WorkersConfig, services: WorkerServices) -> InProcessWorkers | RayWorkers:
    """The pool `config` asks for."""
    if config.kind == "ray":
        return RayWorkers.of(config, services)
    return InProcessWorkers(services, concurrency=config.concurrency)


def _lost_errors(ray: Any) -> tuple[type[BaseException], ...]:
    """What Ray raises when the process running a task is gone."""
    exceptions = ray.exceptions
    names = ("RayActorError", "WorkerCrashedError", "NodeDiedError", "OutOfMemoryError")
    return tuple(getattr(exceptions, n) for n in names if hasattr(exceptions, n))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "no detail"


def _import_ray(*, local: bool = False) -> Any:
    """Ray, set up for a local Ray when ``local`` (see `orchard.core.local_ray`)."""
    return import_ray(local=local, extra="orchard-rollout[ray]")
