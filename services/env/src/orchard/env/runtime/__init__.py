"""Sandbox runtimes: one interface (:mod:`orchard.env.runtime.base`), one module per backend.

Backends are imported lazily by :func:`orchard.env.runtime.create_runtime`, so a service that
runs ``local`` never imports a Kubernetes client and the reverse.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchard.env.runtime.base import Runtime

__all__ = ["KNOWN_RUNTIMES", "create_runtime"]

KNOWN_RUNTIMES = ("local", "kubernetes")


def create_runtime(config: Mapping[str, Any] | Any) -> Runtime:
    """The runtime ``config["type"]`` (or ``config.type``) names, not started yet.

    ``config`` is the runtime section as a mapping, validated here with the backend's own
    model (pydantic's ``ValidationError`` on a mistake), or an instance of that model.
    """
    kind = config.get("type") if isinstance(config, Mapping) else getattr(config, "type", None)
    if kind == "local":
        from orchard.env.runtime.local import LocalRuntime, LocalRuntimeConfig  # noqa: PLC0415

        if isinstance(config, Mapping):
            config = LocalRuntimeConfig.model_validate(dict(config))
        if not isinstance(config, LocalRuntimeConfig):
            raise TypeError(f"runtime 'local' needs a LocalRuntimeConfig, got {type(config)!r}")
        return LocalRuntime(config)
    if kind == "kubernetes":
        from orchard.env.runtime.kubernetes.config import KubernetesRuntimeConfig  # noqa: PLC0415
        from orchard.env.runtime.kubernetes.runtime import KubernetesRuntime  # noqa: PLC0415

        if isinstance(config, Mapping):
            config = KubernetesRuntimeConfig.model_validate(dict(config))
        if not isinstance(config, KubernetesRuntimeConfig):
            raise TypeError(
                f"runtime 'kubernetes' needs a KubernetesRuntimeConfig, got {type(config)!r}"
            )
        return KubernetesRuntime(config)
    raise ValueError(f"unknown runtime type {kind!r}; known: {', '.join(KNOWN_RUNTIMES)}")
