"""Fixtures of the kubernetes runtime tests: the Kubernetes API test double with Pods that run
the real agent (``kube_harness.py``), and runtimes pointed at it."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent


def load_module(name: str) -> Any:
    """The test double's modules by path (tests are imported with importlib mode)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


load_module("kube_api_double")
kube = load_module("kube_harness")


@pytest.fixture(scope="session")
def kube_images(tmp_path_factory: pytest.TempPathFactory) -> Any:
    reason = kube.unavailable()
    if reason:
        pytest.fail(reason)
    busybox = kube.build_busybox_root(tmp_path_factory.mktemp("kube-busybox"))
    bundle = kube.build_bundle_layer(tmp_path_factory.mktemp("kube-inagent"))
    return kube.catalog(busybox, bundle)


@pytest.fixture
async def double(tmp_path: Path, kube_images: Any) -> AsyncIterator[Any]:
    async with kube.started_double(tmp_path / "kube", kube_images, bookmark_interval_s=0.2) as d:
        yield d


@pytest.fixture
async def runtime_for(double: Any) -> AsyncIterator[Any]:
    """Builds started runtimes on the double; deletes their sandboxes and closes them after."""
    from orchard.env.runtime.kubernetes import KubernetesRuntime

    made: list[Any] = []

    async def start(**overrides: Any) -> Any:
        runtime = KubernetesRuntime(kube.runtime_config(double, **overrides))
        await runtime.start()
        made.append(runtime)
        return runtime

    yield start
    for runtime in reversed(made):
        if runtime._pods is not None:
            for sandbox_id in await runtime.list_sandboxes():
                await runtime.delete(sandbox_id)
            await runtime.close()
