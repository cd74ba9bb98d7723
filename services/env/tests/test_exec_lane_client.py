"""orchard-env's exec lane client against agents that misbehave (a sandbox's agent is on the
far side of the trust boundary): whatever the lane answers, orchard-env gets a status it can
pass on, allocates nothing an agent announces beyond the limit, and never waits past the call's
deadline. The agent here is a Unix socket server in the test that answers as told."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import status_pb2

from orchard.env.exec_lane import MAX_RESPONSE_BYTES, LaneClient
from orchard.inagent.v1 import exec_lane_pb2 as lane_pb
from orchard.inagent.v1 import inagent_service_pb2 as agent_pb
from orchard.types.v1 import exec_pb2

HEADER = struct.Struct(">I")
Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
REQUEST = agent_pb.ExecRequest(command=exec_pb2.Command(argv=["true"]))


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Callable[[Answer], Awaitable[str]]]:
    """Serve a lane whose every connection is handled by ``answer``; returns its address."""
    servers: list[asyncio.Server] = []

    async def start(answer: Answer) -> str:
        path = tmp_path / f"lane{len(servers)}"
        servers.append(await asyncio.start_unix_server(answer, path=str(path)))
        return f"unix:{path}"

    yield start
    for server in servers:
        server.close()


async def _request(reader: asyncio.StreamReader) -> lane_pb.LaneRequest:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return lane_pb.LaneRequest.FromString(await reader.readexactly(size))


def _frame(message: bytes) -> bytes:
    return HEADER.pack(len(message)) + message


async def _refused(client: LaneClient, deadline_s: float = 5) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.exec(REQUEST, deadline_s)
    return caught.value


async def test_answers_and_errors_come_back_as_grpc_would_give_them(agent: Any) -> None:
    seen: list[lane_pb.LaneRequest] = []
    error = status_pb2.Status(code=grpc.StatusCode.NOT_FOUND.value[0], message="no such program")

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                seen.append(await _request(reader))
            except asyncio.IncompleteReadError:
                return
            response = lane_pb.LaneResponse()
            if len(seen) == 1:
                response.exec.result.stdout = b"hi"
            else:
                response.error.CopyFrom(error)
            writer.write(_frame(response.SerializeToString()))

    client = LaneClient(await agent(answer), lambda: "Bearer v1-env.x")
    assert (await client.exec(REQUEST, 5)).result.stdout == b"hi"
    refused = await _refused(client)
    assert refused.code() == grpc.StatusCode.NOT_FOUND and refused.details() == "no such program"
    details = dict(refused.trailing_metadata() or ())["grpc-status-details-bin"]
    assert status_pb2.Status.FromString(details) == error
    # One connection for both calls, each carrying the credential and the command.
    assert [r.authorization for r in seen] == ["Bearer v1-env.x"] * 2
    assert all(r.exec == REQUEST for r in seen)
    client.close()


async def test_an_agent_announcing_a_huge_answer_is_refused_unread(agent: Any) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(HEADER.pack(2**32 - 1) + b"x" * 1024)
        await asyncio.sleep(5)

    refused = await _refused(LaneClient(await agent(answer)))
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(MAX_RESPONSE_BYTES) in (refused.details() or "")


async def test_garbage_a_hang_up_or_silence_each_end_the_call(agent: Any) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(_frame(b"\xff\xff\xff\xff"))

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(HEADER.pack(100) + b"half")
        writer.close()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        await asyncio.sleep(30)

    async def empty(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(_frame(b""))

    assert (await _refused(LaneClient(await agent(garbage)))).code() == grpc.StatusCode.INTERNAL
    broken = await _refused(LaneClient(await agent(hang_up)))
    assert broken.code() == grpc.StatusCode.UNAVAILABLE
    assert "closed the connection" in (broken.details() or "")
    loop = asyncio.get_running_loop()
    started = loop.time()
    late = await _refused(LaneClient(await agent(silent)), deadline_s=0.5)
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert loop.time() - started < 5
    assert (await _refused(LaneClient(await agent(empty)))).code() == grpc.StatusCode.INTERNAL


async def test_no_agent_listening_is_unavailable(tmp_path: Path) -> None:
    refused = await _refused(LaneClient(f"unix:{tmp_path / 'nothing'}"))
    assert refused.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_connection_the_agent_closed_between_calls_is_opened_again(agent: Any) -> None:
    async def one_call_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(_frame(lane_pb.LaneResponse(exec=agent_pb.ExecResponse()).SerializeToString()))
        await writer.drain()
        writer.close()

    client = LaneClient(await agent(one_call_each))
    for _ in range(3):
        await client.exec(REQUEST, 5)
        await asyncio.sleep(0.05)  # the agent's close arrives
    client.close()
