"""The exec lane: orchard-env's Exec calls in a lean framing beside AgentService.

An Exec over gRPC costs the agent about a millisecond of CPU in grpc's own per-call work (its
threads wake several times a call) against a few tens of microseconds for the call's own
work; the lane carries the same request and response messages over a plain stream connection
(the framing is in ``orchard/inagent/v1/exec_lane.proto``), read on the agent's event loop.
AgentService stays the contract: every other call, and Exec from any caller that does not use
the lane, goes through gRPC.

The lane listens only where the runtime tells the agent to (``--lane``); locally that is a
socket in the sandbox's run directory beside the gRPC one, outside the sandbox's root, so the
transport keeps it to orchard-env exactly as it keeps the gRPC socket. Credentials follow the
AgentService rules: a request with ``authorization`` is checked
(:class:`~orchard.inagent.credentials.CredentialCheck`), one without is served unless the agent
requires credentials.

The lane also takes ``open_grpc``: an agent started with its gRPC server on demand
(``--grpc-on-demand``) starts it then, and answers with its addresses once it serves.

A connection carries one call at a time. The caller closing it while a command runs cancels
the call, which kills the command's process group. A frame over the size limit, or one that is
not a ``LaneRequest``, is answered with an error and the connection is closed (the stream can
no longer be trusted to be in step).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
from collections.abc import Awaitable, Callable

from google.protobuf.message import DecodeError

from orchard.core.errors import OrchardError, Reason, client_error
from orchard.inagent.credentials import CredentialCheck, authorize
from orchard.inagent.decoding import MalformedRequest
from orchard.inagent.service import AgentServicer
from orchard.inagent.v1 import exec_lane_pb2 as lane_pb

__all__ = ["FRAME_HEADER", "ExecLane", "lane_listen_address"]

log = logging.getLogger(__name__)

FRAME_HEADER = struct.Struct(">I")
"""Each frame's length, 4 bytes big-endian, before its bytes."""
METHOD = "/orchard.inagent.v1.AgentService/Exec"
"""What the lane's calls are, in logs and error metadata."""


def lane_listen_address(address: str) -> tuple[str | None, str | None, int]:
    """``(path, host, port)`` of ``unix:PATH`` or ``HOST:PORT``; ValueError otherwise."""
    if address.startswith("unix:"):
        path = address.removeprefix("unix:")
        if not path:
            raise ValueError(f"lane address {address!r}: empty socket path")
        return path, None, 0
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"lane address {address!r}: use unix:PATH or HOST:PORT")
    return None, host.strip("[]"), int(port)


class ExecLane:
    """The lane's listener and its connections."""

    def __init__(
        self,
        servicer: AgentServicer,
        credentials: CredentialCheck,
        *,
        required: bool,
        max_frame_bytes: int,
        open_grpc: Callable[[], Awaitable[list[str]]],
    ) -> None:
        self._servicer = servicer
        self._open_grpc = open_grpc
        self._credentials = credentials
        self._required = required
        self._max_frame_bytes = max_frame_bytes
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self, address: str) -> None:
        """Listen at ``address`` (``unix:PATH`` or ``HOST:PORT``)."""
        path, host, port = lane_listen_address(address)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a socket left by an earlier agent of this sandbox
            self._server = await asyncio.start_unix_server(self._serve, path=path)
        else:
            self._server = await asyncio.start_server(self._serve, host=host, port=port)

    async def close(self) -> None:
        """Stop listening and end every connection (their running commands are killed)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while True:
                try:
                    header = await reader.readexactly(FRAME_HEADER.size)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the caller closed the connection between calls
                (size,) = FRAME_HEADER.unpack(header)
                if size > self._max_frame_bytes:
                    too_big = OrchardError(
                        Reason.RESOURCE_EXHAUSTED,
                        f"a lane frame of {size} bytes is over the agent's limit of "
                        f"{self._max_frame_bytes} (server.max_message_bytes)",
                    )
                    await _answer(writer, lane_pb.LaneResponse(error=too_big.to_rpc_status()))
                    return
                try:
                    body = await reader.readexactly(size)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                try:
                    request = lane_pb.LaneRequest.FromString(body)
                except DecodeError as exc:
                    malformed = MalformedRequest(str(exc)).reject()
                    await _answer(writer, lane_pb.LaneResponse(error=malformed.to_rpc_status()))
                    return
                response = await self._call(request, reader)
                if response is None:
                    return  # the caller hung up during the call: the command was killed
                await _answer(writer, response)
        except ConnectionError:
            return
        finally:
            self._connections.discard(task)
            writer.close()

    async def _call(
        self, request: lane_pb.LaneRequest, reader: asyncio.StreamReader
    ) -> lane_pb.LaneResponse | None:
        """The answer to one request; None when the caller hung up before it was done."""
        try:
            metadata = (("authorization", request.authorization),) if request.authorization else ()
            authorize(self._credentials, metadata, required=self._required)
            which = request.WhichOneof("call")
            if which == "open_grpc":
                addresses = await self._open_grpc()
                return lane_pb.LaneResponse(grpc=lane_pb.OpenGrpcResponse(addresses=addresses))
            if which != "exec":
                raise OrchardError(
                    Reason.INVALID_ARGUMENT,
                    "a lane request must carry `exec` or `open_grpc`",
                    metadata={"field": "call"},
                )
            call = asyncio.ensure_future(self._servicer.run(request.exec))
            # The caller sends nothing during a call: a read that ends is a hang-up.
            hangup = asyncio.ensure_future(reader.read(1))
            try:
                await asyncio.wait((call, hangup), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not call.done():
                    call.cancel()  # kills the command's process group
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await call
                if not hangup.done():
                    hangup.cancel()  # let go of the reader before the next frame's read
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await hangup  # (also takes a broken connection's error off the task)
            if not call.done() or call.cancelled():
                return None
            if not hangup.cancelled():
                return None  # it sent more, or hung up, as the call ended: not in step
            return lane_pb.LaneResponse(exec=call.result())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every failure is the call's status
            return lane_pb.LaneResponse(error=client_error(exc, METHOD).to_rpc_status())


async def _answer(writer: asyncio.StreamWriter, response: lane_pb.LaneResponse) -> None:
    data = response.SerializeToString()
    writer.write(FRAME_HEADER.pack(len(data)) + data)
    await writer.drain()
