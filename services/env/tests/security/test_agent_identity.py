"""orchard-env talks only to the agent it launched: a process in the sandbox cannot take the
agent's place, not even across a restart of the service (which reconnects from the record).

The attack: from inside the sandbox, move the agent's socket aside and serve an impostor
``AgentService`` at its path that forges every Exec result; restart the service; exec.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

pytestmark = [pytest.mark.root, pytest.mark.slow]

FORGED = "forged-by-the-sandbox"
# Runs inside the sandbox (the host image, so the service's own interpreter and stubs).
IMPOSTOR = """
import asyncio, os
import grpc
from orchard.inagent.v1 import inagent_service_pb2 as pb, inagent_service_pb2_grpc as pb_grpc
from orchard.types.v1 import exec_pb2

STATE = "/tmp/impostor.state"
target = "/.orchard/run/agent.sock"  # where the agent listened, as the sandbox saw it
found = os.path.exists(target)
os.makedirs(os.path.dirname(target), exist_ok=True)
if found:
    os.rename(target, target + ".real")

class Impostor(pb_grpc.AgentServiceServicer):
    async def Exec(self, request, context):
        with open("/tmp/impostor.calls", "a") as log:
            log.write("Exec\\n")
        return pb.ExecResponse(result=exec_pb2.ExecResult(stdout=b"FORGED"))

async def main():
    server = grpc.aio.server()
    pb_grpc.add_AgentServiceServicer_to_server(Impostor(), server)
    server.add_insecure_port("unix:" + target)
    await server.start()
    with open(STATE, "w") as state:
        state.write(("replaced " if found else "no-socket-found ") + target)
    await server.wait_for_termination()

asyncio.run(main())
""".replace("FORGED", FORGED)


@pytest.fixture
async def runtimes(tmp_path: Path) -> AsyncIterator[Callable[[], Any]]:
    """Starts local runtimes over one set of directories (each a restarted service's); deletes
    every sandbox and closes them all at the end."""
    from orchard.env.runtime.base import RuntimeUnavailable
    from orchard.env.runtime.local import LocalRuntime, LocalRuntimeConfig

    run_dir = tempfile.mkdtemp(prefix="orc-")
    config = LocalRuntimeConfig(
        state_dir=str(tmp_path / "state"),
        workspace_dir=str(tmp_path / "sandboxes"),
        run_dir=run_dir,
        cgroup_parent=f"orchard-test-{uuid.uuid4().hex[:8]}",
    )
    started: list[Any] = []

    async def start() -> Any:
        runtime = LocalRuntime(config)
        try:
            await runtime.start()
        except RuntimeUnavailable as exc:
            pytest.fail(f"the local runtime cannot run here: {exc}")
        started.append(runtime)
        return runtime

    try:
        yield start
        if started:
            last = started[-1]
            for sandbox_id in await last.list_sandboxes():
                await last.delete(sandbox_id)
    finally:
        for runtime in started:
            await runtime.close()
        parents = getattr(getattr(started[-1], "_cgroups", None), "parents", ()) if started else ()
        for parent in parents:
            if os.path.isdir(parent):
                os.rmdir(parent)
        shutil.rmtree(run_dir, ignore_errors=True)


async def test_a_sandbox_cannot_replace_its_agent_across_a_restart(
    env_factory: Any, runtimes: Callable[[], Any], attack: Any
) -> None:
    first = await env_factory(runtime=await runtimes())
    sandbox = await first.ready(timeout_s=60)
    # The agent's socket is nowhere in the sandbox, and PID 1's descriptors are out of reach.
    seen = await first.shell(sandbox.id, "ls -a /.orchard; ls /.orchard/run; cat /proc/1/fd/*")
    assert b"agent.sock" not in seen.stdout and b"run" not in seen.stdout, seen

    attack.tried("serve an impostor agent at the agent's socket")
    await first.shell(sandbox.id, f"cat > /tmp/impostor.py <<'EOF'\n{IMPOSTOR}\nEOF")
    started = await first.shell(
        sandbox.id, f"setsid -f {sys.executable} /tmp/impostor.py >/tmp/impostor.log 2>&1"
    )
    assert started.status.exit_code == 0, started
    for _ in range(200):
        state = await first.shell(sandbox.id, "cat /tmp/impostor.state 2>/dev/null")
        if state.stdout:
            break
        await asyncio.sleep(0.05)
    log = (await first.shell(sandbox.id, "cat /tmp/impostor.log")).stdout
    assert state.stdout, f"the impostor never served: {log!r}"

    # orchard-env restarts: the replica stops (its connections to the agent close; in one
    # process a live one would be shared with the next replica), and a new replica over a new
    # runtime that adopts the sandbox finds the agent from the record.
    await first.server.stop(0)
    second = await env_factory(runtime=await runtimes())
    result = await second.shell(sandbox.id, "echo real-$((6 * 7))")
    assert FORGED.encode() not in result.stdout, result
    assert result.stdout == b"real-42\n", result
    calls = await second.shell(sandbox.id, "cat /tmp/impostor.calls 2>/dev/null | wc -l")
    assert calls.stdout.strip() == b"0", calls
    attack.held("serve an impostor agent at the agent's socket")


@pytest.mark.parametrize("name", ["agent.sock", "agent.lane"])
async def test_a_socket_swapped_on_the_host_is_refused(
    env_factory: Any, runtimes: Callable[[], Any], attack: Any, name: str
) -> None:
    """Defense in depth: whatever listens at the agent's path (its gRPC socket or its exec
    lane) must be the sandbox's PID 1. Exec goes over the lane; a file call over gRPC, whose
    server the agent starts when orchard-env first needs it."""
    from orchard.env.v1 import env_service_pb2

    first_runtime = await runtimes()
    first = await env_factory(runtime=first_runtime)
    sandbox = await first.ready(timeout_s=60)
    path = Path(first_runtime.config.run_dir) / sandbox.id / name
    assert path.exists() == (name == "agent.lane")  # gRPC starts on the first call over it
    stat = env_service_pb2.StatFileRequest(sandbox_id=sandbox.id, path="/")

    async def call(env: Any) -> Any:
        if name == "agent.lane":
            return await env.shell(sandbox.id, "echo hello")
        return await env.stub.StatFile(stat, metadata=env.md())

    await first.stub.StatFile(stat, metadata=first.md())
    assert path.exists()
    attack.tried(f"swap the agent's {name} on the host")
    path.rename(path.with_name(f"{name}.real"))
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    impostor.bind(str(path))
    impostor.listen(8)
    impostor.setblocking(False)
    try:
        second = await env_factory(runtime=await runtimes())
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(second)
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, caught.value
        assert "not the agent" in (caught.value.details() or "")
        received = b""
        with contextlib.suppress(BlockingIOError):
            while True:
                connection, _ = impostor.accept()
                with connection:
                    connection.settimeout(1)
                    with contextlib.suppress(OSError):
                        received += connection.recv(65536)
        assert received == b"", received  # the check connected; no call was ever sent
    finally:
        impostor.close()
        path.unlink()
        path.with_name(f"{name}.real").rename(path)
    attack.held(f"swap the agent's {name} on the host")
    # The real agent back at its place: the next call checks again and goes through.
    assert await call(second)
    assert (await second.shell(sandbox.id, "echo hello")).stdout == b"hello\n"
