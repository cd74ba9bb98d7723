"""``orchard.rollout.v1.RolloutService``: rollout jobs started, watched, streamed and cancelled.

`RolloutManager` owns what jobs use: the job store in etcd, the environment service client,
the scorer, and the policies (a local engine behind a capture proxy, started on first use, or an
OpenAI-compatible endpoint). Each job runs as one asyncio task in the process that owns it
(:class:`orchard.rollout.runs.JobRun`): ownership is a key on the process's etcd lease, so with
several replicas each job runs once, a job whose owner stopped or died is adopted by another
(or the restarted) process, and a cancel received by any replica reaches the owner.

Bad input is INVALID_ARGUMENT with what to fix; a job that needs something this service was not
configured with (a reward service) is FAILED_PRECONDITION. Both are raised as `OrchardError` and
turned into a status by the server's error interceptor.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import re
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from orchard.core.errors import ErrorReason, OrchardError, Reason
from orchard.core.etcd import Lease
from orchard.lm.weights import InvalidWeightVersion, check_model_name
from orchard.rollout.batches import GroupFilter
from orchard.rollout.budgets import LayeredRetries, RolloutBudget
from orchard.rollout.config import ENV_NAME, PolicyConfig, RolloutConfig
from orchard.rollout.engines.local import LocalEngineConfig
from orchard.rollout.harnesses.bash_react import (
    bash_react_harness,
    generic_tool_harness,
    shell_harness,
)
from orchard.rollout.harnesses.tool_loop import ModelEndpoint, ToolCallingHarness
from orchard.rollout.metrics import RolloutMetrics
from orchard.rollout.results import GroupKey
from orchard.rollout.runner import CaptureSource, ProxyCapture, RolloutRunner
from orchard.rollout.runs import JobRun, JobState, JobStore, new_job_id
from orchard.rollout.samplers import BalancedAdaptiveSampler, FixedNSampler, Sampler
from orchard.rollout.scoring import LocalScorer, TaskScorer
from orchard.rollout.tasks import CommandCheck, TaskSpec
from orchard.rollout.v1 import rollout_service_pb2 as api
from orchard.rollout.v1 import rollout_service_pb2_grpc
from orchard.sdk import AsyncSandboxClient
from orchard.sdk import errors as sdk_errors

if TYPE_CHECKING:
    from orchard.lm.weights import WeightRegistry
    from orchard.rollout.engines.local import LocalEngine
    from orchard.rollout.proxy.server import CaptureProxy

__all__ = ["JOB_LABEL", "RolloutManager", "RolloutServicer", "validate_spec"]

log = logging.getLogger(__name__)

JOB_LABEL = "orchard-rollout-job"
"""Label on every sandbox of a job (its id): a resumed job deletes what its last run left."""
TASK_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_:-]{0,99}$")
MAX_PAGE = 1000


@enum.unique
class RolloutReason(ErrorReason):
    """Reasons of the rollout service."""

    GROUPS_PAST_END = (
        grpc.StatusCode.OUT_OF_RANGE,
        "start_index is past the last group of a job that has ended.",
    )


def _invalid(message: str) -> OrchardError:
    return OrchardError(Reason.INVALID_ARGUMENT, message)


def builtin_harnesses(command_timeout_s: float) -> dict[str, ToolCallingHarness]:
    return {
        "builtin:bash": bash_react_harness(command_timeout_s=command_timeout_s),
        "builtin:swe": shell_harness(command_timeout_s=command_timeout_s),
        "builtin:tools": generic_tool_harness(),
    }


@dataclass(frozen=True, slots=True)
class ValidSpec:
    """A spec checked and turned into what the runner and the sampler take."""

    tasks: dict[str, TaskSpec]
    harnesses: list[str]
    policy: str
    """A configured policy's name; empty when the job brings its own (`job_policy`)."""
    sampler: Sampler
    group_filter: GroupFilter | None
    budget: RolloutBudget
    concurrency: int
    job_policy: JobPolicyKey | None = None

    @property
    def pairs(self) -> list[GroupKey]:
        return [GroupKey(t, h) for t in self.tasks for h in self.harnesses]


@dataclass(frozen=True, slots=True)
class JobPolicyKey:
    """A policy a job brought: registry weights (jobs with equal keys share one engine) or an
    endpoint (`base_url` set; nothing to start)."""

    model: str
    version: str
    """Empty: the latest version, following new publications."""
    temperature: float
    max_tokens_per_call: int
    base_url: str = ""
    api_key_env: str = ""

    @property
    def name(self) -> str:
        if self.base_url:
            return f"{self.model} at {self.base_url}"
        return f"{self.model}@{self.version or 'latest'}"

    def as_config(self, engine: LocalEngineConfig | None = None) -> PolicyConfig:
        """The policy as if configured: an endpoint (kind openai), or a local engine with
        `engine`'s settings (its weights resolved by the caller)."""
        if self.base_url:
            return PolicyConfig(
                kind="openai",
                base_url=self.base_url,
                model=self.model,
                api_key_env=self.api_key_env,
                temperature=self.temperature,
                max_tokens_per_call=self.max_tokens_per_call,
            )
        return PolicyConfig(
            kind="local",
            engine=engine or LocalEngineConfig(),
            model=self.model,
            temperature=self.temperature,
            max_tokens_per_call=self.max_tokens_per_call,
        )


def _job_policy(spec: api.PolicySpec, config: RolloutConfig) -> JobPolicyKey:
    if not config.job_policies.allow:
        raise OrchardError(
            Reason.FAILED_PRECONDITION,
            "this rollout service does not take policies in job specs (job_policies.allow is "
            "false): name one of its policies in spec.policy "
            f"({', '.join(sorted(config.policies))})",
        )
    temperature = spec.temperature if spec.HasField("temperature") else 1.0
    if not 0 <= temperature <= 2:
        raise _invalid(f"spec.policy_spec.temperature {temperature} must lie in [0, 2]")
    if spec.max_tokens_per_call < 0:
        raise _invalid("spec.policy_spec.max_tokens_per_call must not be negative")
    max_tokens = spec.max_tokens_per_call or 1024
    source = spec.WhichOneof("source")
    if source == "endpoint":
        endpoint = spec.endpoint
        url = urllib.parse.urlsplit(endpoint.base_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise _invalid(
                f"spec.policy_spec.endpoint.base_url {endpoint.base_url!r} must be an http(s) "
                "URL of an OpenAI-compatible API root, e.g. https://api.example.com/v1"
            )
        if not endpoint.model:
            raise _invalid("spec.policy_spec.endpoint.model is empty: name the model to call")
        if endpoint.api_key_env and not ENV_NAME.match(endpoint.api_key_env):
            raise _invalid(
                f"spec.policy_spec.endpoint.api_key_env {endpoint.api_key_env!r} is not an "
                "environment variable name"
            )
        return JobPolicyKey(
            model=endpoint.model,
            version="",
            temperature=temperature,
            max_tokens_per_call=max_tokens,
            base_url=endpoint.base_url,
            api_key_env=endpoint.api_key_env,
        )
    if source != "weights":
        raise _invalid(
            "spec.policy_spec needs weights ({model, version} in the weight registry) or an "
            "endpoint ({base_url, model})"
        )
    try:
        check_model_name(spec.weights.model)
    except ValueError as exc:
        raise _invalid(f"spec.policy_spec.weights.model: {exc}") from None
    return JobPolicyKey(
        model=spec.weights.model,
        version=spec.weights.version,
        temperature=temperature,
        max_tokens_per_call=max_tokens,
    )


def _sampler(config: api.SamplerConfig) -> Sampler:
    threshold = config.positive_threshold or 0.5
    try:
        if config.kind == api.SAMPLER_KIND_FIXED_N:
            if config.group_size == 1 and not config.keep_uninformative_groups:
                raise ValueError(
                    "group_size must be at least 2, got 1: a group of one rollout carries no "
                    "signal for training (an evaluation job sets keep_uninformative_groups)"
                )
            return FixedNSampler(group_size=config.group_size or 8, positive_threshold=threshold)
        if config.kind in (api.SAMPLER_KIND_BAR, api.SAMPLER_KIND_UNSPECIFIED):
            group_size = config.group_size or 8
            return BalancedAdaptiveSampler(
                group_size=group_size,
                max_rollouts=config.max_rollouts or max(16, group_size),
                stride=config.stride or 16,
                rho_min=config.rho_min if config.rho_min or config.rho_max else 0.375,
                rho_max=config.rho_max or 0.625,
                positive_threshold=threshold,
            )
    except ValueError as exc:
        raise _invalid(f"spec.sampler: {exc}") from None
    raise _invalid(f"spec.sampler.kind {config.kind} is not a known sampler (FIXED_N or BAR)")


def validate_spec(
    spec: api.RolloutJobSpec,
    config: RolloutConfig,
    harnesses: Mapping[str, ToolCallingHarness],
) -> ValidSpec:
    """Raises OrchardError (INVALID_ARGUMENT, FAILED_PRECONDITION) saying what to fix."""
    if not spec.tasks:
        raise _invalid("spec.tasks is empty: give at least one task to roll out")
    tasks: dict[str, TaskSpec] = {}
    for i, task in enumerate(spec.tasks):
        if not TASK_ID.match(task.id):
            raise _invalid(
                f"spec.tasks[{i}].id {task.id!r} must be 1-100 letters, digits, '_', ':' or '-'"
            )
        if task.id in tasks:
            raise _invalid(f"spec.tasks[{i}].id {task.id!r} appears twice; task ids are unique")
        try:
            tasks[task.id] = TaskSpec.from_proto(task)
        except ValueError as exc:
            raise _invalid(f"spec.tasks[{i}]: {exc}") from None
        if not isinstance(tasks[task.id].check, CommandCheck) and not config.reward.endpoint:
            raise OrchardError(
                Reason.FAILED_PRECONDITION,
                f"task {task.id!r} is scored by the reward service and this rollout service "
                "has none configured (set reward.endpoint)",
            )
    if not spec.harnesses:
        raise _invalid(f"spec.harnesses is empty; known harnesses: {', '.join(sorted(harnesses))}")
    if len(set(spec.harnesses)) != len(spec.harnesses):
        raise _invalid("spec.harnesses names a harness twice")
    for name in spec.harnesses:
        if name not in harnesses:
            raise _invalid(
                f"unknown harness {name!r}; known harnesses: {', '.join(sorted(harnesses))}"
            )
    job_policy = None
    if spec.HasField("policy_spec"):
        if spec.policy:
            raise _invalid("spec names a policy and brings a policy_spec: give one of them")
        job_policy = _job_policy(spec.policy_spec, config)
        policy = ""
    else:
        policy = spec.policy or config.default_policy
        if policy not in config.policies:
            known = ", ".join(sorted(config.policies))
            raise _invalid(f"unknown policy {policy!r}; configured policies: {known}")
    b, d = spec.budget, config.defaults
    if b.max_steps < 0 or b.max_tokens < 0 or b.max_duration.ToNanoseconds() < 0:
        raise _invalid("spec.budget: max_steps, max_tokens and max_duration must not be negative")
    duration = b.max_duration.ToNanoseconds() / 1e9
    budget = RolloutBudget(
        max_steps=b.max_steps or d.max_steps,
        max_tokens=b.max_tokens or d.max_tokens,
        max_duration_s=duration or d.max_duration_s,
    )
    if not 0 <= spec.concurrency <= d.max_concurrency:
        raise _invalid(
            f"spec.concurrency {spec.concurrency} must lie in [0, {d.max_concurrency}] "
            f"(0: {d.concurrency})"
        )
    sampler = _sampler(spec.sampler)
    keep_all = spec.sampler.keep_uninformative_groups
    return ValidSpec(
        tasks=tasks,
        harnesses=list(spec.harnesses),
        policy=policy,
        sampler=sampler,
        group_filter=None if keep_all else GroupFilter(),
        budget=budget,
        concurrency=spec.concurrency or d.concurrency,
        job_policy=job_policy,
    )


@dataclass
class _Policy:
    """A started policy: where harnesses send calls, and the capture source when captured."""

    endpoint: ModelEndpoint
    capture: CaptureSource | None = None
    engine: LocalEngine | None = None
    proxy: CaptureProxy | None = None

    async def close(self) -> None:
        if self.proxy is not None:
            with contextlib.suppress(Exception):
                await self.proxy.close()
        if self.engine is not None:
            with contextlib.suppress(Exception):
                await self.engine.close()


@dataclass
class _Shared:
    """A job policy's engine and how many running jobs use it."""

    policy: _Policy
    users: int = 0


@dataclass
class RolloutManager:
    """Jobs of this process, and what they run with."""

    config: RolloutConfig
    jobs: JobStore
    sandboxes: AsyncSandboxClient
    scorer: TaskScorer = field(default_factory=LocalScorer)
    metrics: RolloutMetrics = field(default_factory=lambda: RolloutMetrics(None))
    registry: WeightRegistry | None = None
    harnesses: dict[str, ToolCallingHarness] = field(default_factory=dict)
    _tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _changed: dict[str, asyncio.Event] = field(default_factory=dict)
    _policies: dict[str, _Policy] = field(default_factory=dict)
    _policy_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _job_policies: dict[JobPolicyKey, _Shared] = field(default_factory=dict)
    _job_policies_changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _create_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    owner: str = field(default_factory=lambda: uuid.uuid4().hex)
    lease_ttl_s: int = 10
    adopt_interval_s: float = 2.0
    _lease: Lease | None = None
    _watcher: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        if not self.harnesses:
            self.harnesses = builtin_harnesses(self.config.defaults.command_timeout_s)

    async def open(self) -> None:
        """Takes a lease for the jobs this process will own, adopts the jobs no live process
        owns (a restart's), and keeps watching for orphans and cancels from other replicas."""
        store = self.jobs.store
        self._lease = await store.grant_lease(self.lease_ttl_s)
        store.keep_alive(self._lease)
        await self._adopt_orphans()
        self._watcher = asyncio.create_task(self._watch(), name="rollout-job-watch")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.adopt_interval_s)
            try:
                await self._adopt_orphans()
            except Exception as exc:
                log.warning("adopting jobs failed: %s", exc)

    # -- policies ------------------------------------------------------------------------

    async def _policy(self, name: str) -> _Policy:
        async with self._policy_lock:
            started = self._policies.get(name)
            if started is not None:
                return started
            policy = self.config.policies[name]
            started = await self._start_policy(name, policy)
            self._policies[name] = started
            return started

    async def _check_job_policy(self, key: JobPolicyKey) -> None:
        """Raises OrchardError when the job's weights cannot be loaded here (or, for an
        endpoint, when its API key variable is unset here)."""
        if key.base_url:
            try:
                key.as_config().api_key()
            except ValueError:
                raise OrchardError(
                    Reason.FAILED_PRECONDITION,
                    f"spec.policy_spec.endpoint.api_key_env names {key.api_key_env}, which is "
                    "not set in the rollout service's environment: set it there (the key never "
                    "travels in a spec)",
                ) from None
            return
        if self.registry is None:
            raise OrchardError(
                Reason.FAILED_PRECONDITION,
                "this rollout service has no weight registry (it needs etcd) to load "
                "spec.policy_spec.weights from",
            )
        registry = self.registry.for_model(key.model)
        try:
            found = await (registry.get(key.version) if key.version else registry.latest())
        except InvalidWeightVersion as exc:
            raise _invalid(f"spec.policy_spec.weights.version: {exc}") from None
        if found is None:
            which = f"version {key.version!r}" if key.version else "any version"
            raise OrchardError(
                Reason.NOT_FOUND,
                f"{which} of model {key.model!r} is not published in the weight registry; "
                "publish it (orchard-trainer does) or name a published one",
            )

    async def _acquire_job_policy(self, key: JobPolicyKey) -> _Policy:
        """The engine of `key`, started when no running job uses it; waits while
        `job_policies.max_engines` others run. Give it back with `_release_job_policy`."""
        async with self._job_policies_changed:
            await self._job_policies_changed.wait_for(
                lambda: (
                    key in self._job_policies
                    or len(self._job_policies) < self.config.job_policies.max_engines
                )
            )
            shared = self._job_policies.get(key)
            if shared is None:
                # Started under the lock: a second job of the same key waits for this one.
                shared = _Shared(await self._start_job_policy(key))
                self._job_policies[key] = shared
                self.metrics.job_engines.inc()
            shared.users += 1
            return shared.policy

    async def _release_job_policy(self, key: JobPolicyKey) -> None:
        async with self._job_policies_changed:
            shared = self._job_policies.get(key)
            if shared is None:
                return
            shared.users -= 1
            if shared.users <= 0:
                del self._job_policies[key]
                self.metrics.job_engines.dec()
                await shared.policy.close()
                log.info("job policy %s closed", key.name)
            self._job_policies_changed.notify_all()

    async def _start_job_policy(self, key: JobPolicyKey) -> _Policy:
        """A job's registry weights on a local engine with `job_policies.engine`'s settings:
        the pinned version's folder, or the model's latest version, followed."""
        if self.registry is None:
            raise RuntimeError("this rollout service has no weight registry to load weights from")
        template = self.config.job_policies.engine
        if key.version:
            published = await self.registry.for_model(key.model).get(key.version)
            if published is None:
                raise LookupError(f"version {key.version!r} of {key.model!r} is not published")
            update = {
                "model_folder": published.location,
                "weight_version": published.version,
                "follow_registry": False,
            }
        else:
            update = {"model_folder": None, "registry_model": key.model, "follow_registry": True}
        return await self._start_policy(key.name, key.as_config(template.model_copy(update=update)))

    async def _start_policy(self, name: str, policy: PolicyConfig) -> _Policy:
        if policy.kind == "openai":
            return _Policy(
                ModelEndpoint(
                    base_url=policy.base_url,
                    model=policy.model,
                    api_key=policy.api_key(),
                    temperature=policy.temperature,
                    max_tokens_per_call=policy.max_tokens_per_call,
                )
            )
        from orchard.rollout.engines.local import LocalEngine  # noqa: PLC0415 - loads torch
        from orchard.rollout.proxy.server import CaptureProxy  # noqa: PLC0415

        registry = self.registry
        if registry is not None:
            registry = registry.for_model(policy.engine.registry_model)
        engine = LocalEngine(policy.engine, registry=registry)
        await engine.start()
        proxy = CaptureProxy(engine, self.config.proxy)
        try:
            await proxy.start()
        except BaseException:
            await engine.close()
            raise
        log.info("policy %s: local engine %s behind %s", name, engine.weight_version, proxy.url)
        return _Policy(
            ModelEndpoint(
                base_url=proxy.url + "/v1",
                model=policy.model,
                temperature=policy.temperature,
                max_tokens_per_call=policy.max_tokens_per_call,
            ),
            capture=ProxyCapture(proxy, self.config.settle_timeout_s),
            engine=engine,
            proxy=proxy,
        )

    # -- jobs ----------------------------------------------------------------------------

    def changed(self, job_id: str) -> asyncio.Event:
        return self._changed.setdefault(job_id, asyncio.Event())

    def _notify(self, job_id: str) -> None:
        event = self._changed.pop(job_id, None)
        if event is not None:
            event.set()

    async def create(self, spec: api.RolloutJobSpec, request_id: str) -> JobState:
        valid = validate_spec(spec, self.config, self.harnesses)
        if valid.job_policy is not None:
            await self._check_job_policy(valid.job_policy)
        async with self._create_lock:
            job = JobState(
                id=new_job_id(),
                spec=spec,
                request_id=request_id,
                pairs_total=len(valid.pairs),
            )
            stored = await self.jobs.create(job)
            if stored.id == job.id and await self._claim(job.id):
                self._start(job, valid)
            return stored

    async def _claim(self, job_id: str) -> bool:
        assert self._lease is not None, "open() the manager first"
        return await self.jobs.claim(job_id, self.owner, self._lease.id)

    def _start(self, job: JobState, valid: ValidSpec) -> None:
        task = asyncio.create_task(self._run(job, valid), name=f"rollout-job-{job.id}")
        self._tasks[job.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(job.id, None))

    async def _run(self, job: JobState, valid: ValidSpec) -> None:
        self.metrics.jobs_running.inc()
        try:
            key = valid.job_policy
            pooled = key is not None and not key.base_url
            try:
                if key is None:
                    policy = await self._policy(valid.policy)
                elif key.base_url:
                    policy = await self._start_policy(key.name, key.as_config())
                else:
                    policy = await self._acquire_job_policy(key)
            except Exception as exc:
                name = key.name if key else valid.policy
                job.state = api.ROLLOUT_JOB_STATE_FAILED
                job.error = f"policy {name!r} did not start: {type(exc).__name__}: {exc}"
                await self.jobs.put(job)
                self._notify(job.id)
                return
            try:
                await self._run_with(job, valid, policy)
            finally:
                if pooled and key is not None:
                    await self._release_job_policy(key)
        finally:
            self.metrics.jobs_running.dec()

    async def _run_with(self, job: JobState, valid: ValidSpec, policy: _Policy) -> None:
        runner = RolloutRunner(
            sandboxes=self.sandboxes,
            endpoint=policy.endpoint,
            harnesses=self.harnesses,
            tasks=valid.tasks,
            budget=valid.budget,
            retries=LayeredRetries(create_spread_s=self.config.defaults.create_spread_s),
            capture=policy.capture,
            scorer=self.scorer,
            labels={JOB_LABEL: job.id},
        )
        run = JobRun(
            job=job,
            jobs=self.jobs,
            sampler=valid.sampler,
            pairs=valid.pairs,
            run_rollout=runner,
            concurrency=valid.concurrency,
            metrics=self.metrics,
            group_filter=valid.group_filter,
            on_change=lambda: self._notify(job.id),
        )
        # The runner keeps every record; the groups carry them, so drop them as pairs end.
        runner.records = _Discard()
        await run.run()

    async def _adopt_orphans(self) -> None:
        """Jobs left RUNNING by a process that is gone: resumed here (or marked FAILED); and
        jobs of ours that another replica cancelled: stopped."""
        for job in await self.jobs.all():
            task = self._tasks.get(job.id)
            if task is not None:
                if job.ended:
                    task.cancel()
                continue
            if job.ended or not await self._claim(job.id):
                continue
            await self._delete_leftovers(job.id)
            if not self.config.resume_running_jobs:
                job.state = api.ROLLOUT_JOB_STATE_FAILED
                job.error = "the rollout service restarted while the job ran (resume is off)"
                await self.jobs.put(job)
                continue
            try:
                valid = validate_spec(job.spec, self.config, self.harnesses)
            except OrchardError as exc:
                job.state = api.ROLLOUT_JOB_STATE_FAILED
                job.error = f"cannot resume under this configuration: {exc.message}"
                await self.jobs.put(job)
                continue
            job.resumes += 1
            await self.jobs.put(job)
            log.info(
                "resuming job %s: %d of %d pairs done, %d groups emitted",
                job.id,
                len(job.pairs_done),
                job.pairs_total,
                job.groups_emitted,
            )
            self._start(job, valid)

    async def _delete_leftovers(self, job_id: str) -> None:
        try:
            async for info in self.sandboxes.list({JOB_LABEL: job_id}):
                with contextlib.suppress(sdk_errors.OrchardSDKError):
                    await self.sandboxes.delete(info.id)
        except sdk_errors.OrchardSDKError as exc:
            log.warning("job %s: sandboxes of its last run not listed: %s", job_id, exc)

    async def get(self, job_id: str) -> JobState:
        if not job_id:
            raise _invalid("job_id is empty")
        job = await self.jobs.get(job_id)
        if job is None:
            raise OrchardError(Reason.NOT_FOUND, f"no rollout job {job_id!r}")
        return job

    async def cancel(self, job_id: str) -> JobState:
        job = await self.get(job_id)
        if job.ended:
            return job
        # First the mark: from now on no runner (here or on another replica) writes the job.
        await self.jobs.mark_cancelled(job_id)
        task = self._tasks.get(job_id)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        job = await self.get(job_id)
        if not job.ended:
            # Another replica's job: it sees the state and stops its rollouts.
            job.state = api.ROLLOUT_JOB_STATE_CANCELLED
            job.error = ""
            await self.jobs.put(job)
        await self._delete_leftovers(job_id)
        self._notify(job_id)
        return job

    async def stream(
        self, job_id: str, start_index: int
    ) -> AsyncIterator[api.StreamGroupsResponse]:
        if start_index < 0:
            raise _invalid(f"start_index must not be negative, got {start_index}")
        job = await self.get(job_id)
        if job.ended and start_index > job.groups_emitted:
            raise OrchardError(
                RolloutReason.GROUPS_PAST_END,
                f"start_index {start_index} is past the end of job {job_id}: it emitted "
                f"{job.groups_emitted} groups",
            )
        next_index = start_index
        while True:
            changed = self.changed(job_id)
            job = await self.get(job_id)
            for index, group in await self.jobs.groups(job_id, next_index):
                yield api.StreamGroupsResponse(index=index, group=group)
                next_index = index + 1
            if job.ended and next_index >= job.groups_emitted:
                return
            # A job of another process (or one resumed later) is polled; ours notify.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):
                    await changed.wait()

    async def close(self) -> None:
        """Stops the jobs of this process without ending them (a restart resumes them) and the
        policies."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._lease is not None:
            # The jobs' owner keys go with it: the next process adopts them at once.
            with contextlib.suppress(Exception):
                await self.jobs.store.revoke_lease(self._lease)
            self._lease = None
        for policy in self._policies.values():
            await policy.close()
        self._policies.clear()
        for shared in self._job_policies.values():
            await shared.policy.close()
        self._job_policies.clear()


class _Discard(list):  # type: ignore[type-arg]
    """A records list that keeps nothing."""

    def append(self, item: object) -> None:
        return None


class RolloutServicer(rollout_service_pb2_grpc.RolloutServiceServicer):
    """The RPC handlers; `attach` gives them the manager once the server started."""

    def __init__(self) -> None:
        self._manager: RolloutManager | None = None

    def attach(self, manager: RolloutManager | None) -> None:
        self._manager = manager

    @property
    def manager(self) -> RolloutManager:
        if self._manager is None:
            raise OrchardError(Reason.UNAVAILABLE, "the rollout service is starting or stopping")
        return self._manager

    async def CreateRolloutJob(
        self, request: api.CreateRolloutJobRequest, context: grpc.aio.ServicerContext
    ) -> api.CreateRolloutJobResponse:
        job = await self.manager.create(request.spec, request.request_id)
        return api.CreateRolloutJobResponse(job=job.to_proto())

    async def GetRolloutJob(
        self, request: api.GetRolloutJobRequest, context: grpc.aio.ServicerContext
    ) -> api.GetRolloutJobResponse:
        job = await self.manager.get(request.job_id)
        return api.GetRolloutJobResponse(job=job.to_proto())

    async def CancelRolloutJob(
        self, request: api.CancelRolloutJobRequest, context: grpc.aio.ServicerContext
    ) -> api.CancelRolloutJobResponse:
        job = await self.manager.cancel(request.job_id)
        return api.CancelRolloutJobResponse(job=job.to_proto())

    async def StreamGroups(
        self, request: api.StreamGroupsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api.StreamGroupsResponse]:
        async for message in self.manager.stream(request.job_id, request.start_index):
            yield message

    async def ListRolloutJobs(
        self, request: api.ListRolloutJobsRequest, context: grpc.aio.ServicerContext
    ) -> api.ListRolloutJobsResponse:
        if not 0 <= request.page_size <= MAX_PAGE:
            raise _invalid(f"page_size must lie in [0, {MAX_PAGE}], got {request.page_size}")
        size = request.page_size or 100
        try:
            offset = int(request.page_token or "0")
        except ValueError:
            raise _invalid(
                f"page_token {request.page_token!r} is not one this service gave"
            ) from None
        jobs = await self.manager.jobs.all()
        page = jobs[offset : offset + size]
        more = offset + size < len(jobs)
        return api.ListRolloutJobsResponse(
            jobs=[j.to_proto() for j in page], next_page_token=str(offset + size) if more else ""
        )
