"""The ``kubernetes`` runtime: one Pod per sandbox (see
:mod:`orchard.env.runtime.kubernetes.runtime`). The configuration model imports no client;
the runtime imports kubernetes-asyncio."""

from orchard.env.runtime.kubernetes.config import KubernetesRuntimeConfig

__all__ = ["KubernetesRuntime", "KubernetesRuntimeConfig"]


def __getattr__(name: str) -> object:
    if name == "KubernetesRuntime":
        from orchard.env.runtime.kubernetes.runtime import KubernetesRuntime  # noqa: PLC0415

        return KubernetesRuntime
    raise AttributeError(name)
