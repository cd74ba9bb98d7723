"""The runtime named by ``runtime.type`` in the configuration, imported only when chosen."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from orchard.env.runtime.base import Runtime, RuntimeUnavailable

__all__ = ["load_runtime"]


def load_runtime(settings: Mapping[str, Any]) -> Runtime:
    """Build (not start) the runtime the ``runtime`` section describes.

    ``type: plugin`` with ``factory: module:callable`` calls ``callable(options)`` where
    ``options`` holds the section's other keys; every other type goes to the backends' own
    factory, :func:`orchard.env.runtime.create_runtime`, which validates the section with the
    backend's model.
    """
    kind = settings.get("type")
    if kind == "plugin":
        module_name, _, attribute = str(settings.get("factory", "")).partition(":")
        factory = getattr(importlib.import_module(module_name), attribute)
        options = {k: v for k, v in settings.items() if k not in ("type", "factory")}
        runtime = factory(options)
        if not isinstance(runtime, Runtime):
            raise TypeError(f"runtime factory {settings['factory']} returned {runtime!r}")
        return runtime
    from orchard.env import runtime as runtimes  # noqa: PLC0415

    create = getattr(runtimes, "create_runtime", None)
    if create is None:
        raise RuntimeUnavailable(f"runtime {kind!r}: no runtime backends in this build")
    result: Runtime = create(dict(settings))
    return result
