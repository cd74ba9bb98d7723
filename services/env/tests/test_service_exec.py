"""Exec and files through the service, straight to the agent: every test on both routes to
it (Exec over the agent's exec lane, and over gRPC with the lane turned off)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchard.core.errors import error_info
from orchard.env.v1 import env_pb2
from orchard.env.v1 import env_service_pb2 as api
from orchard.types.v1 import exec_pb2, files_pb2


@pytest.fixture(params=["lane", "grpc"])
async def env(env_factory: Any, request: pytest.FixtureRequest) -> Any:
    return await env_factory(exec_lane=request.param == "lane")


async def test_exec_takes_the_lane_unless_it_is_turned_off(env: Any) -> None:
    sandbox = await env.ready()
    result = await env.shell(sandbox.id, "echo hi")
    assert result.stdout == b"hi\n"
    link = env.app.controller.agents._links[sandbox.id]
    grpc_socket = Path(link.address.removeprefix("unix:"))
    if env.app.config.exec_lane:
        assert link.lane is not None and link.lane.address.endswith("agent.lane")
        assert link.lane._writer is not None, "the exec went another way"
        assert link._channel is None, "a sandbox that only ran commands got a gRPC channel"
        # Nor did its agent start a gRPC server: it serves only the lane until asked.
        assert not grpc_socket.exists(), "the agent serves gRPC that nobody asked for"
    else:
        assert link.lane is None and link._channel is not None
        assert grpc_socket.is_socket()
    # Every other call goes over gRPC (the channel made for it), and exec still works after.
    stat = await env.stub.StatFile(
        api.StatFileRequest(sandbox_id=sandbox.id, path="."), metadata=env.md()
    )
    assert stat.info.type == files_pb2.FILE_TYPE_DIRECTORY
    assert link._channel is not None and grpc_socket.is_socket()
    assert (await env.shell(sandbox.id, "echo again")).stdout == b"again\n"


async def test_exec_stream_events_in_order(env: Any) -> None:
    sandbox = await env.ready()
    request = api.ExecStreamRequest(
        sandbox_id=sandbox.id, command=exec_pb2.Command(shell="echo one; echo two >&2; exit 4")
    )
    kinds, out, err = [], b"", b""
    async for reply in env.stub.ExecStream(request, metadata=env.md()):
        kind = reply.event.WhichOneof("event")
        kinds.append(kind)
        if kind == "stdout":
            out += reply.event.stdout
        elif kind == "stderr":
            err += reply.event.stderr
        elif kind == "exit":
            assert reply.event.exit.exit_code == 4
    assert kinds[0] == "started" and kinds[-1] == "exit"
    assert out == b"one\n" and err == b"two\n"


async def test_files_round_trip(env: Any) -> None:
    sandbox = await env.ready()
    content = os.urandom(3 * 1024 * 1024 + 7)

    async def chunks() -> Any:
        yield api.WriteFileRequest(
            header=api.WriteFileHeader(
                sandbox_id=sandbox.id, path="d/f.bin", make_parents=True, mode=0o600
            )
        )
        for i in range(0, len(content), 1 << 20):
            yield api.WriteFileRequest(data=content[i : i + (1 << 20)])

    written = await env.stub.WriteFile(chunks(), metadata=env.md())
    assert written.sha256 == hashlib.sha256(content).hexdigest()
    assert written.info.size == len(content)

    read = b""
    first = True
    async for reply in env.stub.ReadFile(
        api.ReadFileRequest(sandbox_id=sandbox.id, path="d/f.bin"), metadata=env.md()
    ):
        if first:
            assert reply.info.size == len(content)
            first = False
        read += reply.data
    assert read == content
    part = b"".join(
        [
            r.data
            async for r in env.stub.ReadFile(
                api.ReadFileRequest(sandbox_id=sandbox.id, path="d/f.bin", offset=5, limit=10),
                metadata=env.md(),
            )
        ]
    )
    assert part == content[5:15]

    listing = await env.stub.ListFiles(
        api.ListFilesRequest(sandbox_id=sandbox.id, path="d"), metadata=env.md()
    )
    assert [e.name for e in listing.entries] == ["f.bin"]
    stat = await env.stub.StatFile(
        api.StatFileRequest(sandbox_id=sandbox.id, path="d/f.bin"), metadata=env.md()
    )
    assert stat.info.size == len(content) and stat.info.mode & 0o777 == 0o600


async def test_agent_errors_pass_through_unchanged(env: Any) -> None:
    sandbox = await env.ready()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await env.stub.StatFile(
            api.StatFileRequest(sandbox_id=sandbox.id, path="/no/such/file"), metadata=env.md()
        )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(caught.value).reason == "NOT_FOUND"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await env.stub.Exec(
            api.ExecRequest(
                sandbox_id=sandbox.id, command=exec_pb2.Command(argv=["no-such-program-x"])
            ),
            metadata=env.md(),
        )
    assert error_info(caught.value).reason == "EXECUTABLE_NOT_FOUND"
    assert (
        caught.value.code() == grpc.StatusCode.NOT_FOUND
        or caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        or caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    )


async def test_calls_to_one_sandbox_are_serialized_and_sandboxes_run_in_parallel(env: Any) -> None:
    a, b = await asyncio.gather(env.ready(), env.ready())
    started = time.monotonic()
    await asyncio.gather(*(env.shell(s, "sleep 0.4") for s in (a.id, b.id)))
    parallel = time.monotonic() - started
    started = time.monotonic()
    await asyncio.gather(*(env.shell(a.id, "sleep 0.4") for _ in range(2)))
    serial = time.monotonic() - started
    assert parallel < 0.75, parallel
    assert serial >= 0.8, serial


async def test_cancelled_stream_kills_the_process_group(env: Any, tmp_path: Path) -> None:
    sandbox = await env.ready()
    marker = tmp_path / "pid"
    call = env.stub.ExecStream(
        api.ExecStreamRequest(
            sandbox_id=sandbox.id,
            command=exec_pb2.Command(shell=f"sleep 100 & echo $! > {marker}; echo go; wait"),
        ),
        metadata=env.md(),
    )
    async for reply in call:
        if reply.event.WhichOneof("event") == "stdout":
            break
    pid = int(marker.read_text())
    call.cancel()
    await _killed_and_free(env, sandbox.id, pid, "the cancelled call")


@pytest.mark.parametrize("end", ["deadline", "cancel"])
async def test_an_exec_past_its_deadline_or_cancelled_kills_the_command(
    env: Any, tmp_path: Path, end: str
) -> None:
    sandbox = await env.ready()
    marker = tmp_path / "pid"
    call = env.stub.Exec(
        api.ExecRequest(
            sandbox_id=sandbox.id,
            command=exec_pb2.Command(shell=f"sleep 100 & echo $! > {marker}; wait"),
        ),
        metadata=env.md(),
        timeout=1.5 if end == "deadline" else None,
    )
    deadline = time.monotonic() + 10
    while not marker.exists() or not marker.read_text().strip():
        assert time.monotonic() < deadline, "the command did not start"
        await asyncio.sleep(0.02)
    pid = int(marker.read_text())
    if end == "cancel":
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    else:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await _killed_and_free(env, sandbox.id, pid, f"the call's {end}")


async def _killed_and_free(env: Any, sandbox_id: str, pid: int, what: str) -> None:
    """The command ``pid`` dies soon after ``what``, and the sandbox takes the next call at
    once (the call let go of its lock)."""
    deadline = time.monotonic() + 5
    while _alive(pid):
        assert time.monotonic() < deadline, f"the command outlived {what}"
        await asyncio.sleep(0.02)
    assert (await asyncio.wait_for(env.shell(sandbox_id, "echo next"), 5)).stdout == b"next\n"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_dead_agent_is_unavailable_then_failed(env: Any, runtime: Any) -> None:
    sandbox = await env.ready()
    pid = runtime._pid(sandbox.id)
    os.killpg(pid, signal.SIGKILL)
    try:
        await env.shell(sandbox.id, "true")
    except grpc.aio.AioRpcError as exc:
        # Either the agent did not answer, or the exit was already recorded.
        assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION)
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            assert "did not answer" in exc.details() and sandbox.id in exc.details()
    else:
        pytest.fail("exec in a dead sandbox succeeded")
    deadline = time.monotonic() + 5
    while True:
        failed = (
            await env.stub.GetSandbox(
                api.GetSandboxRequest(sandbox_id=sandbox.id), metadata=env.md()
            )
        ).sandbox
        if failed.state == env_pb2.SANDBOX_STATE_FAILED:
            break
        assert time.monotonic() < deadline, failed
        await asyncio.sleep(0.05)
    assert failed.failure.reason == "AGENT_EXITED"
    # FAILED is recorded first, then the runtime's resources are released.
    while await runtime.list_sandboxes():
        assert time.monotonic() < deadline + 5, await runtime.list_sandboxes()
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("streaming", [False, True], ids=["Exec", "ExecStream"])
async def test_a_delete_during_an_exec_ends_the_exec_with_a_status(
    env: Any, streaming: bool
) -> None:
    """The attack: a running exec whose sandbox is deleted under it. grpc.aio ends a call on a
    closing channel by cancelling it; the handler used to let that cancellation out, which ends
    the RPC without a status, so the caller hung until its own deadline (an hour by default)."""
    sandbox = await env.ready()
    command = exec_pb2.Command(shell="echo started; sleep 60")
    deadline_s = 45
    if streaming:
        call = env.stub.ExecStream(
            api.ExecStreamRequest(sandbox_id=sandbox.id, command=command),
            metadata=env.md(),
            timeout=deadline_s,
        )
        replies = aiter(call)
        while (await anext(replies)).event.WhichOneof("event") != "stdout":
            pass  # until the command runs: its first output came back

        async def drain() -> None:
            async for _ in replies:
                pass

        outcome: Any = asyncio.ensure_future(drain())
    else:
        outcome = asyncio.ensure_future(
            env.stub.Exec(
                api.ExecRequest(sandbox_id=sandbox.id, command=command),
                metadata=env.md(),
                timeout=deadline_s,
            )
        )
        await asyncio.sleep(0.5)  # the agent runs the command
        assert not outcome.done()
    started = time.monotonic()
    await env.stub.DeleteSandbox(api.DeleteSandboxRequest(sandbox_id=sandbox.id), metadata=env.md())
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await outcome
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION, caught.value
    assert "stopped being READY during the call" in caught.value.details()
    assert sandbox.id in caught.value.details()
    assert time.monotonic() - started < deadline_s / 3  # an answer, not the deadline


async def test_exec_in_pending_sandbox_is_failed_precondition(env: Any, runtime: Any) -> None:
    original = runtime.create

    async def slow(spec: Any) -> Any:
        await asyncio.sleep(1)
        return await original(spec)

    runtime.create = slow
    sandbox = await env.create()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await env.shell(sandbox.id, "true")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "PENDING" in caught.value.details()
