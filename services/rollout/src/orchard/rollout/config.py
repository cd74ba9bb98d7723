"""Configuration of ``orchard-rollout``: one frozen pydantic model, validated at start.

Layers (lowest first): defaults, a YAML file (``--config`` or ``$ORCHARD_ROLLOUT_CONFIG``),
``ORCHARD_ROLLOUT_*`` variables, ``--set key=value``, flags. Secrets never sit in the file: the
environment service's token and a policy endpoint's API key are read from environment
variables whose names the configuration gives.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from orchard.core.artifacts import ArtifactsConfig
from orchard.core.config import ConfigModel, ServerConfig, ServiceConfig
from orchard.rollout.engines.config import ENGINE_TYPES, EngineConfig, LocalEngineConfig
from orchard.rollout.harnesses.builtin_programs import BUILTIN_PROGRAMS
from orchard.rollout.proxy.server import CaptureProxyConfig
from orchard.rollout.workers import WorkersConfig
from orchard.sdk.service_config import EnvClientConfig
from orchard.tasks.gui.browser_dir import IMAGE_BROWSER_DIR

__all__ = [
    "ENV_NAME",
    "EnvServiceConfig",
    "EtcdConfig",
    "GuiConfig",
    "HarnessesConfig",
    "JobPoliciesConfig",
    "JobsConfig",
    "PolicyConfig",
    "ProgramFileConfig",
    "ProgramHarnessConfig",
    "RewardServiceConfig",
    "RolloutConfig",
    "RunDefaults",
]

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
"""What an environment variable's name may be."""
HOST_IMAGE = "host"
"""The local runtime's image that shows this host's root read-only."""


def _env_name(value: str) -> str:
    if value and not ENV_NAME.match(value):
        raise ValueError(f"expected an environment variable name, got {value!r}")
    return value


class EtcdConfig(ConfigModel):
    """Where job state lives; a restarted service reads it back."""

    endpoints: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:2379"],
        min_length=1,
        description="etcd client URLs.",
    )
    namespace: str = Field(
        default="orchard/rollout/", min_length=1, description="Key prefix of this service."
    )
    weights_namespace: str = Field(
        default="orchard/",
        min_length=1,
        description="Key prefix of the weight registry the local engines follow (the trainer's).",
    )
    timeout_s: float = Field(default=5.0, gt=0, description="Deadline of one etcd call.")


class EnvServiceConfig(EnvClientConfig):
    """The environment service the rollouts' sandboxes run in."""

    endpoint: str = Field(
        default="127.0.0.1:7100",
        min_length=1,
        description="gRPC address of orchard-env (HOST:PORT or unix:PATH).",
    )


class RewardServiceConfig(ConfigModel):
    """The reward service that scores `tests` and `score_task` tasks."""

    endpoint: str | None = Field(
        default=None,
        description="gRPC address of orchard-reward. Unset: only command-check tasks can run "
        "(scored here through the environment service); others are refused at CreateRolloutJob.",
    )
    call_timeout_s: float = Field(
        default=3600.0, gt=0, description="Deadline of one scoring call (tests may take long)."
    )


class PolicyConfig(ConfigModel):
    """A model the harnesses talk to, named by `RolloutJobSpec.policy`.

    ``local``: the local engine (PyTorch on this machine's CPU) behind the capture proxy; every
    call is captured with its exact tokens and weight version, and groups carry trainable turns.
    ``vllm``: the same with vLLM as the engine (GPUs; new versions loaded in place).
    ``openai``: any OpenAI-compatible endpoint (a hosted model, a scripted policy server); calls
    are not captured, so groups carry rewards and outcomes but no turns.
    """

    kind: Literal["local", "vllm", "openai"] = Field(
        default="local", description="local, vllm or openai."
    )
    engine: EngineConfig = Field(
        default_factory=LocalEngineConfig,
        description="The engine's settings (kinds local and vllm; its `type` is the kind).",
    )
    base_url: str = Field(default="", description="API root of the endpoint (kind openai).")
    model: str = Field(default="policy", min_length=1, description="Model name sent in calls.")
    api_key_env: str = Field(
        default="", description="Environment variable holding the API key (kind openai)."
    )
    temperature: float = Field(default=1.0, ge=0, le=2, description="Sampling temperature.")
    max_tokens_per_call: int = Field(default=1024, ge=1, description="Output budget of a call.")
    seed: int | None = Field(
        default=None,
        description="Seed of the token draws (kinds local and vllm): a call that brings no seed "
        "is sampled with one drawn from it, its rollout and its place in the rollout, so the "
        "same rollouts draw the same tokens. None: fresh draws.",
    )

    @field_validator("api_key_env")
    @classmethod
    def _check_key_env(cls, value: str) -> str:
        return _env_name(value)

    @model_validator(mode="before")
    @classmethod
    def _engine_of_kind(cls, data: Any) -> Any:
        # The engine section's type follows the kind, so `kind: vllm` alone selects vLLM.
        if not isinstance(data, dict):
            return data
        kind = data.get("kind", "local")
        engine = data.get("engine")
        if kind not in ENGINE_TYPES or (engine is not None and not isinstance(engine, dict)):
            return data
        engine = dict(engine or {})
        given = engine.setdefault("type", kind)
        if given != kind:
            raise ValueError(
                f"a policy of kind {kind} runs the {kind} engine, but engine.type is {given!r}: "
                "drop engine.type or make it the kind"
            )
        return {**data, "engine": engine}

    @model_validator(mode="after")
    def _endpoint_given(self) -> PolicyConfig:
        if self.kind == "openai" and not self.base_url:
            raise ValueError("a policy of kind openai needs base_url")
        if self.kind == "openai" and "engine" in self.model_fields_set:
            raise ValueError(
                "a policy of kind openai is an external endpoint and runs no engine: remove its "
                "engine section, or use kind local or vllm"
            )
        if self.kind in ENGINE_TYPES and self.engine.type != self.kind:
            raise ValueError(
                f"a policy of kind {self.kind} needs engine.type {self.kind}, not "
                f"{self.engine.type}"
            )
        return self

    def api_key(self, environ: Mapping[str, str] | None = None) -> str:
        environ = os.environ if environ is None else environ
        if not self.api_key_env:
            return "orchard"
        key = environ.get(self.api_key_env, "")
        if not key:
            raise ValueError(
                f"policy {self.model}: the API key variable {self.api_key_env} is unset"
            )
        return key


class JobPoliciesConfig(ConfigModel):
    """Policies a job brings in its spec (`RolloutJobSpec.policy_spec`): a weight version of
    any model in the registry, each on an engine of its own (`engine`) behind a capture proxy,
    started for the jobs that use it and closed when the last of them ends; an endpoint; or a
    script this service plays itself, on a loopback server of its own for the job's length."""

    allow: bool = Field(
        default=True,
        description="Accept jobs with a policy_spec (weights, endpoint or script); false: they "
        "are FAILED_PRECONDITION.",
    )
    max_script_bytes: int = Field(
        default=512 * 1024,
        ge=1024,
        description="Largest scripted policy a job may bring (serialized); the spec is stored "
        "in etcd, whose values are bounded too.",
    )
    max_engines: int = Field(
        default=2,
        ge=1,
        description="Most engines job policies run at once; a job needing another waits until "
        "one closes.",
    )
    engine: EngineConfig = Field(
        default_factory=LocalEngineConfig,
        description="The engine those policies run on (`type` local or vllm) and its settings; "
        "their weights come from the job.",
    )


class JobsConfig(ConfigModel):
    """How long ended jobs stay, and how often replicas look again without an event."""

    retention_s: float = Field(
        default=7 * 86400.0,
        ge=0,
        allow_inf_nan=False,
        description="Seconds an ended job (SUCCEEDED, FAILED, CANCELLED) and its groups stay in "
        "etcd after it ended; then they are removed and GetRolloutJob says so (NOT_FOUND) for "
        "one more retention. 0: kept forever.",
    )
    recheck_interval_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="A safety net under the etcd watch: every this many seconds a replica "
        "reads every job again (orphans to adopt, cancels) and open streams read their groups.",
    )

    @property
    def sweep_interval_s(self) -> float:
        """How often a replica looks for ended jobs past the retention (a tenth of it, within
        [1 s, 10 min])."""
        return min(600.0, max(1.0, self.retention_s / 10))


class RunDefaults(ConfigModel):
    """What a job gets for the fields its spec leaves at 0."""

    concurrency: int = Field(default=8, ge=1, description="Rollouts running at once per job.")
    max_concurrency: int = Field(
        default=256, ge=1, description="Most rollouts at once a job may ask for."
    )
    max_steps: int = Field(default=30, ge=1, description="Model calls per rollout.")
    max_tokens: int = Field(default=32_768, ge=1, description="Sampled tokens per rollout.")
    max_duration_s: float = Field(default=600.0, gt=0, description="Wall clock per rollout.")
    create_spread_s: float = Field(
        default=1.0, ge=0, description="Sandbox creations are spread over up to this many seconds."
    )
    command_timeout_s: float = Field(
        default=60.0, gt=0, description="Time limit of one bash tool call."
    )


class ProgramFileConfig(ConfigModel):
    """A file written into the sandbox before the program starts."""

    path: str = Field(min_length=1, description="Absolute path in the sandbox; placeholders.")
    content: str = Field(description="The file's text; placeholders are filled in.")
    mode: int = Field(default=0o600, ge=0, le=0o777, description="Permission bits.")


class ProgramHarnessConfig(ConfigModel):
    """An unmodified agent program run in the task's sandbox (a harness of kind `program`).

    Placeholders in `command`, `env` values and file contents: {instruction}, {model},
    {workdir}, {home}, {cache}, {base_url} (ends in /v1), {anthropic_base_url} (without /v1),
    {api_key}, {max_tokens}; other braces stay as written.
    """

    program: str = Field(
        min_length=1, description="Its name in the harness cache's manifest (bin/<program>)."
    )
    command: list[str] = Field(min_length=1, description="The argv, found on the cache's bin/.")
    dialect: Literal["chat_completions", "responses", "anthropic_messages"] = Field(
        default="chat_completions", description="The model API the program speaks."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Its environment variables.")
    files: list[ProgramFileConfig] = Field(
        default_factory=list, description="Configuration files written before it starts."
    )
    wall_clock_s: float | None = Field(
        default=None, gt=0, description="Its budget; unset: harnesses.wall_clock_s."
    )
    description: str = Field(default="", description="One line for ListHarnesses.")

    @field_validator("env")
    @classmethod
    def _check_env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            _env_name(name)
        return value


class HarnessesConfig(ConfigModel):
    """Third-party agent programs run inside the sandboxes (`program:*` harnesses)."""

    cache_dir: str = Field(
        default="",
        description="The harness cache `make harnesses` builds (tools/harnesses.py): its "
        "manifest.json and bin/. It must be visible at this path inside the sandboxes (the local "
        "runtime's host image shows the host root read-only). Empty: $ORCHARD_HARNESS_CACHE, "
        "and without it no program harness is offered.",
    )
    builtin: list[str] = Field(
        default_factory=lambda: list(BUILTIN_PROGRAMS),
        description="Built-in program harnesses offered (program:openclaw, program:claude-code, "
        "program:codex, program:hermes).",
    )
    programs: dict[str, ProgramHarnessConfig] = Field(
        default_factory=dict,
        description="More program harnesses by name (e.g. `program:my-agent`).",
    )
    wall_clock_s: float = Field(
        default=600.0,
        gt=0,
        description="A program's wall-clock budget: past it the program is killed and the "
        "rollout ends truncated (time_limit). The rollout's own budget bounds it too.",
    )

    @field_validator("builtin")
    @classmethod
    def _known_builtin(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - set(BUILTIN_PROGRAMS))
        if unknown:
            raise ValueError(
                f"unknown built-in program harnesses {unknown}; known: {list(BUILTIN_PROGRAMS)}"
            )
        return value

    def resolved_cache_dir(self, environ: Mapping[str, str] | None = None) -> str:
        environ = os.environ if environ is None else environ
        return self.cache_dir or environ.get("ORCHARD_HARNESS_CACHE", "")


class GuiConfig(ConfigModel):
    """Browser episodes of GUI tasks (the ``builtin:browser`` harnesses): a site sandbox and a
    browser sandbox per rollout, both through the environment service.

    The browser folder (`orchard.tasks.gui.browser_dir`) comes one of two ways: the ``host``
    image of the local runtime shows the folder `make gui-browser` built on this host at its own
    path ($ORCHARD_GUI_BROWSER_DIR); any other image is taken to be the browser image
    (images/gui-browser), which holds it at /opt/orchard-browser."""

    browser_dir: str = Field(
        default="",
        description="Where the images hold the browser folder (an absolute path). Empty: with "
        "the host image, $ORCHARD_GUI_BROWSER_DIR (the folder `make gui-browser` built here), "
        "and without it no browser harness is offered; with any other image, "
        f"{IMAGE_BROWSER_DIR}, where the browser image holds it.",
    )
    image: str = Field(
        default=HOST_IMAGE,
        min_length=1,
        description="The browser sandbox's image: `host`, or one built from images/gui-browser "
        "(Chromium and the browser folder).",
    )
    site_image: str = Field(
        default="", description="The site sandbox's image (python3 and the folder); empty: image."
    )
    site_port: int = Field(default=8080, ge=1, le=65535, description="The site server's port.")
    chromium: str = Field(
        default="/usr/bin/chromium", min_length=1, description="Chromium in the browser image."
    )
    browser_user: int | None = Field(
        default=65534,
        ge=1,
        description="The uid the browser runs as; null keeps root (Chromium's sandbox off). The "
        "browser image's own user is 10001.",
    )
    chromium_sandbox: bool = Field(
        default=True,
        description="Chromium's own sandbox; the browser sandbox then asks the environment "
        "service for user namespaces (its operator must allow them to this service).",
    )
    viewport: tuple[int, int] = Field(default=(1280, 800), description="Width, height (pixels).")
    action_timeout_s: float = Field(
        default=15.0, gt=0, description="How long one action (a click, a page load) may take."
    )
    keep_last: int = Field(
        default=3,
        ge=1,
        description="Screenshots (or page texts) kept in the conversation; earlier ones become "
        "a one-line placeholder.",
    )
    format_failure_limit: int = Field(
        default=3,
        ge=1,
        description="Turns that do not parse before the episode ends (scored -1 by the judge).",
    )

    @field_validator("browser_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if value and not value.startswith("/"):
            raise ValueError(f"{value!r} is not an absolute path (a path in the images)")
        return value

    @model_validator(mode="after")
    def _one_folder_path(self) -> GuiConfig:
        # Both sandboxes run the folder from browser_dir: found by default, it must be one path.
        site = self.site_image or self.image
        if not self.browser_dir and (site == HOST_IMAGE) != (self.image == HOST_IMAGE):
            raise ValueError(
                f"image {self.image!r} and site_image {site!r} hold the browser folder at "
                f"different paths (the host's folder, {IMAGE_BROWSER_DIR} in the browser "
                "image): set browser_dir to the path both hold it at"
            )
        return self

    def resolved_browser_dir(self, environ: Mapping[str, str] | None = None) -> str:
        """Where the browser sandbox's image holds the browser folder; empty: nowhere (no
        browser harness)."""
        if self.browser_dir:
            return self.browser_dir
        if self.image != HOST_IMAGE:
            return IMAGE_BROWSER_DIR
        environ = os.environ if environ is None else environ
        folder = environ.get("ORCHARD_GUI_BROWSER_DIR", "")
        # A folder of this host, which the host image shows at its own absolute path.
        return os.path.abspath(folder) if folder else ""


class RolloutConfig(ServiceConfig):
    """Everything ``orchard-rollout`` runs with."""

    server: ServerConfig = ServerConfig(listen=["127.0.0.1:7300"])
    etcd: EtcdConfig = EtcdConfig()
    artifacts: ArtifactsConfig = Field(
        default_factory=ArtifactsConfig,
        description="The artifact store: task archives (`files` of a task) and published "
        "weights are read from it; a URL outside root and allowed is refused.",
    )
    env: EnvServiceConfig = EnvServiceConfig()
    reward: RewardServiceConfig = RewardServiceConfig()
    policies: dict[str, PolicyConfig] = Field(
        default_factory=lambda: {"local": PolicyConfig()},
        min_length=1,
        description="Policies by name; a job names one in `policy` (empty: default_policy).",
    )
    default_policy: str = Field(default="local", description="The policy a job names none.")
    job_policies: JobPoliciesConfig = Field(
        default_factory=JobPoliciesConfig,
        description="Policies given in job specs instead of named here.",
    )
    proxy: CaptureProxyConfig = Field(
        default_factory=CaptureProxyConfig,
        description="The capture proxy in front of each engine.",
    )
    settle_timeout_s: float = Field(
        default=30.0, gt=0, description="How long a rollout's captured calls may take to settle."
    )
    defaults: RunDefaults = RunDefaults()
    jobs: JobsConfig = Field(
        default_factory=JobsConfig, description="Retention of ended jobs; the watch's safety net."
    )
    harnesses: HarnessesConfig = Field(
        default_factory=HarnessesConfig,
        description="Unmodified agent programs run inside the sandboxes, from an offline cache.",
    )
    gui: GuiConfig = Field(default_factory=GuiConfig, description="Browser episodes of GUI tasks.")
    workers: WorkersConfig = Field(
        default_factory=WorkersConfig,
        description="Where rollouts run: in this process (the default) or on Ray actors.",
    )
    resume_running_jobs: bool = Field(
        default=True,
        description="At start, resume the jobs a previous process left RUNNING (pairs already "
        "sampled are kept; pairs in flight are sampled again). False: mark them FAILED.",
    )

    @model_validator(mode="after")
    def _default_policy_known(self) -> RolloutConfig:
        if self.default_policy not in self.policies:
            known = ", ".join(sorted(self.policies))
            raise ValueError(f"default_policy {self.default_policy!r} is not in policies ({known})")
        return self
