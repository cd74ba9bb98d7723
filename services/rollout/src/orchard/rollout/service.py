"""``orchard.rollout.v1.RolloutService``: rollout jobs started, watched, streamed and cancelled.

The RPC handlers, spec validation and the wiring of the service's parts: the job store
(:mod:`orchard.rollout.job_store`), the scheduler that decides which replica runs which job
(:mod:`orchard.rollout.scheduler`), the engine pool of the policies jobs run with
(:mod:`orchard.rollout.engine_pool`) and group streaming (:mod:`orchard.rollout.streams`), all
fed by the process's etcd watch (:mod:`orchard.rollout.job_events`). `RolloutManager` joins
them with the environment service client and the scorer; each job runs as one asyncio task
(:class:`orchard.rollout.runs.JobRun`) in the replica that claimed it.

Bad input is INVALID_ARGUMENT with what to fix; a job that needs something this service was not
configured with (a reward service, an artifact store for GUI trails) is FAILED_PRECONDITION.
Both are raised as `OrchardError` and turned into a status by the server's error interceptor.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import urllib.parse
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from orchard.core.errors import OrchardError, Reason
from orchard.core.etcd import LeaseNotFound
from orchard.core.success import DEFAULT_SUCCESS_THRESHOLD
from orchard.lm.weights import InvalidWeightVersion, check_model_name
from orchard.rollout.batches import GroupFilter
from orchard.rollout.budgets import LayeredRetries, RolloutBudget
from orchard.rollout.config import ENV_NAME, PolicyConfig, RolloutConfig
from orchard.rollout.engine_pool import EnginePool, StartedPolicy
from orchard.rollout.engines.config import EngineConfig, LocalEngineConfig
from orchard.rollout.errors import RolloutReason, find_job
from orchard.rollout.harnesses.bash_react import (
    bash_react_harness,
    generic_tool_harness,
    shell_harness,
)
from orchard.rollout.harnesses.browser import BrowserHarness, browser_harnesses
from orchard.rollout.harnesses.kinds import Harness
from orchard.rollout.harnesses.program_registry import program_harnesses
from orchard.rollout.harnesses.sandboxed import SandboxedProgramHarness
from orchard.rollout.harnesses.tool_loop import ToolCallingHarness
from orchard.rollout.job_events import JobEvents
from orchard.rollout.job_store import BadPageToken, decode_page_token, encode_page_token
from orchard.rollout.metrics import RolloutMetrics
from orchard.rollout.results import GroupKey, RunRollout
from orchard.rollout.runner import RolloutRunner
from orchard.rollout.runs import JobCancelled, JobRun, JobState, JobStore, new_job_id
from orchard.rollout.samplers import (
    BalancedAdaptiveSampler,
    FixedNSampler,
    MemberChoice,
    Sampler,
    StopRule,
    check_success_threshold,
)
from orchard.rollout.scheduler import JobScheduler, Work
from orchard.rollout.scoring import LocalScorer, TaskScorer
from orchard.rollout.scripted_policy import script_from_proto
from orchard.rollout.streams import GroupStreams
from orchard.rollout.task_files import FileSource
from orchard.rollout.tasks import CommandCheck, TaskSpec
from orchard.rollout.trails import TrailWriter
from orchard.rollout.v1 import rollout_service_pb2 as api
from orchard.rollout.v1 import rollout_service_pb2_grpc
from orchard.rollout.workers import RolloutWorkers, RunnerSpec
from orchard.sdk import AsyncSandboxClient
from orchard.sdk import errors as sdk_errors
from orchard.tasks.gui.suite import task_by_id as gui_task_by_id
from orchard.tasks.spec import GuiCheck

if TYPE_CHECKING:
    from orchard.core.artifacts import ArtifactStore
    from orchard.lm.weights import WeightRegistry

__all__ = ["JOB_LABEL", "RolloutManager", "RolloutReason", "RolloutServicer", "validate_spec"]

log = logging.getLogger(__name__)

JOB_LABEL = "orchard-rollout-job"
"""Label on every sandbox of a job (its id): a resumed job deletes what its last run left."""
TASK_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_:.-]*(/[A-Za-z0-9][A-Za-z0-9_:.-]*)*$")
"""A task id: segments of letters, digits, '_', ':', '.' and '-' joined by '/' (a Claw task's
``claw/<seed>/<family>/<n>``), each starting with a letter or digit, so no segment is empty,
'.' or '..'. Rollout ids (capture session paths) replace what they cannot hold."""
TASK_ID_MAX = 200
MAX_PAGE = 1000


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
    keep_gui_trails: bool = False
    """Write each GUI episode's screenshot trail to the artifact store (`TrailWriter`)."""

    @property
    def pairs(self) -> list[GroupKey]:
        return [GroupKey(t, h) for t in self.tasks for h in self.harnesses]


@dataclass(frozen=True, slots=True)
class JobPolicyKey:
    """A policy a job brought: registry weights (jobs with equal keys share one engine), an
    endpoint (`base_url` set; nothing to start) or a script (`script` set; played by this
    service on a loopback server of the job's own)."""

    model: str
    version: str
    """Empty: the latest version, following new publications."""
    temperature: float
    max_tokens_per_call: int
    base_url: str = ""
    api_key_env: str = ""
    script: bytes = b""
    """A serialized `ScriptedPolicy`, checked by `_job_policy`."""
    relay: bool = False
    """An endpoint the job's agent programs reach through a capture proxy of the job's own
    (`RelayEngine`): they speak their own dialects, the endpoint chat completions, and their
    calls are captured. Set when the job runs a program harness."""
    seed: int | None = None
    """Seed of the draws of each rollout's calls (`PolicySpec.seed`, a script's own seed)."""

    @property
    def name(self) -> str:
        if self.script:
            return f"{self.model} (scripted)"
        if self.base_url:
            return f"{self.model} at {self.base_url}"
        return f"{self.model}@{self.version or 'latest'}"

    @property
    def pooled(self) -> bool:
        """Registry weights run on an engine that jobs with the same key share."""
        return not self.base_url and not self.script

    def as_config(self, engine: EngineConfig | None = None) -> PolicyConfig:
        """The policy as if configured: an endpoint (kind openai), or an engine (local or vllm,
        by `engine.type`) with `engine`'s settings (its weights resolved by the caller)."""
        if self.base_url:
            return PolicyConfig(
                kind="openai",
                base_url=self.base_url,
                model=self.model,
                api_key_env=self.api_key_env,
                temperature=self.temperature,
                max_tokens_per_call=self.max_tokens_per_call,
            )
        engine = engine or LocalEngineConfig()
        return PolicyConfig(
            kind=engine.type,
            engine=engine,
            model=self.model,
            temperature=self.temperature,
            max_tokens_per_call=self.max_tokens_per_call,
            seed=self.seed,
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
    if spec.HasField("seed") and source != "weights":
        raise _invalid(
            "spec.policy_spec.seed seeds the sampling of registry weights; a scripted policy "
            "draws with spec.policy_spec.scripted.seed, and an endpoint samples on its own"
        )
    if source == "scripted":
        return _scripted_policy(spec.scripted, config, temperature, max_tokens)
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
            "spec.policy_spec needs weights ({model, version} in the weight registry), an "
            "endpoint ({base_url, model}) or a scripted policy ({plans})"
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
        seed=spec.seed if spec.HasField("seed") else None,
    )


def _scripted_policy(
    script: api.ScriptedPolicy, config: RolloutConfig, temperature: float, max_tokens: int
) -> JobPolicyKey:
    """A job's script, bounded and checked whole here so a bad one never starts a job."""
    size, bound = script.ByteSize(), config.job_policies.max_script_bytes
    if size > bound:
        raise _invalid(
            f"spec.policy_spec.scripted is {size} bytes, more than this service takes ({bound}, "
            "job_policies.max_script_bytes): give plans only for the job's tasks"
        )
    try:
        parsed = script_from_proto(script)
    except ValueError as exc:
        raise _invalid(f"spec.policy_spec.scripted.{exc}") from None
    return JobPolicyKey(
        model=parsed.model,
        version="",
        temperature=temperature,
        max_tokens_per_call=max_tokens,
        script=script.SerializeToString(deterministic=True),
        seed=script.seed if script.HasField("seed") else None,
    )


_STOP_RULES = {
    api.BAR_STOP_RULE_UNSPECIFIED: StopRule.MIXED,
    api.BAR_STOP_RULE_MIXED: StopRule.MIXED,
    api.BAR_STOP_RULE_BAND: StopRule.BAND,
}
_MEMBER_CHOICES = {
    api.BAR_MEMBER_CHOICE_UNSPECIFIED: MemberChoice.RANDOM,
    api.BAR_MEMBER_CHOICE_RANDOM: MemberChoice.RANDOM,
    api.BAR_MEMBER_CHOICE_RANKED: MemberChoice.RANKED,
}


def _sampler(config: api.SamplerConfig) -> Sampler:
    """The sampler a job's settings name; unset fields take the defaults the proto states."""
    try:
        # Unset (a client from before the field was tracked): the shared default.
        threshold = check_success_threshold(
            config.positive_threshold
            if config.HasField("positive_threshold")
            else DEFAULT_SUCCESS_THRESHOLD
        )
        if config.kind == api.SAMPLER_KIND_FIXED_N:
            if config.group_size == 1 and not config.keep_uninformative_groups:
                raise ValueError(
                    "group_size must be at least 2, got 1: a group of one rollout carries no "
                    "signal for training (an evaluation job sets keep_uninformative_groups)"
                )
            return FixedNSampler(group_size=config.group_size or 8, positive_threshold=threshold)
        if config.kind in (api.SAMPLER_KIND_BAR, api.SAMPLER_KIND_UNSPECIFIED):
            group_size = config.group_size or 8
            if config.stop_rule not in _STOP_RULES:
                raise ValueError(f"stop_rule {config.stop_rule} is not MIXED or BAND")
            if config.member_choice not in _MEMBER_CHOICES:
                raise ValueError(f"member_choice {config.member_choice} is not RANDOM or RANKED")
            return BalancedAdaptiveSampler(
                group_size=group_size,
                max_rollouts=config.max_rollouts or max(16, group_size),
                stride=config.stride or group_size,
                rho_min=config.rho_min if config.rho_min or config.rho_max else 0.375,
                rho_max=config.rho_max or 0.625,
                positive_threshold=threshold,
                stop_rule=_STOP_RULES[config.stop_rule],
                member_choice=_MEMBER_CHOICES[config.member_choice],
                seed=config.seed if config.HasField("seed") else None,
            )
    except ValueError as exc:
        raise _invalid(f"spec.sampler: {exc}") from None
    raise _invalid(f"spec.sampler.kind {config.kind} is not a known sampler (FIXED_N or BAR)")


def validate_spec(
    spec: api.RolloutJobSpec,
    config: RolloutConfig,
    harnesses: Mapping[str, Harness],
) -> ValidSpec:
    """Raises OrchardError (INVALID_ARGUMENT, FAILED_PRECONDITION) saying what to fix."""
    if not spec.tasks:
        raise _invalid("spec.tasks is empty: give at least one task to roll out")
    tasks: dict[str, TaskSpec] = {}
    for i, task in enumerate(spec.tasks):
        if len(task.id) > TASK_ID_MAX or not TASK_ID.match(task.id):
            raise _invalid(
                f"spec.tasks[{i}].id {task.id!r} must be 1-{TASK_ID_MAX} letters, digits, '_', "
                "':', '.' or '-', in segments joined by '/' that each start with a letter or digit"
            )
        if task.id in tasks:
            raise _invalid(f"spec.tasks[{i}].id {task.id!r} appears twice; task ids are unique")
        try:
            tasks[task.id] = TaskSpec.from_proto(task)
        except ValueError as exc:
            raise _invalid(f"spec.tasks[{i}]: {exc}") from None
        if tasks[task.id].files:
            # A task archive outside the store would make this service read its own host's
            # files into a sandbox: refused here with the store's status and reason.
            store = config.artifacts.store()
            for item in tasks[task.id].files:
                store.check(item.url, what=f"spec.tasks[{i}] files URL")
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
    _check_gui_pairs(tasks, spec.harnesses, harnesses)
    job_policy = None
    if spec.HasField("policy_spec"):
        if spec.policy:
            raise _invalid("spec names a policy and brings a policy_spec: give one of them")
        job_policy = _job_policy(spec.policy_spec, config)
        if job_policy.base_url and any(
            isinstance(harnesses[name], SandboxedProgramHarness) for name in spec.harnesses
        ):
            job_policy = dataclasses.replace(job_policy, relay=True)
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
        keep_gui_trails=spec.keep_gui_trails,
    )


@dataclass
class RolloutManager:
    """Jobs of this process, and what they run with."""

    config: RolloutConfig
    jobs: JobStore
    sandboxes: AsyncSandboxClient
    scorer: TaskScorer = field(default_factory=LocalScorer)
    metrics: RolloutMetrics = field(default_factory=lambda: RolloutMetrics(None))
    registry: WeightRegistry | None = None
    harnesses: dict[str, Harness] = field(default_factory=dict)
    files: FileSource | None = None
    """Where task archives are read from (the artifact store)."""
    trails: ArtifactStore | None = None
    """Where GUI trails are written (the artifact store); None: jobs that ask to keep them are
    refused."""
    workers: RolloutWorkers | None = None
    """Where rollouts run when not in this event loop (Ray actors)."""
    engines: EnginePool = field(init=False)
    _create_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    lease_ttl_s: int = 10
    _events: JobEvents | None = None
    _scheduler: JobScheduler | None = None
    _streams: GroupStreams | None = None

    def __post_init__(self) -> None:
        if not self.harnesses:
            self.harnesses = {
                **builtin_harnesses(self.config.defaults.command_timeout_s),
                **browser_harnesses(self.config.gui),
                **program_harnesses(self.config.harnesses),
            }
        self.engines = EnginePool(self.config, self.metrics, self.registry)

    async def open(self) -> None:
        """Starts the job watch, then the scheduler: a lease for the jobs this process will
        own, the jobs no live process owns (a restart's) adopted, and from then on the
        claims, cancels and groups of every replica followed as etcd reports them."""
        jobs_config = self.config.jobs
        self._events = JobEvents(self.jobs.store, self.metrics)
        await self._events.start()
        self._streams = GroupStreams(
            self.jobs, self._events, recheck_s=jobs_config.recheck_interval_s
        )
        self._scheduler = JobScheduler(
            self.jobs,
            self._events,
            self,
            self.metrics,
            lease_ttl_s=self.lease_ttl_s,
            recheck_s=jobs_config.recheck_interval_s,
            retention_s=jobs_config.retention_s,
            sweep_interval_s=jobs_config.sweep_interval_s,
        )
        await self._scheduler.open()

    @property
    def scheduler(self) -> JobScheduler:
        if self._scheduler is None:
            raise RuntimeError("open() the manager first")
        return self._scheduler

    @property
    def streams(self) -> GroupStreams:
        if self._streams is None:
            raise RuntimeError("open() the manager first")
        return self._streams

    # -- policies ------------------------------------------------------------------------

    async def _check_job_policy(self, key: JobPolicyKey) -> None:
        """Raises OrchardError when the job's weights cannot be loaded here (or, for an
        endpoint, when its API key variable is unset here); a script needs nothing more."""
        if key.script:
            return
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

    # -- jobs ----------------------------------------------------------------------------

    def _notify(self, job_id: str) -> None:
        """Wakes this process's streams of the job now (the watch tells them a moment later)."""
        if self._events is not None:
            self._events.wake(job_id)

    async def create(self, spec: api.RolloutJobSpec, request_id: str) -> JobState:
        valid = validate_spec(spec, self.config, self.harnesses)
        if valid.keep_gui_trails and self.trails is None:
            raise OrchardError(
                Reason.FAILED_PRECONDITION,
                "spec.keep_gui_trails asks for the screenshot trails of GUI episodes and this "
                "rollout service has no artifact store to write them to: run it with "
                "artifacts.root set (orchard-rollout opens the store it names; an embedded "
                "RolloutManager needs trails=ArtifactStore(...)), or leave keep_gui_trails off",
            )
        if valid.job_policy is not None:
            await self._check_job_policy(valid.job_policy)
        async with self._create_lock:
            job = JobState(
                id=new_job_id(),
                spec=spec,
                request_id=request_id,
                pairs_total=len(valid.pairs),
            )
            scheduler = self.scheduler
            lease = scheduler.lease_id
            try:
                stored = await self.jobs.create(job, owner=scheduler.owner, lease=lease)
            except LeaseNotFound:
                # This replica's lease ran out before its keep-alive noticed: a new one, once.
                await scheduler.renew_lease(lease)
                stored = await self.jobs.create(
                    job, owner=scheduler.owner, lease=scheduler.lease_id
                )
            if stored.id == job.id:
                scheduler.start(job.id, self._run(job, valid))
            return stored

    async def _run(self, job: JobState, valid: ValidSpec) -> None:
        """The scheduler's work for a job: its policy from the engine pool, then its run."""
        key = valid.job_policy
        try:
            if key is None:
                policy = await self.engines.policy(valid.policy)
            else:
                policy = await self.engines.acquire(key)
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
            if key is not None:
                await self.engines.release(key, policy)

    async def _run_with(self, job: JobState, valid: ValidSpec, policy: StartedPolicy) -> None:
        retries = LayeredRetries(create_spread_s=self.config.defaults.create_spread_s)
        if self.workers is not None:
            # The same rollouts on the worker pool: it gets plain data, the capture stays here.
            spec = RunnerSpec(
                endpoint=policy.endpoint,
                harnesses=self.harnesses,
                tasks=valid.tasks,
                budget=valid.budget,
                retries=retries,
                labels={JOB_LABEL: job.id},
                trails_job_id=job.id if valid.keep_gui_trails else "",
            )
            rollouts = self.workers.job(
                job.id, spec, capture=policy.capture, sandboxes=self.sandboxes
            )
            async with rollouts as run_rollout:
                await self._job_run(job, valid, run_rollout).run()
            return
        runner = RolloutRunner(
            sandboxes=self.sandboxes,
            endpoint=policy.endpoint,
            harnesses=self.harnesses,
            tasks=valid.tasks,
            budget=valid.budget,
            retries=retries,
            capture=policy.capture,
            scorer=self.scorer,
            labels={JOB_LABEL: job.id},
            files=self.files,
            keep_records=False,  # the groups carry the records
            trails=(
                TrailWriter(self.trails, job.id)
                if valid.keep_gui_trails and self.trails is not None
                else None
            ),
        )
        await self._job_run(job, valid, runner).run()

    def _job_run(self, job: JobState, valid: ValidSpec, run_rollout: RunRollout) -> JobRun:
        return JobRun(
            job=job,
            jobs=self.jobs,
            sampler=valid.sampler,
            pairs=valid.pairs,
            run_rollout=run_rollout,
            concurrency=valid.concurrency,
            metrics=self.metrics,
            group_filter=valid.group_filter,
            on_change=lambda: self._notify(job.id),
            worker_attempts=self.config.workers.rollout_attempts,
        )

    async def resume(self, job: JobState) -> Work | None:
        """A job the scheduler adopted from a process that is gone: the sandboxes its last run
        left deleted, then resumed here, or marked FAILED when it cannot resume."""
        await self._delete_leftovers(job.id)
        try:
            if not self.config.resume_running_jobs:
                job.state = api.ROLLOUT_JOB_STATE_FAILED
                job.error = "the rollout service restarted while the job ran (resume is off)"
                await self.jobs.put_running(job)
                return None
            try:
                valid = validate_spec(job.spec, self.config, self.harnesses)
            except OrchardError as exc:
                job.state = api.ROLLOUT_JOB_STATE_FAILED
                job.error = f"cannot resume under this configuration: {exc.message}"
                await self.jobs.put_running(job)
                return None
            job.resumes += 1
            await self.jobs.put_running(job)
        except JobCancelled:
            return None  # cancelled meanwhile: the cancel stands
        log.info(
            "resuming job %s: %d of %d pairs done, %d groups emitted",
            job.id,
            len(job.pairs_done),
            job.pairs_total,
            job.groups_emitted,
        )
        return self._run(job, valid)

    async def _delete_leftovers(self, job_id: str) -> None:
        try:
            async for info in self.sandboxes.list({JOB_LABEL: job_id}):
                with contextlib.suppress(sdk_errors.OrchardSDKError):
                    await self.sandboxes.delete(info.id)
        except sdk_errors.OrchardSDKError as exc:
            log.warning("job %s: sandboxes of its last run not listed: %s", job_id, exc)

    async def get(self, job_id: str) -> JobState:
        """The job; NOT_FOUND (saying so when the retention removed it) otherwise."""
        return await find_job(self.jobs, job_id)

    async def cancel(self, job_id: str) -> JobState:
        job = await self.get(job_id)
        if job.ended:
            return job
        # First the mark: from now on no runner (here or on another replica) writes the job.
        await self.jobs.mark_cancelled(job_id)
        await self.scheduler.stop(job_id)
        job = await self.get(job_id)
        if not job.ended:
            # Another replica's job: it sees the state and stops its rollouts.
            job.state = api.ROLLOUT_JOB_STATE_CANCELLED
            job.error = ""
            await self.jobs.put(job)
        await self._delete_leftovers(job_id)
        self._notify(job_id)
        return job

    def stream(self, job_id: str, start_index: int) -> AsyncIterator[api.StreamGroupsResponse]:
        return self.streams.stream(job_id, start_index)

    async def list(self, page_size: int, page_token: str) -> tuple[list[JobState], str]:
        """One page of jobs, newest first, by key: jobs created or removed meanwhile never
        shift a page. INVALID_ARGUMENT for a token this service did not give."""
        if not 0 <= page_size <= MAX_PAGE:
            raise _invalid(f"page_size must lie in [0, {MAX_PAGE}], got {page_size}")
        try:
            after = decode_page_token(page_token) if page_token else None
        except BadPageToken:
            raise _invalid(
                f"page_token {page_token!r} is not one this service gave: pass a previous "
                "response's next_page_token, or none for the first page"
            ) from None
        jobs, last = await self.jobs.page(page_size or 100, after)
        return jobs, encode_page_token(last) if last is not None else ""

    async def close(self) -> None:
        """Stops the jobs of this process without ending them (a restart resumes them) and the
        policies. Its claims go with its lease: the next process adopts the jobs at once."""
        if self._scheduler is not None:
            await self._scheduler.close()
        if self._events is not None:
            await self._events.close()
        await self.engines.close()


def _check_gui_pairs(
    tasks: Mapping[str, TaskSpec], names: Sequence[str], harnesses: Mapping[str, Harness]
) -> None:
    """Every task runs with every harness of a job: GUI tasks only with browser harnesses,
    and browser harnesses only on GUI tasks."""
    checks = {t.id: t.check for t in tasks.values() if isinstance(t.check, GuiCheck)}
    for task_id, check in checks.items():
        try:
            gui_task_by_id(check.task_id)
        except ValueError as exc:
            raise _invalid(f"task {task_id!r}: {exc}") from None
    gui = sorted(checks)
    browsers = [n for n in names if isinstance(harnesses[n], BrowserHarness)]
    if gui and len(browsers) != len(names):
        others = ", ".join(n for n in names if n not in browsers)
        offered = ", ".join(n for n, h in harnesses.items() if isinstance(h, BrowserHarness))
        raise _invalid(
            f"task {gui[0]!r} is a GUI task and runs with browser harnesses only, not {others} "
            f"(this service offers {offered or 'none: set gui.image or gui.browser_dir'})"
        )
    if browsers and len(gui) != len(tasks):
        plain = next(t for t in tasks if t not in gui)
        raise _invalid(
            f'{browsers[0]} drives browser episodes of GUI tasks (scorer_json "gui"), and '
            f"task {plain!r} is not one"
        )


def harness_proto(harness: Harness) -> api.Harness:
    """A harness as ListHarnesses describes it: what its model sees, in OpenAI tool JSON."""
    return api.Harness(
        name=harness.name,
        description=harness.description,
        tools_json=json.dumps([tool.schema() for tool in harness.tools], sort_keys=True),
        system_prompt=harness.system_prompt,
    )


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
        jobs, token = await self.manager.list(request.page_size, request.page_token)
        return api.ListRolloutJobsResponse(jobs=[j.to_proto() for j in jobs], next_page_token=token)

    async def ListHarnesses(
        self, request: api.ListHarnessesRequest, context: grpc.aio.ServicerContext
    ) -> api.ListHarnessesResponse:
        harnesses = self.manager.harnesses
        return api.ListHarnessesResponse(
            harnesses=[harness_proto(harnesses[name]) for name in sorted(harnesses)]
        )
