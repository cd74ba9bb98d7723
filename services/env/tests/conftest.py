"""Fixtures of the environment service tests: real etcd (the workspace's session `etcd`), real
`orchard-env` servers, real agents.

Sandboxes run in ``UnisolatedProcessRuntime`` (``unisolated_runtime.py``), a test double with
no isolation that runs the real agent as a plain process: these tests are about the service's
own logic, not about what isolates a sandbox.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.core.config import ServerConfig
from orchard.core.etcd import EmbeddedEtcd
from orchard.core.server import GrpcServer
from orchard.env.config import (
    AuthConfig,
    EnvConfig,
    EtcdConfig,
    ImagesConfig,
    SecretsConfig,
    TenantConfig,
    token_digest,
)
from orchard.env.main import EnvApplication
from orchard.env.runtime.base import RuntimeUnavailable
from orchard.env.v1 import env_pb2, env_service_pb2_grpc
from orchard.env.v1 import env_service_pb2 as api

TESTS = Path(__file__).resolve().parent
ALPHA_TOKEN = "alpha-token"
BETA_TOKEN = "beta-token"
AUTH = AuthConfig(
    tenants={
        "alpha": TenantConfig(tokens=[ALPHA_TOKEN]),
        "beta": TenantConfig(tokens=[token_digest(BETA_TOKEN)]),
    }
)


def _load_double() -> Any:
    name = "unisolated_runtime"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TESTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


unisolated = _load_double()


DOUBLE_IMAGE_PATHS = ["/broken", "/nowhere", "/srv/root", "/i.tar"]


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@dataclass
class EnvHandle:
    """One running replica and a client channel to it."""

    app: EnvApplication
    server: GrpcServer
    address: str
    channel: grpc.aio.Channel
    stub: env_service_pb2_grpc.EnvServiceStub
    token: str = ALPHA_TOKEN

    def md(self, token: str | None = None) -> tuple[tuple[str, str], ...]:
        return bearer(token or self.token)

    async def create(
        self, image: str = "host", timeout_s: float | None = None, **spec: Any
    ) -> env_pb2.Sandbox:
        request = api.CreateSandboxRequest(spec=env_pb2.SandboxSpec(image=image, **spec))
        if timeout_s is not None:
            request.spec.heartbeat_timeout.FromNanoseconds(int(timeout_s * 1e9))
        reply = await self.stub.CreateSandbox(request, metadata=self.md())
        return reply.sandbox

    async def wait(self, sandbox_id: str, timeout_s: float = 30) -> env_pb2.Sandbox:
        request = api.WaitSandboxRequest(sandbox_id=sandbox_id)
        request.timeout.FromNanoseconds(int(timeout_s * 1e9))
        return (await self.stub.WaitSandbox(request, metadata=self.md())).sandbox

    async def ready(self, **spec: Any) -> env_pb2.Sandbox:
        sandbox = await self.create(**spec)
        sandbox = await self.wait(sandbox.id)
        assert sandbox.state == env_pb2.SANDBOX_STATE_READY, sandbox
        return sandbox

    async def shell(self, sandbox_id: str, script: str) -> Any:
        from orchard.types.v1 import exec_pb2

        request = api.ExecRequest(sandbox_id=sandbox_id, command=exec_pb2.Command(shell=script))
        return (await self.stub.Exec(request, metadata=self.md())).result


EnvFactory = Callable[..., Awaitable[EnvHandle]]


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own, so tests on the session etcd never meet."""
    return f"test-env/{secrets.token_hex(4)}/"


@pytest.fixture
async def runtime(tmp_path: Path) -> AsyncIterator[Any]:
    rt = unisolated.UnisolatedProcessRuntime(tmp_path / "runtime")
    await rt.start()
    try:
        yield rt
    finally:
        for sandbox_id in await rt.list_sandboxes():
            await rt.delete(sandbox_id)
        await rt.close()


def env_config(etcd: EmbeddedEtcd, prefix: str, tmp_path: Path, **overrides: Any) -> EnvConfig:
    values: dict[str, Any] = {
        "server": ServerConfig(listen=["127.0.0.1:0"], grace_period_s=1),
        "etcd": EtcdConfig(endpoints=[etcd.endpoint], prefix=prefix),
        "auth": AUTH,
        "runtime": {
            "type": "plugin",
            "factory": "unisolated_runtime:make",
            "state_dir": str(tmp_path / "runtime"),
        },
        # The tests are the operator: every tenant may use the host image, and the paths the
        # runtime double takes for images (none exist; it fails some on purpose).
        "images": ImagesConfig(allow_host=True, allowed_paths=DOUBLE_IMAGE_PATHS),
        "secrets": SecretsConfig(key_file=str(tmp_path / "secrets.key")),
    }
    values.update(overrides)
    return EnvConfig(**values)


@pytest.fixture
async def env_factory(
    etcd: EmbeddedEtcd, prefix: str, tmp_path: Path, runtime: Any
) -> AsyncIterator[EnvFactory]:
    """Starts replicas (in-process servers on one etcd prefix and one runtime); stops them all
    at the end."""
    async with AsyncExitStack() as stack:

        async def start(**overrides: Any) -> EnvHandle:
            rt = overrides.pop("runtime", runtime)
            config = env_config(etcd, prefix, tmp_path, **overrides)
            app = EnvApplication(config, runtime=rt)
            server = await stack.enter_async_context(app.server())
            await server.set_serving()
            address = server.addresses[0]
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(address))
            return EnvHandle(
                app, server, address, channel, env_service_pb2_grpc.EnvServiceStub(channel)
            )

        yield start


@pytest.fixture
async def env(env_factory: EnvFactory) -> EnvHandle:
    return await env_factory()


@pytest.fixture
async def local_runtime(tmp_path: Path) -> AsyncIterator[Any]:
    """The real ``local`` runtime on private directories and cgroups; a machine that cannot run
    it (no root, no agent bundle) fails the test: `make setup` and `make inagent-binary`.
    Its ``host`` sandboxes come from its pool (built for that image from start)."""
    from orchard.env.runtime.local import LocalRuntime, LocalRuntimeConfig

    run_dir = tempfile.mkdtemp(prefix="orc-")
    config = LocalRuntimeConfig(
        state_dir=str(tmp_path / "state"),
        workspace_dir=str(tmp_path / "sandboxes"),
        run_dir=run_dir,
        cgroup_parent=f"orchard-test-{uuid.uuid4().hex[:8]}",
        pool_image="host",
    )
    runtime = LocalRuntime(config)
    try:
        await runtime.start()
    except RuntimeUnavailable as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        pytest.fail(f"the local runtime cannot run here: {exc}")
    try:
        yield runtime
    finally:
        for sandbox_id in await runtime.list_sandboxes():
            await runtime.delete(sandbox_id)
        await runtime.close()
        cgroups = getattr(runtime, "_cgroups", None)
        for parent in getattr(cgroups, "parents", ()):
            if os.path.isdir(parent):
                os.rmdir(parent)
        shutil.rmtree(run_dir, ignore_errors=True)


BUSYBOX = "/bin/busybox"


@pytest.fixture(scope="session")
def busybox_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root file system with nothing but a static busybox: no libc, no Python."""
    if not os.path.exists(BUSYBOX):
        pytest.fail(f"{BUSYBOX} is missing: `make setup` installs busybox-static")
    # In a folder of its own, which a service's configuration may allow as an image source.
    root = tmp_path_factory.mktemp("images") / "busybox"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    applets = subprocess.run(
        [BUSYBOX, "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    for applet in applets:
        if applet != "busybox":
            (root / "bin" / applet).symlink_to("busybox")
    for directory in ("etc", "root", "tmp", "usr/bin"):
        (root / directory).mkdir(parents=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    return root
