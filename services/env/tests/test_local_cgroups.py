"""The local runtime's cgroup layer on v1 and v2 (the freezer, kill, limits) and the fork's
freeze of its source.

This build machine is cgroup v1 for cpu, memory and pids, with a cgroup2 tree that has no
controllers (a hybrid host). The v2 driver's freeze (``cgroup.freeze``, ``cgroup.events``),
kill (``cgroup.kill``), task moves and removal run against that real cgroup2 tree with a real
process; its limit files (``memory.max``, ``memory.swap.max``, ``pids.max``, ``cpu.max``) and
``memory.events`` can only be checked against a directory that mimics them, because no
controller is delegated to v2 here. Not checked on this machine: that the kernel enforces the
v2 limits, ``prepare`` enabling controllers in ``cgroup.subtree_control``, and a whole sandbox
on a v2 host.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.env.runtime.base import RuntimeResources, RuntimeSandboxSpec
from orchard.env.runtime.local import LocalRuntime, LocalRuntimeConfig, snapshots
from orchard.env.runtime.local import runtime as local_runtime_module
from orchard.env.runtime.local.cgroups import CgroupV1, CgroupV2, _mounts
from orchard.inagent.v1 import inagent_service_pb2 as agent_pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as agent_grpc
from orchard.types.v1 import exec_pb2

pytestmark = [pytest.mark.root]


@pytest.fixture
def cgroup2_root(tmp_path: Path) -> Iterator[str]:
    """A cgroup2 hierarchy: the host's, else one mounted for the test."""
    mount = next((m.point for m in _mounts() if m.fstype == "cgroup2"), None)
    if mount is not None:
        yield mount
        return
    point = tmp_path / "cgroup2"
    point.mkdir()
    subprocess.run(["mount", "-t", "cgroup2", "none", str(point)], check=True)
    try:
        yield str(point)
    finally:
        subprocess.run(["umount", str(point)], check=True)


@contextlib.contextmanager
def _ticker(path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process that writes a growing counter to ``path`` every 10 ms."""
    process = subprocess.Popen(
        ["sh", "-c", f"i=0; while :; do i=$((i+1)); echo $i > {path}; sleep 0.01; done"]
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


async def _changes(path: Path, timeout_s: float = 10.0) -> bool:
    before = path.read_text() if path.exists() else ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        if path.exists() and path.read_text() != before:
            return True
    return False


async def _check_freeze_and_kill(driver: Any, dirs: tuple[str, ...], tmp_path: Path) -> None:
    counter = tmp_path / "counter"
    with _ticker(counter) as process:
        assert await _changes(counter)
        driver.move(process.pid, dirs)
        assert process.pid in driver.tasks(dirs)
        assert driver.can_freeze(dirs)
        await driver.freeze(dirs)
        assert driver.is_frozen(dirs)
        assert not await _changes(counter, timeout_s=0.3)  # stopped while frozen
        driver.thaw(dirs)
        assert not driver.is_frozen(dirs)
        assert await _changes(counter)  # and running again after
        await driver.freeze(dirs)  # killing a frozen cgroup works too (delete does that)
        assert driver.kill_tasks(dirs) >= 1
        assert process.wait(timeout=10) == -9
    for _ in range(100):
        if driver.remove(dirs):
            break
        await asyncio.sleep(0.01)
    assert not any(os.path.exists(d) for d in dirs)


async def test_v2_freezes_thaws_and_kills_on_a_real_cgroup2_tree(
    cgroup2_root: str, tmp_path: Path
) -> None:
    parent = f"{cgroup2_root}/orchard-test-{uuid.uuid4().hex[:8]}"
    os.mkdir(parent)
    try:
        driver = CgroupV2((parent,))
        dirs = driver.dirs_for("sandbox")
        os.mkdir(dirs[0])
        assert Path(dirs[0], "cgroup.kill").exists()  # the atomic kill path is the one tested
        await _check_freeze_and_kill(driver, dirs, tmp_path)
    finally:
        os.rmdir(parent)


class _V2WithoutControllers(CgroupV2):
    """The v2 driver on this machine's cgroup2 tree, which has no controllers delegated: limit
    files cannot be written there (they are checked apart, against a mimic directory)."""

    def _limit(self, dirs: tuple[str, ...], resources: RuntimeResources) -> None:
        pass


def test_v2_takes_a_pooled_cgroup_over_by_moving_its_task(cgroup2_root: str) -> None:
    parent = f"{cgroup2_root}/orchard-test-{uuid.uuid4().hex[:8]}"
    os.mkdir(parent)
    process = subprocess.Popen(["sleep", "600"])
    try:
        driver = _V2WithoutControllers((parent,))
        shell = driver.create("_shell-0123456789ab", RuntimeResources())
        driver.move(process.pid, shell)
        # v2 cannot rename a cgroup: the task moves into a new one and the old one goes.
        dirs = driver.take_over(shell, process.pid, "sandbox", RuntimeResources())
        assert dirs == (f"{parent}/sandbox",)
        assert driver.tasks(dirs) == {process.pid}
        assert not os.path.exists(shell[0])
        driver.kill_tasks(dirs)
        assert process.wait(timeout=10) == -9
        for _ in range(100):
            if driver.remove(dirs):
                break
            time.sleep(0.01)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.rmdir(parent)


async def test_v1_takes_a_pooled_cgroup_over_by_renaming_it() -> None:
    driver = CgroupV1.discover(f"orchard-test-{uuid.uuid4().hex[:8]}")
    driver.prepare()
    process = subprocess.Popen(["sleep", "600"])
    try:
        shell = driver.create("_shell-0123456789ab", RuntimeResources(memory_bytes=1 << 30))
        driver.move(process.pid, shell)
        bigger = RuntimeResources(memory_bytes=3 << 30, pids=33)
        dirs = driver.take_over(shell, process.pid, "sandbox", bigger)
        assert dirs == driver.dirs_for("sandbox") and not any(os.path.exists(d) for d in shell)
        assert driver.tasks(dirs) == {process.pid}
        memory = dirs[driver.parents.index(driver.by_controller["memory"])]
        assert int(Path(memory, "memory.limit_in_bytes").read_text()) == 3 << 30
        pids = dirs[driver.parents.index(driver.by_controller["pids"])]
        assert Path(pids, "pids.max").read_text().strip() == "33"
        driver.kill_tasks(dirs)
        assert process.wait(timeout=10) == -9
        for _ in range(100):
            if driver.remove(dirs):
                break
            await asyncio.sleep(0.01)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for parent in driver.parents:
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(parent)


def test_v2_limits_and_oom_count_land_in_their_files(tmp_path: Path) -> None:
    # A directory standing in for a v2 cgroup whose controllers are delegated (none is here).
    directory = tmp_path / "sandbox"
    directory.mkdir()
    for name in ("memory.max", "memory.swap.max", "pids.max", "cpu.max"):
        (directory / name).write_text("max\n")
    (directory / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    driver = CgroupV2((str(tmp_path),))
    driver._limit(
        (str(directory),), RuntimeResources(cpu_millis=1500, memory_bytes=1 << 30, pids=64)
    )
    assert (directory / "memory.max").read_text() == str(1 << 30)
    assert (directory / "memory.swap.max").read_text() == "0"
    assert (directory / "pids.max").read_text() == "64"
    assert (directory / "cpu.max").read_text() == "150000 100000"
    assert driver.oom_kills((str(directory),)) == 2
    driver._limit((str(directory),), RuntimeResources())  # zero: unlimited pids, others kept
    assert (directory / "pids.max").read_text() == "max"


def test_v1_takes_the_least_cpu_the_service_allows() -> None:
    """The smallest `cpu_millis` orchard-env accepts is a quota the kernel takes (1 ms per
    100 ms period); one below it is what the kernel refuses (EINVAL), as the fuzzer found."""
    from orchard.env.validation import MIN_RESOURCES

    least = MIN_RESOURCES["cpu_millis"]
    driver = CgroupV1.discover(f"orchard-test-{uuid.uuid4().hex[:8]}")
    driver.prepare()
    try:
        dirs = driver.create("sandbox", RuntimeResources(cpu_millis=least))
        cpu = dirs[driver.parents.index(driver.by_controller["cpu"])]
        assert int(Path(cpu, "cpu.cfs_quota_us").read_text()) == least * 100
        with pytest.raises(OSError):
            driver._limit(dirs, RuntimeResources(cpu_millis=least - 1))
        assert driver.remove(dirs)
    finally:
        for parent in driver.parents:
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(parent)


async def test_v1_freezer_freezes_thaws_and_kills(tmp_path: Path) -> None:
    driver = CgroupV1.discover(f"orchard-test-{uuid.uuid4().hex[:8]}")
    assert "freezer" in driver.by_controller  # mounted on this machine
    driver.prepare()
    try:
        dirs = driver.create("sandbox", RuntimeResources(pids=100))
        await _check_freeze_and_kill(driver, dirs, tmp_path)
    finally:
        for parent in driver.parents:
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(parent)


# -- fork freezes its source --------------------------------------------------------------

WRITER = """
import os
fd = os.open("/data", os.O_RDWR | os.O_CREAT, 0o644)
i = 0
while True:
    os.pwrite(fd, bytes([65 + i % 26]) * (4 << 20), 0)  # 4 MiB of one letter, in place
    i += 1
"""


@pytest.fixture
async def runtime(tmp_path: Path) -> Any:
    run_dir = tempfile.mkdtemp(prefix="orc-")
    config = LocalRuntimeConfig(
        state_dir=str(tmp_path / "state"),
        workspace_dir=str(tmp_path / "sandboxes"),
        run_dir=run_dir,
        cgroup_parent=f"orchard-test-{uuid.uuid4().hex[:8]}",
        pool_size=0,
    )
    runtime = LocalRuntime(config)
    await runtime.start()
    try:
        yield runtime
    finally:
        for sandbox_id in await runtime.list_sandboxes():
            await runtime.delete(sandbox_id)
        await runtime.close()
        assert runtime.remove_cgroup_parents() == []
        shutil.rmtree(run_dir, ignore_errors=True)


def _in_layers(state: Any, name: str) -> Path:
    """Where a sandbox's overlay finds ``name``: its upper layer, else its snapshot layers."""
    for layer in (state.paths.upper, *state.snapshot_layers):
        if Path(layer, name).exists():
            return Path(layer, name)
    raise AssertionError(f"{name} is in no layer of {state.sandbox_id}")


@pytest.mark.parametrize("snapshot", [True, False], ids=["shared-snapshot", "copy-per-fork"])
async def test_a_fork_copies_a_source_that_writes_all_along_without_tearing(
    runtime: LocalRuntime, monkeypatch: pytest.MonkeyPatch, snapshot: bool
) -> None:
    if not snapshot:
        limit = {"fork_snapshot_max_bytes": 0}
        monkeypatch.setattr(runtime, "config", runtime.config.model_copy(update=limit))
    source = RuntimeSandboxSpec("source", "host", resources=RuntimeResources(cpu_millis=400))
    await runtime.create(source)
    state = runtime.store.read("source")
    assert state is not None
    data = Path(state.paths.upper, "data")
    Path(state.paths.upper, "writer.py").write_text(WRITER)
    # A command of the sandbox, left running in the background.
    await _exec(runtime, "source", "setsid python3 /writer.py </dev/null >/dev/null 2>&1 &")
    deadline = time.monotonic() + 20
    while not (data.exists() and data.stat().st_size == 4 << 20):
        assert time.monotonic() < deadline, "the writer did not start"
        await asyncio.sleep(0.05)
    frozen_during_copy = []
    copy = snapshots.copy_tree

    async def observed_copy(*args: Any) -> None:
        frozen_during_copy.append(runtime._driver().is_frozen(state.cgroup_dirs))
        await copy(*args)

    monkeypatch.setattr(snapshots, "copy_tree", observed_copy)
    monkeypatch.setattr(local_runtime_module, "copy_tree", observed_copy)
    for index in range(4):
        await runtime.fork("source", RuntimeSandboxSpec(f"fork-{index}", "host"))
        forked = runtime.store.read(f"fork-{index}")
        assert forked is not None
        assert len(forked.snapshot_layers) == (1 if snapshot else 0)
        content = _in_layers(forked, "data").read_bytes()
        assert len(content) == 4 << 20
        assert len(set(content)) == 1, f"fork {index}: torn copy, {len(set(content))} letters"
        assert not runtime._driver().is_frozen(state.cgroup_dirs)
        await runtime.delete(f"fork-{index}")
    assert frozen_during_copy == [True] * 4
    # Thawed: the source's writer goes on.
    before = data.read_bytes()[:1]
    deadline = time.monotonic() + 10
    while data.read_bytes()[:1] == before:
        assert time.monotonic() < deadline, "the source stayed frozen"
        await asyncio.sleep(0.02)
    assert await _exec(runtime, "source", "echo answers") == "answers\n"


async def _exec(runtime: LocalRuntime, sandbox_id: str, shell: str) -> str:
    address = f"unix:{runtime.config.run_dir}/{sandbox_id}/agent.sock"
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await agent_grpc.AgentServiceStub(channel).Exec(
            agent_pb.ExecRequest(command=exec_pb2.Command(shell=shell)), timeout=30
        )
    assert reply.result.status.exit_code == 0, reply.result.stderr
    return str(reply.result.stdout.decode())
