"""The engine pool: the policies jobs run with, started on first use and shared.

A configured policy (``policies`` in the configuration) starts on the first job that names it
and stays for the process's life. A policy a job brings (`RolloutJobSpec.policy_spec`) is
reference counted: registry weights run on an engine (`job_policies.engine`: local or vllm) that
every running job with the same key (model, version, sampling settings) shares, closed when the
last of them ends, and at most `job_policies.max_engines` of them run at once (a job needing
another waits); an endpoint or a script is the job's own, closed when it ends (a script runs
as an engine behind a capture proxy of the job's own).

Every engine, whatever its type, is started the same way (`create_engine`, then `start`) and
sits behind a capture proxy of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchard.rollout.config import PolicyConfig, RolloutConfig
from orchard.rollout.harnesses.tool_loop import ModelEndpoint
from orchard.rollout.metrics import RolloutMetrics
from orchard.rollout.runner import CaptureSource, ProxyCapture
from orchard.rollout.scripted_policy import script_from_proto
from orchard.rollout.v1 import rollout_service_pb2 as api

if TYPE_CHECKING:
    from orchard.lm.weights import WeightRegistry
    from orchard.rollout.engines.base import InferenceEngine
    from orchard.rollout.proxy.server import CaptureProxy
    from orchard.rollout.service import JobPolicyKey

__all__ = ["EnginePool", "StartedPolicy", "check_engines"]

log = logging.getLogger(__name__)


def check_engines(config: RolloutConfig) -> None:
    """Raise `ConfigError` naming every configured engine that cannot run in this environment
    (vLLM not installed) and how to install it; loads no engine."""
    from orchard.core.config import ConfigError  # noqa: PLC0415
    from orchard.rollout.engines import check_engine_available  # noqa: PLC0415
    from orchard.rollout.engines.base import EngineUnavailable  # noqa: PLC0415

    engines = {
        f"policies.{name}.engine": policy.engine
        for name, policy in config.policies.items()
        if policy.kind != "openai"
    }
    if config.job_policies.allow:
        engines["job_policies.engine"] = config.job_policies.engine
    problems = []
    for where, engine in engines.items():
        try:
            check_engine_available(engine)
        except EngineUnavailable as e:
            problems.append(f"{where}: {e}")
    if problems:
        raise ConfigError(problems)


@dataclass
class StartedPolicy:
    """A started policy: where harnesses send calls, and the capture source when captured."""

    endpoint: ModelEndpoint
    capture: CaptureSource | None = None
    engine: InferenceEngine | None = None
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

    policy: StartedPolicy
    users: int = 0


class EnginePool:
    """The policies of this process's jobs."""

    def __init__(
        self,
        config: RolloutConfig,
        metrics: RolloutMetrics,
        registry: WeightRegistry | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.registry = registry
        self._policies: dict[str, StartedPolicy] = {}
        self._policy_lock = asyncio.Lock()
        self._job_policies: dict[JobPolicyKey, _Shared] = {}
        self._job_policies_changed = asyncio.Condition()

    async def acquire(self, key: JobPolicyKey) -> StartedPolicy:
        """The policy a job brought: shared registry weights (waiting for a free engine), or
        the job's own endpoint or script. Give it back with `release`."""
        if key.pooled:
            return await self._acquire_shared(key)
        return await self.start_job_policy(key)

    async def release(self, key: JobPolicyKey, policy: StartedPolicy) -> None:
        """The job that acquired `policy` ended: the last user of a shared engine closes it."""
        if key.pooled:
            await self._release_shared(key)
        else:
            await policy.close()

    async def close(self) -> None:
        """Closes every policy (the process stops)."""
        for policy in self._policies.values():
            await policy.close()
        self._policies.clear()
        for shared in self._job_policies.values():
            await shared.policy.close()
        self._job_policies.clear()

    async def policy(self, name: str) -> StartedPolicy:
        async with self._policy_lock:
            started = self._policies.get(name)
            if started is not None:
                return started
            policy = self.config.policies[name]
            started = await self.start_policy(name, policy)
            self._policies[name] = started
            return started

    async def _acquire_shared(self, key: JobPolicyKey) -> StartedPolicy:
        """The engine of `key`, started when no running job uses it; waits while
        `job_policies.max_engines` others run. Give it back with `_release_shared`."""
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
                shared = _Shared(await self.start_job_policy(key))
                self._job_policies[key] = shared
                self.metrics.job_engines.inc()
            shared.users += 1
            return shared.policy

    async def _release_shared(self, key: JobPolicyKey) -> None:
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

    async def start_job_policy(self, key: JobPolicyKey) -> StartedPolicy:
        """A job's script on a loopback server of its own; its endpoint; or its registry
        weights on the engine `job_policies.engine` configures: the pinned version's folder, or
        the model's latest version, followed."""
        if key.script:
            return await self._start_scripted(key)
        if key.relay:
            return await self._start_relay(key)
        if key.base_url:
            return await self.start_policy(key.name, key.as_config())
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
        return await self.start_policy(key.name, key.as_config(template.model_copy(update=update)))

    async def _start_scripted(self, key: JobPolicyKey) -> StartedPolicy:
        """The job's script as an engine (`ScriptedEngine`, the built-in tokenizer) behind a
        capture proxy of its own, like any model: harnesses of every dialect reach it where
        sandboxes reach the proxy, and its turns are captured in tokens, so a teacher's
        rollouts rebuild into trajectories as a student's do."""
        from orchard.lm.tokenizer import build_tokenizer  # noqa: PLC0415 - loads transformers
        from orchard.rollout.engines.scripted import ScriptedEngine  # noqa: PLC0415

        message = api.ScriptedPolicy.FromString(key.script)
        seed = message.seed if message.HasField("seed") else None
        script = script_from_proto(message)
        engine = ScriptedEngine(script, build_tokenizer(), seed=seed)
        parts = [f"{len(script.plans)} plans"] if script.plans else []
        if script.gui_teacher is not None:
            parts.insert(0, f"GUI teacher over {script.gui_teacher.count} tasks")
        return await self._behind_proxy(
            key.name, engine, key.as_config(), f"scripted, {', '.join(parts)}"
        )

    async def _start_relay(self, key: JobPolicyKey) -> StartedPolicy:
        """The job's endpoint through a capture proxy of its own (`RelayEngine`, the built-in
        tokenizer): agent programs of every dialect reach the proxy, the endpoint is asked in
        chat completions, and the calls are captured as a scripted teacher's are."""
        from orchard.lm.tokenizer import build_tokenizer  # noqa: PLC0415 - loads transformers
        from orchard.rollout.engines.relay import RelayEngine  # noqa: PLC0415

        policy = key.as_config()
        assert policy.base_url is not None  # an endpoint key
        engine = RelayEngine(
            base_url=policy.base_url,
            model=policy.model,
            api_key=policy.api_key(),
            tokenizer=build_tokenizer(),
            temperature=policy.temperature,
        )
        await engine.start()
        return await self._behind_proxy(key.name, engine, policy, f"relay to {policy.base_url}")

    async def _behind_proxy(
        self, name: str, engine: InferenceEngine, policy: PolicyConfig, what: str
    ) -> StartedPolicy:
        """`engine` (started) behind a capture proxy of its own, which bounds every call by the
        policy's tokens per call (agent programs ask for what they like); the engine is closed
        when the proxy cannot start."""
        from orchard.rollout.proxy.server import CaptureProxy  # noqa: PLC0415

        proxy_config = self.config.proxy.model_copy(
            update={"max_tokens_cap": policy.max_tokens_per_call, "sampling_seed": policy.seed}
        )
        proxy = CaptureProxy(engine, proxy_config)
        try:
            await proxy.start()
        except BaseException:
            await engine.close()
            raise
        log.info("policy %s: %s, behind %s", name, what, proxy.url)
        return StartedPolicy(
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

    async def start_policy(self, name: str, policy: PolicyConfig) -> StartedPolicy:
        """Start `policy` as its kind says: ``openai`` is the endpoint itself (not captured);
        ``local`` and ``vllm`` start that engine (`create_engine`) behind a capture proxy of
        its own, following the registry's versions of `engine.registry_model`."""
        if policy.kind == "openai":
            return StartedPolicy(
                ModelEndpoint(
                    base_url=policy.base_url,
                    model=policy.model,
                    api_key=policy.api_key(),
                    temperature=policy.temperature,
                    max_tokens_per_call=policy.max_tokens_per_call,
                )
            )
        from orchard.rollout.engines import create_engine  # noqa: PLC0415 - loads torch or vLLM

        registry = self.registry
        if registry is not None:
            registry = registry.for_model(policy.engine.registry_model)
        engine = create_engine(policy.engine, registry=registry)
        await engine.start()
        return await self._behind_proxy(
            name, engine, policy, f"{policy.kind} engine {engine.weight_version}"
        )
