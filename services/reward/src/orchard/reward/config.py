"""Configuration of ``orchard-reward``: one frozen pydantic model, validated at start.

Layers (lowest first): defaults, a YAML file (``--config`` or ``$ORCHARD_REWARD_CONFIG``),
``ORCHARD_REWARD_*`` variables, ``--set key=value``, flags. Secrets never sit in the file:
the judge's API key and the environment service's token are read from environment variables
whose names the configuration gives.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from orchard.core.config import ConfigModel, ServerConfig, ServiceConfig
from orchard.core.errors import OrchardError
from orchard.reward.credit import CalibrationRules
from orchard.reward.judge_client import JudgeEndpoint
from orchard.reward.rubric import DEFAULT_RUBRIC, Dimension, validate_rubric
from orchard.sdk.service_config import EnvClientConfig
from orchard.tasks.spec import GUI_STATE_JUDGE

__all__ = [
    "CheckConfig",
    "CreditConfig",
    "EnvServiceConfig",
    "JudgeConfig",
    "RewardConfig",
    "RubricDimensionConfig",
    "ScriptedJudgeConfig",
    "TaskChecksConfig",
    "TestRunConfig",
]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _env_name(value: str) -> str:
    if value and not _ENV_NAME.match(value):
        raise ValueError(f"expected an environment variable name, got {value!r}")
    return value


class EnvServiceConfig(EnvClientConfig):
    """The environment service the tests and checks run through."""

    endpoint: str | None = Field(
        default=None,
        description=(
            "gRPC address of orchard-env (HOST:PORT or unix:PATH). Unset: ScoreTests and "
            "ScoreTask answer FAILED_PRECONDITION; the judge RPCs work without it."
        ),
    )


class JudgeConfig(ConfigModel):
    """One OpenAI-compatible chat endpoint serving a judge model."""

    kind: Literal["openai"] = Field(
        default="openai", description="openai (this, the default) or scripted."
    )
    base_url: str = Field(
        default="http://127.0.0.1:8000/v1",
        min_length=1,
        description="API root of the endpoint; the default is the local CPU engine.",
    )
    model: str = Field(default="local", min_length=1, description="Model name it serves.")
    api_key_env: str = Field(
        default="",
        description="Environment variable holding the API key; empty: local, no key.",
    )
    timeout_s: float = Field(default=60.0, gt=0, description="Deadline of one call.")
    max_attempts: int = Field(
        default=3, ge=1, le=20, description="Calls per question; transport and format failures."
    )
    max_tokens: int = Field(default=1024, ge=1, description="Most tokens in one reply.")
    temperature: float = Field(default=0.0, ge=0, le=2, description="Sampling temperature.")

    @field_validator("api_key_env")
    @classmethod
    def _check_key_env(cls, value: str) -> str:
        return _env_name(value)

    def endpoint(self, environ: Mapping[str, str] | None = None) -> JudgeEndpoint:
        """The endpoint, with the API key read from ``api_key_env`` now."""
        environ = os.environ if environ is None else environ
        api_key = "unused"
        if self.api_key_env:
            api_key = environ.get(self.api_key_env, "")
            if not api_key:
                raise ValueError(
                    f"judge {self.model} at {self.base_url}: the API key variable "
                    f"{self.api_key_env} is not set"
                )
        return JudgeEndpoint(
            base_url=self.base_url,
            model=self.model,
            api_key=api_key,
            timeout_s=self.timeout_s,
            max_attempts=self.max_attempts,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
        )


class ScriptedJudgeConfig(ConfigModel):
    """The scripted credit judge, answered in this process: no model, no network. It values
    each turn of a failed trajectory by what its action does (reading and testing raise the
    value, the last edit is the critical error) and grades rubrics with the scripted rubric
    grader (`orchard.reward.scripted_rubric`); it answers AssignCredit and GradeRubric."""

    kind: Literal["scripted"] = Field(description="scripted.")
    model: str = Field(
        default="scripted-judge",
        min_length=1,
        description="Name the credit it gives is attributed to (`judge:<model>`).",
    )


def _judge_kind(value: Any) -> str:
    """A judge without `kind` is an endpoint, as before kinds existed."""
    kind = value.get("kind", "openai") if isinstance(value, dict) else getattr(value, "kind", "")
    return str(kind)


AnyJudgeConfig = Annotated[
    Annotated[JudgeConfig, Tag("openai")] | Annotated[ScriptedJudgeConfig, Tag("scripted")],
    Discriminator(_judge_kind),
]
"""A judge of either kind, told apart by `kind`."""


def _default_judges() -> dict[str, JudgeConfig | ScriptedJudgeConfig]:
    """The local engine, and the scripted credit judge recipes name (it costs nothing)."""
    return {"default": JudgeConfig(), "scripted": ScriptedJudgeConfig(kind="scripted")}


class RubricDimensionConfig(ConfigModel):
    """One rubric dimension: id, what the grader looks for, weight (all weights sum to 1)."""

    id: str = Field(min_length=1, description="Short id, e.g. R1.")
    text: str = Field(min_length=1, description="What the grader looks for.")
    weight: float = Field(ge=0, le=1, description="Share of the total.")


class CreditConfig(ConfigModel):
    """Retrospective credit assignment: the default epsilon and the calibration rules."""

    epsilon: float = Field(default=0.05, gt=0, lt=1, description="Least climb of a rise.")
    start_low: float = Field(default=0.3, ge=0, le=1, description="Lowest value at turn 0.")
    start_high: float = Field(default=0.5, ge=0, le=1, description="Highest value at turn 0.")
    end_below: float = Field(default=0.2, gt=0, le=1, description="The last value is below it.")
    require_drop_at_critical: bool = Field(
        default=True, description="The value must drop at the critical turn the judge names."
    )

    @model_validator(mode="after")
    def _order(self) -> CreditConfig:
        if self.start_low > self.start_high:
            raise ValueError(f"start_low {self.start_low} is above start_high {self.start_high}")
        return self

    def rules(self) -> CalibrationRules:
        return CalibrationRules(
            self.start_low, self.start_high, self.end_below, self.require_drop_at_critical
        )


class TestRunConfig(ConfigModel):
    """How ScoreTests runs a task's tests."""

    __test__ = False  # not a pytest test class

    default_timeout_s: float = Field(
        default=600.0, gt=0, description="Time limit of a test run whose request sets none."
    )
    max_timeout_s: float = Field(
        default=3600.0, gt=0, description="Longest time limit a request may ask for."
    )
    default_repo_path: str = Field(
        default="/testbed", description="Repository path of a request that sets none."
    )
    python: str = Field(
        default="python3",
        min_length=1,
        description="Interpreter of the default pytest command inside the sandbox.",
    )
    sandbox_heartbeat_timeout_s: float = Field(
        default=120.0,
        ge=1,
        description="Heartbeat timeout of sandboxes ScoreTests creates from a task's image.",
    )
    output_limit_bytes: int = Field(
        default=8 * 1024 * 1024, ge=4096, description="Most output kept per stream of the run."
    )

    @model_validator(mode="after")
    def _bounds(self) -> TestRunConfig:
        if self.default_timeout_s > self.max_timeout_s:
            raise ValueError(
                f"default_timeout_s {self.default_timeout_s} is above max_timeout_s "
                f"{self.max_timeout_s}"
            )
        if not self.default_repo_path.startswith("/"):
            raise ValueError(f"default_repo_path must be absolute, got {self.default_repo_path!r}")
        return self


class CheckConfig(ConfigModel):
    """A shell command run in the sandbox; it passes when it exits 0."""

    name: str = Field(min_length=1, description="What the check verifies, for the evidence.")
    command: str = Field(min_length=1, description="Run by /bin/sh -c in the sandbox.")
    working_dir: str = Field(default="", description="Where it runs; empty: the sandbox's own.")
    timeout_s: float = Field(default=60.0, gt=0, description="Time limit; past it: EXCLUDED.")


class TaskChecksConfig(ConfigModel):
    """A personal-assistant task: each part is the fraction of its checks that pass.

    A part without checks counts 1.0 (nothing configured can fail it); completion needs at
    least one check.
    """

    completion: list[CheckConfig] = Field(
        min_length=1, description="The task's test scripts: did it do what was asked?"
    )
    safety: list[CheckConfig] = Field(
        default_factory=list, description="Did it stay safe (nothing deleted, nothing leaked)?"
    )
    robustness: list[CheckConfig] = Field(
        default_factory=list, description="Does the result hold up (idempotent, edge cases)?"
    )


class RewardConfig(ServiceConfig):
    """Everything ``orchard-reward`` runs with."""

    server: ServerConfig = ServerConfig(listen=["127.0.0.1:7200"])
    env: EnvServiceConfig = EnvServiceConfig()
    judges: dict[str, AnyJudgeConfig] = Field(
        default_factory=_default_judges,
        min_length=1,
        description="Judges by name: model endpoints (kind openai) or the scripted judge "
        "(kind scripted: credit and rubric grades); requests pick one by name "
        "(JudgeOutcome.judge, GradeRubric.judge, AssignCredit.judge). Default: `default` (the "
        "local engine) and `scripted`; a file that sets `judges` replaces both.",
    )
    default_judge: str = Field(default="default", description="The judge a request names none.")
    last_screenshots: int = Field(
        default=3, ge=0, le=32, description="Screenshots the outcome judge sees, the last ones."
    )
    format_failure_limit: int = Field(
        default=3, ge=1, description="Format variant: this many policy format failures score -1."
    )
    rubric: list[RubricDimensionConfig] = Field(
        default_factory=lambda: [
            RubricDimensionConfig(id=d.id, text=d.text, weight=d.weight) for d in DEFAULT_RUBRIC
        ],
        min_length=1,
        description="The default rubric of GradeRubric; weights must sum to 1.",
    )
    credit: CreditConfig = CreditConfig()
    tests: TestRunConfig = TestRunConfig()
    tasks: dict[str, TaskChecksConfig] = Field(
        default_factory=dict, description="Personal-assistant tasks ScoreTask knows, by id."
    )

    @field_validator("rubric")
    @classmethod
    def _rubric_sums_to_one(
        cls, rubric: list[RubricDimensionConfig]
    ) -> list[RubricDimensionConfig]:
        try:
            validate_rubric([Dimension(d.id, d.text, d.weight) for d in rubric])
        except OrchardError as exc:
            raise ValueError(exc.message) from None
        return rubric

    @field_validator("judges")
    @classmethod
    def _builtin_judge_name_free(cls, value: dict[str, Any]) -> dict[str, Any]:
        if GUI_STATE_JUDGE in value:
            raise ValueError(
                f"judge name {GUI_STATE_JUDGE!r} is the built-in GUI state judge's: name "
                "yours otherwise"
            )
        return value

    @model_validator(mode="after")
    def _default_judge_known(self) -> RewardConfig:
        if self.default_judge not in self.judges:
            known = ", ".join(sorted(self.judges))
            raise ValueError(f"default_judge {self.default_judge!r} is not in judges ({known})")
        return self

    def rubric_dimensions(self) -> tuple[Dimension, ...]:
        return tuple(Dimension(d.id, d.text, d.weight) for d in self.rubric)
