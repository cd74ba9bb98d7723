"""Inference engines behind one interface (`orchard.rollout.engines.base.InferenceEngine`) and
one lifecycle (`orchard.rollout.engines.versioned.VersionedEngine`), chosen by configuration
(`orchard.rollout.engines.config.EngineConfig`): ``local`` (PyTorch on the CPU, the embedded
default) and ``vllm`` (GPUs; an optional extra, imported only when configured). `create_engine`
builds the configured one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchard.rollout.engines.config import EngineConfig

if TYPE_CHECKING:
    from orchard.lm.weights import WeightRegistry
    from orchard.rollout.engines.base import InferenceEngine

__all__ = ["check_engine_available", "create_engine"]


def check_engine_available(config: EngineConfig) -> None:
    """Raise `EngineUnavailable`, saying how to install it, when the engine `config` selects
    cannot run in this environment; loads nothing."""
    if config.type == "vllm":
        from orchard.rollout.engines.vllm import require_vllm  # noqa: PLC0415

        require_vllm()


def create_engine(
    config: EngineConfig, *, registry: WeightRegistry | None = None
) -> InferenceEngine:
    """The engine `config` selects, not started yet (`async with` or `start()` it). Only the
    selected engine's module is imported: torch for ``local``, vLLM's adapter for ``vllm``."""
    if config.type == "vllm":
        from orchard.rollout.engines.vllm import VllmEngine  # noqa: PLC0415

        return VllmEngine(config, registry=registry)
    from orchard.rollout.engines.local import LocalEngine  # noqa: PLC0415

    return LocalEngine(config, registry=registry)
