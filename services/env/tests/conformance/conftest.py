"""The runtime conformance suite: one set of tests, run against every runtime.

Each runtime provides a :class:`RuntimeHarness` (how to build it, what images it runs, how to
kill a sandbox's agent from outside, how to check nothing leaked); the ``harness`` fixture is
parametrized by runtime name. ``kubernetes`` runs against the Kubernetes API test double
(``services/env/tests/kube/kube_api_double.py``); what a harness cannot check is listed in its
``unchecked`` with the reason, and only those tests skip for it. A machine that lacks what
the local runtime needs (root, busybox-static, the agent bundle) fails the suite.
"""

from __future__ import annotations

import abc
import contextlib
import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.env.agents import ServiceCredential
from orchard.env.runtime.base import (
    Runtime,
    RuntimeSandbox,
    RuntimeSandboxSpec,
    SandboxStatus,
)
from orchard.inagent.v1 import inagent_service_pb2 as agent_pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as agent_grpc
from orchard.types.v1 import exec_pb2

# Each entry is a runtime, optionally with a variant: the local runtime runs the suite with both
# of its agent launches, and with sandboxes claimed from a pool built for the busybox image.
RUNTIMES = ["local-zygote", "local-exec", "local-pooled", "kubernetes"]
BUSYBOX = "/bin/busybox"


class RuntimeHarness(abc.ABC):
    """What the suite needs to know about one runtime beyond the interface."""

    images: dict[str, str]  # "busybox" (a static busybox root) and "host" where supported
    missing_image: str = "rootfs:/nonexistent/orchard-image"  # an image that does not exist
    unchecked: dict[str, str] = {}  # what this harness cannot check → why

    def require(self, what: str) -> None:
        """Skip the calling test when this harness cannot check ``what``."""
        if what in self.unchecked:
            pytest.skip(self.unchecked[what])

    @abc.abstractmethod
    def new_runtime(self, **overrides: Any) -> Runtime:
        """A fresh, unstarted instance over the same resources (a restarted service)."""

    @abc.abstractmethod
    def kill_agent(self, sandbox_id: str) -> None:
        """Kill the sandbox's agent from outside, as a crash would."""

    @abc.abstractmethod
    def leaks(self, sandbox_ids: set[str]) -> list[str]:
        """Whatever remains of these sandboxes (processes, mounts, cgroups, directories)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Remove what the harness itself made."""


class LocalHarness(RuntimeHarness):
    def __init__(self, base: Path, busybox_root: Path, variant: str) -> None:
        from orchard.env.runtime.local import LocalRuntimeConfig

        self.base = base
        # The agent's socket path must stay short: a run directory directly under the tmp dir.
        self.run_dir = tempfile.mkdtemp(prefix="orc-")
        self.config = LocalRuntimeConfig(
            state_dir=str(base / "state"),
            workspace_dir=str(base / "sandboxes"),
            run_dir=self.run_dir,
            cgroup_parent=f"orchard-test-{uuid.uuid4().hex[:8]}",
            start_timeout_s=30,
            agent_launch="exec" if variant == "exec" else "zygote",
            pool_image=f"rootfs:{busybox_root}" if variant == "pooled" else "",
        )
        self.images = {"busybox": f"rootfs:{busybox_root}", "host": "host"}
        self._cgroup_parents: tuple[str, ...] = ()

    def new_runtime(self, **overrides: Any) -> Runtime:
        from orchard.env.runtime.local import LocalRuntime

        runtime = LocalRuntime(self.config.model_copy(update=overrides))
        return runtime

    def remember(self, runtime: Runtime) -> None:
        driver = getattr(runtime, "_cgroups", None)
        if driver is not None:
            self._cgroup_parents = driver.parents

    def kill_agent(self, sandbox_id: str) -> None:
        from orchard.env.runtime.local.state import StateStore

        state = StateStore(self.config.state_dir).read(sandbox_id)
        assert state is not None and state.pid
        os.kill(state.pid, signal.SIGKILL)

    def leaks(self, sandbox_ids: set[str]) -> list[str]:
        found = []
        for sandbox_id in sandbox_ids:
            for directory in (
                f"{self.config.workspace_dir}/{sandbox_id}",
                f"{self.config.run_dir}/{sandbox_id}",
                f"{self.config.state_dir}/{sandbox_id}.json",
                *(f"{parent}/{sandbox_id}" for parent in self._cgroup_parents),
            ):
                if os.path.lexists(directory):
                    found.append(directory)
        for parent in self._cgroup_parents:
            with contextlib.suppress(FileNotFoundError):
                found += [
                    f"{parent}: pid {p}" for p in Path(parent, "cgroup.procs").read_text().split()
                ]
        with open("/proc/self/mountinfo", encoding="utf-8") as file:
            for line in file:
                point = line.split()[4]
                if point.startswith((self.config.workspace_dir, self.run_dir)):
                    found.append(f"mount {point}")
        return found

    def close(self) -> None:
        for parent in self._cgroup_parents:
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(parent)
        shutil.rmtree(self.run_dir, ignore_errors=True)


KUBE_TESTS = Path(__file__).resolve().parent.parent / "kube"


def _kube_module(name: str) -> Any:
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, KUBE_TESTS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


class KubernetesHarness(RuntimeHarness):
    """The kubernetes runtime against the Kubernetes API test double, whose Pods run in mount,
    pid and uts namespaces over an image root, in the host's network namespace, without
    cgroups: network isolation and limits are the cluster's (CNI, kubelet) and unchecked here."""

    unchecked = {
        "network-isolation": "NetworkPolicy enforcement is the cluster's CNI; the Kubernetes "
        "API test double runs Pods in the host's network namespace",
        "memory-limit": "memory limits are the kubelet's cgroups; the test double sets none",
        "pids-limit": "Kubernetes has no per-container pids limit (the kubelet's podPidsLimit "
        "is node-wide); the test double sets none",
        "host-image": "a Pod has no 'host' image",
    }

    def __init__(self, double: Any, kube: Any) -> None:
        self.double = double
        self.kube = kube
        self.config = kube.runtime_config(double)
        self.images = {"busybox": kube.BUSYBOX_IMAGE}
        self.missing_image = kube.MISSING_IMAGE

    def new_runtime(self, **overrides: Any) -> Runtime:
        from orchard.env.runtime.kubernetes import KubernetesRuntime

        return KubernetesRuntime(self.config.model_copy(update=overrides))

    def kill_agent(self, sandbox_id: str) -> None:
        self.double.kill_container(self.kube.NAMESPACE, sandbox_id)

    def leaks(self, sandbox_ids: set[str]) -> list[str]:
        found: list[str] = self.kube.leftovers(self.double, sandbox_ids)
        return found

    def close(self) -> None:
        pass


def local_unavailable() -> str | None:
    from orchard.env.runtime.local.config import default_agent_bundle

    if os.geteuid() != 0:
        return "the local runtime needs root"
    if not os.path.exists(BUSYBOX):
        return "needs busybox-static (/bin/busybox)"
    if not os.access(os.path.join(default_agent_bundle(), "orchard-inagent"), os.X_OK):
        return "needs the agent bundle (make inagent-binary)"
    return None


@pytest.fixture(scope="session")
def kube_image_catalog(tmp_path_factory: pytest.TempPathFactory, busybox_root: Path) -> Any:
    _kube_module("kube_api_double")
    kube = _kube_module("kube_harness")
    reason = kube.unavailable()
    if reason:
        pytest.fail(reason)
    return kube.catalog(busybox_root, kube.build_bundle_layer(tmp_path_factory.mktemp("inagent")))


@pytest.fixture(params=RUNTIMES)
async def harness(
    request: pytest.FixtureRequest, tmp_path: Path, busybox_root: Path
) -> AsyncIterator[RuntimeHarness]:
    made: RuntimeHarness
    async with contextlib.AsyncExitStack() as stack:
        if request.param.startswith("local-"):
            reason = local_unavailable()
            if reason:
                pytest.fail(reason)
            made = LocalHarness(tmp_path, busybox_root, request.param.removeprefix("local-"))
        elif request.param == "kubernetes":
            images = request.getfixturevalue("kube_image_catalog")
            kube = _kube_module("kube_harness")
            double = await stack.enter_async_context(kube.started_double(tmp_path / "kube", images))
            made = KubernetesHarness(double, kube)
        else:  # pragma: no cover - other runtimes register here
            raise AssertionError(request.param)
        try:
            yield made
        finally:
            made.close()


class Sandboxes:
    """Creates sandboxes for a test and checks, at the end, that deleting left nothing."""

    def __init__(self, harness: RuntimeHarness, runtime: Runtime) -> None:
        self.harness = harness
        self.runtime = runtime
        self.ids: set[str] = set()

    def spec(self, image: str = "busybox", **fields: Any) -> RuntimeSandboxSpec:
        sandbox_id = fields.pop("sandbox_id", f"conf-{uuid.uuid4().hex[:10]}")
        self.ids.add(sandbox_id)
        return RuntimeSandboxSpec(sandbox_id=sandbox_id, image=self.harness.images[image], **fields)

    async def create(self, image: str = "busybox", **fields: Any) -> RuntimeSandbox:
        return await self.runtime.create(self.spec(image, **fields))


@pytest.fixture
async def sandboxes(harness: RuntimeHarness) -> AsyncIterator[Sandboxes]:
    runtime = harness.new_runtime()
    await runtime.start()
    if isinstance(harness, LocalHarness):
        harness.remember(runtime)
    made = Sandboxes(harness, runtime)
    try:
        yield made
    finally:
        runtime = made.runtime  # a test may have replaced it (re-adoption)
        for sandbox_id in made.ids:
            await runtime.delete(sandbox_id)
            assert await runtime.status(sandbox_id) is SandboxStatus.ABSENT
        await runtime.close()
        assert harness.leaks(made.ids) == []


class Agent:
    """A channel to one sandbox's agent. Calls carry `await metadata()`: orchard-env's route
    credential when the runtime gave the agent a key (on Kubernetes, agents serve only calls
    that carry one), nothing otherwise."""

    def __init__(self, address: str, runtime: Runtime, sandbox_id: str) -> None:
        self.channel = grpc.aio.insecure_channel(
            address, options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        self.stub = agent_grpc.AgentServiceStub(self.channel)
        self.runtime = runtime
        self.sandbox_id = sandbox_id
        self._credential: ServiceCredential | None = None
        self._looked_up = False

    async def metadata(self) -> grpc.aio.Metadata | tuple[()]:
        if not self._looked_up:
            key = await self.runtime.agent_key(self.sandbox_id)
            self._credential = None if key is None else ServiceCredential(key, self.sandbox_id)
            self._looked_up = True
        return () if self._credential is None else self._credential.metadata()

    async def sh(
        self, script: str, *, stdin: bytes = b"", timeout_s: float = 0, limit: int = 0
    ) -> exec_pb2.ExecResult:
        command = exec_pb2.Command(shell=script, stdin=stdin, output_limit_bytes=limit)
        if timeout_s:
            command.timeout.FromNanoseconds(int(timeout_s * 1e9))
        request = agent_pb.ExecRequest(command=command)
        reply = await self.stub.Exec(request, timeout=60, metadata=await self.metadata())
        return reply.result

    async def close(self) -> None:
        await self.channel.close()


@pytest.fixture
async def agent_for(sandboxes: Sandboxes) -> AsyncIterator[Any]:
    opened: list[Agent] = []

    def open_agent(sandbox: RuntimeSandbox) -> Agent:
        agent = Agent(sandbox.agent_address, sandboxes.runtime, sandbox.sandbox_id)
        opened.append(agent)
        return agent

    yield open_agent
    for agent in opened:
        await agent.close()
