"""Pooled sandboxes of the local runtime (``pool_size``, ``pool_image``): claimed at create,
as isolated as a fresh sandbox, refilled, released at close, and found after a crash."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.env.exec_lane import LaneClient
from orchard.env.runtime.base import RuntimeResources, RuntimeSandboxSpec
from orchard.env.runtime.local import LocalRuntime, LocalRuntimeConfig
from orchard.env.runtime.local.pool import SHELL_ID
from orchard.env.runtime.local.process import process_start_time
from orchard.inagent.v1 import inagent_service_pb2 as agent_pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as agent_grpc
from orchard.types.v1 import exec_pb2

pytestmark = [pytest.mark.root]

# sandbox_init.KEPT_CAPABILITIES: what a fresh sandbox's commands keep.
KEPT_MASK = sum(1 << cap for cap in (0, 1, 3, 4, 5, 6, 7, 8, 10, 18, 29, 31))


def _config(base: Path, run_dir: str, **overrides: Any) -> LocalRuntimeConfig:
    fields: dict[str, Any] = {
        "state_dir": str(base / "state"),
        "workspace_dir": str(base / "sandboxes"),
        "run_dir": run_dir,
        "cgroup_parent": f"orchard-test-{uuid.uuid4().hex[:8]}",
        "pool_size": 2,
        "pool_image": "host",
    }
    fields.update(overrides)
    return LocalRuntimeConfig(**fields)


@pytest.fixture
async def pooled(tmp_path: Path) -> AsyncIterator[LocalRuntime]:
    run_dir = tempfile.mkdtemp(prefix="orc-")
    runtime = LocalRuntime(_config(tmp_path, run_dir))
    await runtime.start()
    try:
        yield runtime
    finally:
        for sandbox_id in await runtime.list_sandboxes():
            await runtime.delete(sandbox_id)
        await runtime.close()
        assert runtime.remove_cgroup_parents() == []
        shutil.rmtree(run_dir, ignore_errors=True)


async def _exec(runtime: LocalRuntime, sandbox_id: str, shell: str) -> str:
    address = f"unix:{runtime.config.run_dir}/{sandbox_id}/agent.sock"
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await agent_grpc.AgentServiceStub(channel).Exec(
            agent_pb.ExecRequest(command=exec_pb2.Command(shell=shell)), timeout=30
        )
    assert reply.result.status.exit_code == 0, reply.result.stderr
    return str(reply.result.stdout.decode())


def _shells_on_disk(runtime: LocalRuntime) -> set[str]:
    """Every trace of a pooled sandbox: state files, directories, cgroups."""
    found = set(runtime.store.ids()) | runtime._driver().ids()
    for directory in (runtime.config.workspace_dir, runtime.config.run_dir):
        if os.path.isdir(directory):
            found.update(os.listdir(directory))
    return {name for name in found if SHELL_ID.fullmatch(name)}


def _shell_pids(runtime: LocalRuntime) -> set[int]:
    pids = set()
    for shell_id in _shells_on_disk(runtime):
        state = runtime.store.read(shell_id)
        if state is not None and state.pid:
            pids.add(state.pid)
    return pids


async def _until(check: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_a_claimed_sandbox_is_the_requests_and_as_isolated_as_a_fresh_one(
    pooled: LocalRuntime,
) -> None:
    assert len(pooled._pool) >= 1  # start returns with one built for pool_image
    waiting = _shell_pids(pooled)
    spec = RuntimeSandboxSpec(
        "claimed",
        "host",
        env={"GREETING": "hi", "ORCHARD_X": "y"},
        working_dir="/srv/deep/dir",
        resources=RuntimeResources(pids=77, memory_bytes=300 << 20),
    )
    await pooled.create(spec)
    state = pooled.store.read("claimed")
    assert state is not None and state.pid in waiting  # a pooled PID 1, not a new one
    assert state.paths.workspace.endswith("/claimed") and os.path.isdir(state.paths.upper)
    out = await _exec(
        pooled,
        "claimed",
        "hostname; pwd; echo $GREETING; echo ${ORCHARD_X:-unset}; "
        "grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status; "
        "cat /proc/1/cgroup",
    )
    lines = out.splitlines()
    assert lines[:4] == ["claimed", "/srv/deep/dir", "hi", "y"], lines
    status = dict(line.split(":\t") for line in lines[4:8])
    assert int(status["CapBnd"], 16) == KEPT_MASK
    assert int(status["CapEff"], 16) == KEPT_MASK
    assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"
    # PID 1 now lives in the sandbox's own cgroups, with the request's limits.
    cgroup_lines = [line for line in lines[8:] if ":" in line and "/" in line]
    for controller in ("memory", "pids"):
        (line,) = [c for c in cgroup_lines if f":{controller}:" in c]
        assert line.endswith("/claimed"), cgroup_lines
    pids_dir = next(d for d in state.cgroup_dirs if "/pids/" in d)
    assert Path(pids_dir, "pids.max").read_text().strip() == "77"
    memory_dir = next(d for d in state.cgroup_dirs if "/memory/" in d)
    assert int(Path(memory_dir, "memory.limit_in_bytes").read_text()) == 300 << 20
    # The runtime's own directories stay hidden as in any host sandbox.
    config = pooled.config
    listing = await _exec(pooled, "claimed", f"ls -A {config.run_dir} {config.state_dir}")
    assert listing.split() == [f"{config.run_dir}:", f"{config.state_dir}:"]
    # The claim FIFO is gone; the claimed shell left no trace under its pooled name.
    assert sorted(os.listdir(state.paths.run)) == ["agent.lane", "agent.sock"]
    assert all(pid != state.pid for pid in _shell_pids(pooled))
    # Limits above the ones the shell was built with are taken too.
    await _until(lambda: len(pooled._pool) >= 1)
    waiting = _shell_pids(pooled)
    bigger = RuntimeResources(memory_bytes=pooled.config.default_resources.memory_bytes * 2)
    # (and the agent's gRPC on demand: a claim carries the agent's flags)
    await pooled.create(
        RuntimeSandboxSpec("bigger", "host", resources=bigger, agent_grpc_on_demand=True)
    )
    state = pooled.store.read("bigger")
    assert state is not None and state.pid in waiting
    memory_dir = next(d for d in state.cgroup_dirs if "/memory/" in d)
    assert int(Path(memory_dir, "memory.limit_in_bytes").read_text()) == bigger.memory_bytes
    assert sorted(os.listdir(state.paths.run)) == ["agent.lane"]
    lane = LaneClient(f"unix:{state.paths.run}/agent.lane")
    try:
        hostname = agent_pb.ExecRequest(command=exec_pb2.Command(argv=["hostname"]))
        assert (await lane.exec(hostname, 30)).result.stdout == b"bigger\n"
        await lane.open_grpc(30)
    finally:
        lane.close()
    assert sorted(os.listdir(state.paths.run)) == ["agent.lane", "agent.sock"]


async def test_the_pool_refills_and_close_releases_every_shell(tmp_path: Path) -> None:
    run_dir = tempfile.mkdtemp(prefix="orc-")
    runtime = LocalRuntime(_config(tmp_path, run_dir, pool_image=""))
    await runtime.start()
    try:
        assert len(runtime._pool) == 0  # no image known yet: nothing built
        await runtime.create(RuntimeSandboxSpec("first", "host"))  # fresh; the pool fills
        await _until(lambda: len(runtime._pool) == 2)
        await runtime.create(RuntimeSandboxSpec("second", "host"))
        await _until(lambda: len(runtime._pool) == 2)  # refilled after the claim
        assert await runtime.list_sandboxes() == ["first", "second"]  # live shells are not
        pids = _shell_pids(runtime)
        assert len(pids) == 2
        for sandbox_id in ("first", "second"):
            await runtime.delete(sandbox_id)
    finally:
        await runtime.close()
    try:
        assert _shells_on_disk(runtime) == set()
        assert all(process_start_time(pid) is None for pid in pids)
        assert runtime.remove_cgroup_parents() == []
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


async def test_creates_the_pool_cannot_serve_start_afresh(pooled: LocalRuntime) -> None:
    waiting = _shell_pids(pooled)
    # Another image's layers, and a disk limit: neither fits a shell built for the host image.
    other = Path(pooled.config.workspace_dir).parent / "tiny-root"
    for name in ("bin", "etc"):
        (other / name).mkdir(parents=True)
    await pooled.create(RuntimeSandboxSpec("other-image", f"rootfs:{other}"))
    limited = RuntimeResources(disk_bytes=64 << 20)
    await pooled.create(RuntimeSandboxSpec("limited", "host", resources=limited))
    for sandbox_id in ("other-image", "limited"):
        state = pooled.store.read(sandbox_id)
        assert state is not None and state.pid not in waiting
    assert _shell_pids(pooled) >= waiting  # pinned to pool_image: kept for the next create
    waiting = _shell_pids(pooled)
    await pooled.create(RuntimeSandboxSpec("pooled", "host"))
    state = pooled.store.read("pooled")
    assert state is not None and state.pid in waiting


async def test_shells_end_with_a_crashed_runtime_and_are_found_as_leftovers(
    tmp_path: Path,
) -> None:
    run_dir = tempfile.mkdtemp(prefix="orc-")
    config = _config(tmp_path, run_dir)
    # The first runtime runs in its own process, which is then killed without any cleanup.
    script = textwrap.dedent(
        f"""
        import asyncio, json, sys
        from orchard.env.runtime.local import LocalRuntime, LocalRuntimeConfig

        async def main():
            config = LocalRuntimeConfig.model_validate_json({config.model_dump_json()!r})
            runtime = LocalRuntime(config)
            await runtime.start()
            while len(runtime._pool) < 2:
                await asyncio.sleep(0.02)
            print("ready", flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    other = LocalRuntime(config.model_copy(update={"pool_size": 0}))
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), 60)
        assert line.strip() == "ready", process.stderr.read() if process.stderr else ""
        # A second runtime on the same directories (another replica) leaves live shells alone.
        await other.start()
        shells = _shells_on_disk(other)
        pids = _shell_pids(other)
        assert len(shells) == 2 and len(pids) == 2
        assert await other.list_sandboxes() == []
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        # With their runtime gone, the shells see end-of-file on their claim and exit.
        await _until(lambda: all(process_start_time(pid) is None for pid in pids))
        assert sorted(await other.list_sandboxes()) == sorted(shells)  # reconcile's leftovers
        for shell_id in shells:
            await other.delete(shell_id)
        assert _shells_on_disk(other) == set()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()
        if other._started:
            for sandbox_id in await other.list_sandboxes():
                await other.delete(sandbox_id)
            await other.close()
            assert other.remove_cgroup_parents() == []
        shutil.rmtree(run_dir, ignore_errors=True)


async def test_a_restarted_runtime_removes_the_shells_of_the_one_before(tmp_path: Path) -> None:
    run_dir = tempfile.mkdtemp(prefix="orc-")
    config = _config(tmp_path, run_dir, pool_size=1)
    first = LocalRuntime(config)
    await first.start()
    shells = _shells_on_disk(first)
    assert len(shells) == 1
    # A crash as the pool sees it: the claim FIFO's writer goes, nothing is deleted.
    for shell in first._pool._ready:
        shell.close_fds()
    first._pool._ready.clear()
    await first.close()
    second = LocalRuntime(config.model_copy(update={"pool_size": 0}))
    await second.start()
    try:
        assert _shells_on_disk(second) == set()
        assert json.dumps(await second.list_sandboxes()) == "[]"
    finally:
        await second.close()
        assert second.remove_cgroup_parents() == []
        shutil.rmtree(run_dir, ignore_errors=True)
