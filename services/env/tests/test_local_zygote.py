"""The local runtime with sandboxes forked from the agent's zygote (``agent_launch: zygote``).

Until the runtime has the ``agent_launch`` setting, the fixture routes the runtime's one spawn
call through :class:`AgentZygote`; everything else is the real runtime.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orchard.env.exec_lane import LaneClient
from orchard.env.runtime.base import RuntimeResources, RuntimeSandboxSpec, SandboxStatus
from orchard.env.runtime.local import LocalRuntime, LocalRuntimeConfig
from orchard.env.runtime.local.cgroups import CgroupV1
from orchard.env.runtime.local.process import process_start_time
from orchard.env.runtime.local.zygote import AgentZygote
from orchard.inagent.v1 import inagent_service_pb2 as agent_pb
from orchard.inagent.v1 import inagent_service_pb2_grpc as agent_grpc
from orchard.types.v1 import exec_pb2

pytestmark = [pytest.mark.root]


class ZygoteRuntime:
    """A LocalRuntime whose sandboxes come from a zygote, and the zygote."""

    def __init__(self, runtime: LocalRuntime, zygote: AgentZygote) -> None:
        self.runtime = runtime
        self.zygote = zygote

    async def exec(self, sandbox_id: str, shell: str) -> exec_pb2.ExecResult:
        address = f"unix:{self.runtime.config.run_dir}/{sandbox_id}/agent.sock"
        async with grpc.aio.insecure_channel(address) as channel:
            stub = agent_grpc.AgentServiceStub(channel)
            reply = await stub.Exec(
                agent_pb.ExecRequest(command=exec_pb2.Command(shell=shell)), timeout=30
            )
        result: exec_pb2.ExecResult = reply.result
        return result


@pytest.fixture
async def zr(tmp_path: Path) -> AsyncIterator[ZygoteRuntime]:
    run_dir = tempfile.mkdtemp(prefix="orc-")
    # The zygote runs the agent from this interpreter: the bundle only needs to exist.
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "orchard-inagent").write_bytes(b"")
    (bundle / "orchard-inagent").chmod(0o755)
    config = LocalRuntimeConfig(
        state_dir=str(tmp_path / "state"),
        workspace_dir=str(tmp_path / "sandboxes"),
        run_dir=run_dir,
        cgroup_parent=f"orchard-test-{uuid.uuid4().hex[:8]}",
        agent_bundle=str(bundle),
        agent_launch="zygote",
    )
    runtime = LocalRuntime(config)
    await runtime.start()
    assert runtime._zygote is not None
    try:
        yield ZygoteRuntime(runtime, runtime._zygote)
    finally:
        for sandbox_id in await runtime.list_sandboxes():
            await runtime.delete(sandbox_id)
        await runtime.close()
        assert runtime.remove_cgroup_parents() == []
        shutil.rmtree(run_dir, ignore_errors=True)


def _status_field(pid: int, name: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {name} in /proc/{pid}/status")


async def test_the_agent_is_pid_1_of_its_namespace_and_serves(zr: ZygoteRuntime) -> None:
    await zr.runtime.create(RuntimeSandboxSpec("zy-pid1", "host"))
    state = zr.runtime.store.read("zy-pid1")
    assert state is not None
    assert _status_field(state.pid, "NSpid").split() == [str(state.pid), "1"]
    # Reparented: neither the zygote nor the service is its parent.
    assert int(_status_field(state.pid, "PPid")) not in (zr.zygote.pid, os.getpid())
    result = await zr.exec("zy-pid1", "echo $$ $(hostname); cat /proc/1/status | head -1")
    assert result.status.exit_code == 0, result
    lines = result.stdout.decode().splitlines()
    assert lines[0].split()[1] == "zy-pid1"
    assert lines[1].startswith("Name:")


async def test_cgroup_limits_apply(zr: ZygoteRuntime) -> None:
    resources = RuntimeResources(cpu_millis=500, memory_bytes=300 << 20, pids=77)
    await zr.runtime.create(RuntimeSandboxSpec("zy-limits", "host", resources=resources))
    state = zr.runtime.store.read("zy-limits")
    assert state is not None
    driver = zr.runtime._driver()
    assert driver.tasks(state.cgroup_dirs) >= {state.pid}
    if isinstance(driver, CgroupV1):
        by = {c: f"{p}/zy-limits" for c, p in driver.by_controller.items()}
        assert Path(by["memory"], "memory.limit_in_bytes").read_text() == "314572800\n"
        assert Path(by["pids"], "pids.max").read_text() == "77\n"
    # The pids limit holds for commands too: the 78th task in the cgroup cannot start.
    result = await zr.exec("zy-limits", "for i in $(seq 100); do sleep 5 & done 2>&1; wait")
    assert b"fork" in result.stdout.lower() or b"resource" in result.stdout.lower(), result


async def test_sandboxes_outlive_the_zygote_and_a_new_one_takes_over(
    zr: ZygoteRuntime,
) -> None:
    await zr.runtime.create(RuntimeSandboxSpec("zy-before", "host"))
    first = zr.zygote.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    await asyncio.sleep(0.2)
    result = await zr.exec("zy-before", "echo still here")
    assert result.stdout == b"still here\n"
    await zr.runtime.create(RuntimeSandboxSpec("zy-after", "host"))
    assert zr.zygote.pid not in (None, first)
    assert (await zr.exec("zy-after", "echo new")).stdout == b"new\n"
    assert await zr.runtime.status("zy-before") is SandboxStatus.RUNNING


@pytest.mark.parametrize("on_demand", [False, True], ids=["grpc-at-start", "grpc-on-demand"])
async def test_nothing_is_imported_after_the_fork(zr: ZygoteRuntime, on_demand: bool) -> None:
    # ORCHARD_* variables take the agent's pydantic configuration path.
    spec = RuntimeSandboxSpec(
        "zy-audit", "host", env={"ORCHARD_TASK": "1"}, agent_grpc_on_demand=on_demand
    )
    await zr.runtime.create(spec)
    run = Path(zr.runtime.config.run_dir) / "zy-audit"
    address = f"unix:{run}/agent.sock"
    if on_demand:
        # The lane alone until asked; then gRPC starts in the sandbox, after pivot_root.
        assert not (run / "agent.sock").exists()
        lane = LaneClient(f"unix:{run}/agent.lane")
        try:
            echo = agent_pb.ExecRequest(command=exec_pb2.Command(argv=["echo", "lane"]))
            assert (await lane.exec(echo, 30)).result.stdout == b"lane\n"
            await lane.open_grpc(30)
        finally:
            lane.close()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = agent_grpc.AgentServiceStub(channel)
        await stub.GetAgentInfo(agent_pb.GetAgentInfoRequest(), timeout=30)
        await stub.Exec(
            agent_pb.ExecRequest(command=exec_pb2.Command(argv=["sh", "-c", "echo $ORCHARD_TASK"])),
            timeout=30,
        )
        slow = exec_pb2.Command(shell="sleep 5")
        slow.timeout.FromMilliseconds(100)
        timed_out = await stub.Exec(agent_pb.ExecRequest(command=slow), timeout=30)
        assert timed_out.result.status.timed_out
        async for _ in stub.ExecStream(
            agent_pb.ExecStreamRequest(command=exec_pb2.Command(shell="echo a; echo b >&2"))
        ):
            pass
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Exec(
                agent_pb.ExecRequest(command=exec_pb2.Command(shell="true", working_dir="/nope")),
                timeout=30,
            )
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND

        async def chunks() -> AsyncIterator[agent_pb.WriteFileRequest]:
            header = agent_pb.WriteFileHeader(path="/srv/zygote-files/f.txt", make_parents=True)
            yield agent_pb.WriteFileRequest(header=header)
            yield agent_pb.WriteFileRequest(data=b"hello")

        await stub.WriteFile(chunks(), timeout=30)
        read = stub.ReadFile(agent_pb.ReadFileRequest(path="/srv/zygote-files/f.txt"))
        data = b"".join([r.data async for r in read])
        assert data == b"hello"
        await stub.ListFiles(agent_pb.ListFilesRequest(path="/srv/zygote-files"), timeout=30)
        await stub.StatFile(agent_pb.StatFileRequest(path="/srv/zygote-files/f.txt"), timeout=30)
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.StatFile(agent_pb.StatFileRequest(path="/nope"), timeout=30)
    state = zr.runtime.store.read("zy-audit")
    assert state is not None
    os.kill(state.pid, signal.SIGTERM)  # the drain path too
    for _ in range(100):
        if await zr.runtime.status("zy-audit") is not SandboxStatus.RUNNING:
            break
        await asyncio.sleep(0.05)
    log = Path(state.paths.log).read_text()
    assert "late import" not in log, log


async def test_delete_leaves_nothing(zr: ZygoteRuntime) -> None:
    for n in range(3):
        await zr.runtime.create(RuntimeSandboxSpec(f"zy-del-{n}", "host"))
    pids = [state.pid for n in range(3) if (state := zr.runtime.store.read(f"zy-del-{n}"))]
    for n in range(3):
        await zr.runtime.delete(f"zy-del-{n}")
    assert await zr.runtime.list_sandboxes() == []
    for pid in pids:
        assert process_start_time(pid) is None  # gone, or a zombie for the host's init
    # The zygote's helpers are all collected, and the zygote holds no sandbox's descriptor.
    zygote = zr.zygote.pid
    assert zygote is not None
    await asyncio.sleep(1.5)
    children = Path(f"/proc/{zygote}/task/{zygote}/children").read_text().split()
    assert children == []
    fds = os.listdir(f"/proc/{zygote}/fd")
    assert len(fds) <= 4, [os.readlink(f"/proc/{zygote}/fd/{fd}") for fd in fds]


def test_readiness_check_takes_fd_numbers_above_1024() -> None:
    # Hundreds of sandboxes push the service's descriptors past select()'s 1024 limit.
    import resource

    from orchard.env.runtime.local.zygote import _readable_now

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Root may raise the hard limit too.
    raised = hard if hard == resource.RLIM_INFINITY else max(hard, 2048)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), raised))
    read_end, write_end = os.pipe()
    high = os.dup2(read_end, 2000)
    try:
        assert not _readable_now(high)
        os.write(write_end, b"x")
        assert _readable_now(high)
    finally:
        for fd in (read_end, write_end, high):
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
