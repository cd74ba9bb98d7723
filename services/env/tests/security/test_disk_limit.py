"""``disk_bytes`` holds: a sandbox of the real ``local`` runtime that writes past its disk gets
"No space left on device", the host gives it no more than the limit, the operator's default
applies to specs that set none, forks keep working, and delete (or a crash) leaks no mount, loop
device or image file."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from orchard.env.config import LimitsConfig
from orchard.env.runtime.base import RuntimeResources, RuntimeSandboxSpec
from orchard.env.v1 import env_pb2
from orchard.env.v1 import env_service_pb2 as api
from orchard.types.v1 import exec_pb2, resources_pb2

pytestmark = [pytest.mark.root, pytest.mark.slow]

MB = 1024 * 1024


async def run(env: Any, sandbox_id: str, script: str, timeout_s: float = 60) -> Any:
    command = exec_pb2.Command(shell=script)
    command.timeout.FromNanoseconds(int(timeout_s * 1e9))
    request = api.ExecRequest(sandbox_id=sandbox_id, command=command)
    return (await env.stub.Exec(request, metadata=env.md(), timeout=timeout_s + 30)).result


def allocated(path: str) -> int:
    """Bytes the host's file system holds for ``path`` (a sparse file holds less than its size)."""
    return os.stat(path).st_blocks * 512


def loop_devices_of(directory: Path) -> list[str]:
    listing = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True)
    return [line for line in listing.stdout.splitlines() if str(directory) in line]


async def loop_devices_left(directory: Path, settle_s: float = 10.0) -> list[str]:
    """Loop devices still backed by files under ``directory`` once they had ``settle_s`` to go.

    A lazy unmount hands the file system's last release to the kernel's deferred work, and an
    autoclear loop device detaches only then: a few milliseconds after delete returns, not
    before. A leak is a device that stays."""
    deadline = time.monotonic() + settle_s
    while (left := loop_devices_of(directory)) and time.monotonic() < deadline:
        await _sleep()
    return left


def mounts_under(directory: Path) -> list[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as file:
        return [line for line in file if f" {directory}/" in line]


async def test_writing_past_disk_bytes_fails_with_enospc_and_takes_no_more_host_space(
    isolated: Any, local_runtime: Any, attack: Any
) -> None:
    resources = resources_pb2.Resources(disk_bytes=100 * MB)
    sandbox = await isolated.ready(resources=resources, timeout_s=120)
    state = local_runtime.store.read(sandbox.id)
    image = state.paths.disk_image
    attack.tried("write 200 MB with disk=100M")
    free_before = os.statvfs(local_runtime.config.workspace_dir)
    wrote = await run(
        isolated,
        sandbox.id,
        "dd if=/dev/zero of=/big bs=1M count=200 2>&1; echo dd=$?; sync; stat -c %s /big",
    )
    assert b"dd=1\n" in wrote.stdout, wrote.stdout
    assert b"No space left on device" in wrote.stdout, wrote.stdout
    size = int(wrote.stdout.split(b"\n")[-2])
    assert 50 * MB < size <= 100 * MB, size
    assert allocated(image) <= 100 * MB
    free_after = os.statvfs(local_runtime.config.workspace_dir)
    used = (free_before.f_bavail - free_after.f_bavail) * free_after.f_frsize
    assert used < 100 * MB + 16 * MB, used  # other writers on the host only add noise
    attack.held("write 200 MB with disk=100M")

    # The sandbox works on once the space is freed again.
    again = await run(isolated, sandbox.id, "rm /big && echo ok > /small && cat /small")
    assert again.stdout == b"ok\n", again

    workspace = Path(state.paths.workspace)
    await isolated.stub.DeleteSandbox(
        api.DeleteSandboxRequest(sandbox_id=sandbox.id), metadata=isolated.md()
    )
    deadline = time.monotonic() + 30
    while workspace.exists() and time.monotonic() < deadline:
        await _sleep()
    assert not workspace.exists()
    assert not mounts_under(workspace.parent)
    assert not await loop_devices_left(workspace.parent)


async def test_the_operators_default_disk_applies_to_specs_without_one(
    env_factory: Any, local_runtime: Any, attack: Any
) -> None:
    env = await env_factory(runtime=local_runtime, limits=LimitsConfig(default_disk_bytes=64 * MB))
    sandbox = await env.ready(timeout_s=120)
    assert local_runtime.store.read(sandbox.id).paths.disk_bytes == 64 * MB
    attack.tried("write 100 MB with no disk limit in the spec (default 64M)")
    wrote = await run(env, sandbox.id, "dd if=/dev/zero of=/big bs=1M count=100 2>&1")
    assert wrote.status.exit_code != 0 and b"No space left on device" in wrote.stdout, wrote
    attack.held("write 100 MB with no disk limit in the spec (default 64M)")


async def test_a_fork_gets_a_copy_on_a_disk_of_its_own(isolated: Any, local_runtime: Any) -> None:
    resources = resources_pb2.Resources(disk_bytes=64 * MB)
    sandbox = await isolated.ready(resources=resources, timeout_s=120)
    await run(isolated, sandbox.id, "dd if=/dev/zero of=/half bs=1M count=20 && echo a > /mark")
    forked = await isolated.stub.ForkSandbox(
        api.ForkSandboxRequest(sandbox_id=sandbox.id, count=1), metadata=isolated.md()
    )
    fork_id = forked.sandboxes[0].id
    fork = await isolated.wait(fork_id, timeout_s=60)
    assert fork.state == env_pb2.SANDBOX_STATE_READY, fork
    state = local_runtime.store.read(fork_id)
    assert state.paths.disk_bytes and os.path.ismount(state.paths.layer)
    seen = await run(isolated, fork_id, "cat /mark; stat -c %s /half")
    assert seen.stdout == b"a\n20971520\n", seen
    # Its disk is its own: filling it leaves the source's free space as it was.
    await run(isolated, fork_id, "dd if=/dev/zero of=/fill bs=1M count=100 2>/dev/null")
    source_free = await run(isolated, sandbox.id, "echo more > /more && cat /more")
    assert source_free.stdout == b"more\n"


async def test_a_crash_after_the_mount_leaks_nothing(local_runtime: Any) -> None:
    """A create that died right after mounting (state file, workspace and mount, no process)
    is listed, and delete unmounts, detaches and removes it."""
    from orchard.env.runtime.local.disk import make_layer_disk
    from orchard.env.runtime.local.state import SandboxPaths, SandboxState

    sandbox_id = "crashed-disk"
    workspace = os.path.join(local_runtime.config.workspace_dir, sandbox_id)
    paths = SandboxPaths(workspace, os.path.join(local_runtime.config.run_dir, sandbox_id), 32 * MB)
    local_runtime.store.write(SandboxState(sandbox_id, "host", paths))
    os.makedirs(workspace, mode=0o700)
    await make_layer_disk(paths.disk_image, paths.layer, paths.disk_bytes)
    Path(paths.layer, "data").write_bytes(b"x" * MB)
    # Restarted service: the state file is lost too, only the directory remains.
    local_runtime.store.remove(sandbox_id)
    assert sandbox_id in await local_runtime.list_sandboxes()
    assert loop_devices_of(Path(workspace))
    await local_runtime.delete(sandbox_id)
    assert not os.path.exists(workspace)
    assert not mounts_under(Path(local_runtime.config.workspace_dir))
    assert not await loop_devices_left(Path(workspace))


async def test_create_cost_with_and_without_a_disk_limit(local_runtime: Any) -> None:
    """Not a bound, a measurement: printed in the summary (create only, sequential, p50)."""
    from orchard.env.runtime.local import LocalRuntime
    from orchard.env.runtime.local.config import LocalResources

    from .conftest import SUMMARY_LINES

    config = local_runtime.config.model_copy(
        update={"default_resources": LocalResources(disk_bytes=0)}
    )
    unlimited = LocalRuntime(config)  # same directories and cgroups, no default disk
    await unlimited.start()
    timings: dict[str, list[float]] = {"no limit": [], "1 GiB": [], "10 GiB": []}
    disks = {"no limit": 0, "1 GiB": 1 << 30, "10 GiB": 10 << 30}
    try:
        for round_ in range(7):
            for name, disk in disks.items():
                sandbox_id = f"cost-{disk}-{round_}"
                spec = RuntimeSandboxSpec(
                    sandbox_id, "host", resources=RuntimeResources(disk_bytes=disk)
                )
                started = time.monotonic()
                await unlimited.create(spec)
                timings[name].append(time.monotonic() - started)
                assert unlimited.store.read(sandbox_id).paths.disk_bytes == disk
                await unlimited.delete(sandbox_id)
    finally:
        await unlimited.close()
    medians = {name: sorted(values)[len(values) // 2] for name, values in timings.items()}
    SUMMARY_LINES.append(
        "local create p50: "
        + ", ".join(f"{name} {seconds * 1000:.0f} ms" for name, seconds in medians.items())
    )


async def _sleep() -> None:
    import asyncio

    await asyncio.sleep(0.05)
