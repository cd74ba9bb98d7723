"""End to end: the local runtime starts a sandbox from a docker-archive image built offline
(umoci + skopeo) and runs a command in it through the agent."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.env.runtime.base import RuntimeSandboxSpec, SandboxStatus
from orchard.env.runtime.local import LocalRuntime, LocalRuntimeConfig
from orchard.env.runtime.local.config import default_agent_bundle
from orchard.inagent.v1 import inagent_service_pb2 as agent_pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as agent_grpc
from orchard.types.v1 import exec_pb2

BUSYBOX = "/bin/busybox"


def _load_builders() -> Any:
    name = "image_archives"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / f"{name}.py")
        assert spec is not None and spec.loader is not None
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


build = _load_builders()


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the local runtime needs root"
    if build.TOOLS_MISSING:
        return build.TOOLS_REASON
    if not os.path.exists(BUSYBOX):
        return "needs busybox-static (/bin/busybox)"
    if not os.access(os.path.join(default_agent_bundle(), "orchard-inagent"), os.X_OK):
        return "needs the agent bundle (make inagent-binary)"
    return None


pytestmark = [pytest.mark.root, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _prerequisites() -> None:
    """What `make setup` and `make inagent-binary` provide: missing, the tests fail."""
    reason = _unavailable()
    if reason is not None:
        pytest.fail(reason)


def busybox_layer(root: Path) -> None:
    (root / "bin").mkdir()
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    applets = subprocess.run(
        [BUSYBOX, "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    for applet in applets:
        if applet != "busybox":
            (root / "bin" / applet).symlink_to("busybox")
    for name in ("etc", "root", "tmp", "usr/bin"):
        (root / name).mkdir(parents=True)
    (root / "tmp").chmod(0o1777)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc" / "motd").write_text("removed by the next layer\n")


def second_layer(root: Path) -> None:
    (root / "etc" / "motd").unlink()
    (root / "etc" / "image-layer").write_text("two\n")


async def test_a_sandbox_runs_from_a_docker_archive(tmp_path: Path) -> None:
    layout = build.OciLayout(tmp_path / "oci", "latest")
    layout.layer(busybox_layer)
    layout.layer(second_layer)
    image = layout.docker_archive(tmp_path / "busybox.tar", "busybox:latest")
    run_dir = tempfile.mkdtemp(prefix="orc-")
    config = LocalRuntimeConfig(
        state_dir=str(tmp_path / "state"),
        workspace_dir=str(tmp_path / "sandboxes"),
        run_dir=run_dir,
        image_cache_dir=str(tmp_path / "images"),
        cgroup_parent=f"orchard-test-{uuid.uuid4().hex[:8]}",
    )
    runtime = LocalRuntime(config)
    await runtime.start()
    try:
        sandbox = await runtime.create(RuntimeSandboxSpec("from-archive", image))
        async with grpc.aio.insecure_channel(sandbox.agent_address) as channel:
            stub = agent_grpc.AgentServiceStub(channel)
            command = exec_pb2.Command(
                shell="busybox echo hello from the archive; cat /etc/image-layer; "
                "test -e /etc/motd || echo motd whited out"
            )
            reply = await stub.Exec(agent_pb.ExecRequest(command=command), timeout=60)
        assert reply.result.status.exit_code == 0, reply.result
        assert reply.result.stdout == b"hello from the archive\ntwo\nmotd whited out\n"
        # A second sandbox of the same image is served from the cache.
        await runtime.create(RuntimeSandboxSpec("from-cache", image))
        assert runtime.images.cache is not None and runtime.images.cache.unpacked == 1
        for sandbox_id in ("from-archive", "from-cache"):
            await runtime.delete(sandbox_id)
            assert await runtime.status(sandbox_id) is SandboxStatus.ABSENT
    finally:
        for sandbox_id in await runtime.list_sandboxes():
            await runtime.delete(sandbox_id)
        await runtime.close()
        assert runtime.remove_cgroup_parents() == []
        shutil.rmtree(run_dir, ignore_errors=True)
