"""Fixtures of the integration tests: real services started as processes."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchard.core.config import deep_merge
from orchard.recipes.pipeline import run_recipe
from orchard.recipes.workspace import StackEndpoints
from orchard.sdk.cli.host_probe import remove_cgroup_parent
from orchard.sdk.cli.stack import LocalStack, StackError
from orchard.sdk.recipe import Recipe, load_recipe


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for processes that take an address, not port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class EnvStack:
    """etcd and orchard-env with the local runtime, as `orchard up` runs them."""

    stack: LocalStack
    token: str
    metrics_address: str
    """HOST:PORT of orchard-env's Prometheus endpoint."""

    @property
    def endpoint(self) -> str:
        return self.stack.endpoint

    def endpoints(self) -> StackEndpoints:
        """The stack as a recipe talks to it (the services it started beside orchard-env)."""
        services = self.stack.extra_services
        return StackEndpoints(
            env=self.endpoint,
            env_token=self.token,
            reward=services.get("reward", ""),
            etcd=self.stack.etcd_endpoint,
            trainer=services.get("trainer", ""),
            rollout=services.get("rollout", ""),
            env_metrics=self.metrics_address,
            artifacts=self.stack.artifacts_url,
        )


@contextlib.contextmanager
def private_stack(
    tmp_path_factory: pytest.TempPathFactory,
    services: dict[str, str] | None = None,
    service_settings: dict[str, dict[str, Any]] | None = None,
    settings: list[str] | None = None,
) -> Iterator[EnvStack]:
    """etcd, orchard-env and ``services`` (name -> listen address; ``service_settings`` merged
    into their configs) with their own cgroup parent and run dir, all removed at the end;
    ``settings`` are more of orchard-env's own (``key=value``)."""
    if os.geteuid() != 0:
        pytest.fail("the local runtime needs root: run the tests as root")
    state = tmp_path_factory.mktemp("stack")
    run_dir = Path(tempfile.mkdtemp(prefix="oi-"))  # sandbox socket paths must stay short
    cgroup_parent = f"orchard-test-{uuid.uuid4().hex[:8]}"
    token = secrets.token_urlsafe(16)
    metrics = f"127.0.0.1:{free_port()}"
    stack = LocalStack(
        state,
        listen=f"127.0.0.1:{free_port()}",
        token=token,
        runtime={"cgroup_parent": cgroup_parent, "run_dir": str(run_dir)},
        settings=[f"server.metrics_address={metrics}", *(settings or [])],
        services=services,
        service_settings=service_settings,
    )
    try:
        stack.start()
        yield EnvStack(stack, token, metrics)
    except StackError as exc:
        pytest.fail(str(exc))
    finally:
        stack.stop()
        remove_cgroup_parent(cgroup_parent)
        shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.contextmanager
def recipe_stack(
    tmp_path_factory: pytest.TempPathFactory,
    service_settings: dict[str, dict[str, Any]] | None = None,
) -> Iterator[EnvStack]:
    """A private stack with every service a recipe talks to: orchard-reward, orchard-rollout
    and orchard-trainer beside etcd and orchard-env (``service_settings`` into their configs)."""
    components = {name: f"127.0.0.1:{free_port()}" for name in ("reward", "rollout", "trainer")}
    with private_stack(tmp_path_factory, components, service_settings) as env:
        yield env


REDUCED_RECIPE: dict[str, Any] = {
    "name": "reduced",
    # 15 tasks, three per bug family: one each for SFT, RL and the held-out set.
    "tasks": {
        "builtin": {"count": 15, "seed": 3},
        "split": {"sft": 0.34, "rl": 0.33, "evaluate": 0.33},
    },
    "harnesses": ["builtin:swe"],
    "stages": {
        "collect": {"attempts_per_task": 2, "budget": {"max_steps": 8, "wall_clock_s": 120}},
        "sft": {"epochs": 2, "batch_size": 2, "learning_rate": 0.003, "warmup_steps": 1},
        "rl": {
            "steps": 1,
            "groups_per_step": 1,
            "sampler": {"kind": "fixed", "n": 2},
            "budget": {"max_steps": 3, "max_tokens": 256, "wall_clock_s": 120},
        },
        "evaluate": {"attempts_per_task": 1},
    },
}
"""The built-in suite's recipe cut to a few minutes of a 2-core machine."""


def reduced_recipe(name: str, stages: dict[str, Any] | None = None) -> dict[str, Any]:
    """`REDUCED_RECIPE` named ``name`` with ``stages`` laid over its stages."""
    return {
        **REDUCED_RECIPE,
        "name": name,
        "stages": deep_merge(REDUCED_RECIPE["stages"], stages or {}),
    }


@pytest.fixture(scope="module")
def endpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackEndpoints]:
    """A module's recipe stack (`recipe_stack`), as a recipe reaches it."""
    with recipe_stack(tmp_path_factory) as env:
        yield env.endpoints()


@pytest.fixture(scope="module")
def report(endpoints: StackEndpoints, recipe: Recipe) -> Path:
    """The module's `recipe` run on its stack, quietly; the report it wrote."""
    return run_recipe(recipe, endpoints, progress=False, workers=3, say=lambda _: None)


def written_recipe(tmp_path_factory: pytest.TempPathFactory, data: dict[str, Any]) -> Recipe:
    """``data`` written as a recipe file in a folder of its own and loaded from there (its
    outputs go under that folder)."""
    folder = tmp_path_factory.mktemp(f"{data['name']}-recipe")
    (folder / "recipe.yaml").write_text(yaml.safe_dump(data))
    return load_recipe(folder / "recipe.yaml", workdir=folder)


def stage_done(recipe: Recipe, stage: str) -> dict[str, Any]:
    """A finished stage's summary (its ``done.json``)."""
    assert recipe.output_dir is not None
    data: dict[str, Any] = json.loads((recipe.output_dir / stage / "done.json").read_text())
    return data


@pytest.fixture(scope="module")
def env_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvStack]:
    """One private stack per test module: its own etcd, cgroup parent and run dir."""
    with private_stack(tmp_path_factory) as stack:
        yield stack
