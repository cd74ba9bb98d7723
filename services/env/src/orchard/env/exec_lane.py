"""orchard-env's side of an agent's exec lane (:mod:`orchard.inagent.exec_lane`; the framing
is in ``orchard/inagent/v1/exec_lane.proto``): Exec calls in a lean framing instead of gRPC.

One connection per sandbox, opened on first use and kept; one call at a time on it (the
caller holds the sandbox link's lock). A call that times out or is cancelled closes the
connection, which tells the agent to kill the command; the next call opens a new one.

Failures come back as the ``grpc.aio.AioRpcError`` a gRPC call to the agent would have raised
(the agent's status with its ErrorInfo detail; UNAVAILABLE when the lane cannot be reached or
breaks off; DEADLINE_EXCEEDED at the deadline), so callers treat both routes alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from orchard.inagent.v1 import exec_lane_pb2 as lane_pb
from orchard.inagent.v1 import inagent_service_pb2 as agent_pb

__all__ = ["LaneClient"]

_HEADER = struct.Struct(">I")
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
"""The largest answer read from an agent, as for its gRPC channel."""
_STATUS_DETAILS_KEY = "grpc-status-details-bin"
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _rpc_error(
    code: grpc.StatusCode, details: str, trailing: grpc.aio.Metadata | None = None
) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing or grpc.aio.Metadata(), details)


class LaneClient:
    """The connection to one agent's exec lane."""

    def __init__(self, address: str, authorization: Callable[[], str] | None = None) -> None:
        if not address.startswith("unix:"):
            raise ValueError(f"exec lane address {address!r}: only unix:PATH is supported")
        self.address = address
        self._path = address.removeprefix("unix:")
        self._authorization = authorization
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def exec(self, request: agent_pb.ExecRequest, deadline_s: float) -> agent_pb.ExecResponse:
        """Run ``request`` in the sandbox within ``deadline_s`` seconds; raises
        ``grpc.aio.AioRpcError`` as gRPC would."""
        response = await self._call(lane_pb.LaneRequest(exec=request), deadline_s)
        if response.HasField("exec"):
            return response.exec
        self.close()
        raise _rpc_error(grpc.StatusCode.INTERNAL, "the agent's exec lane answered nothing")

    async def open_grpc(self, deadline_s: float) -> list[str]:
        """Have the agent start its gRPC server (at once if it serves already); its addresses,
        as the agent names them."""
        request = lane_pb.LaneRequest(open_grpc=lane_pb.OpenGrpcRequest())
        response = await self._call(request, deadline_s)
        if response.HasField("grpc"):
            return list(response.grpc.addresses)
        self.close()
        raise _rpc_error(grpc.StatusCode.INTERNAL, "the agent's exec lane answered nothing")

    async def _call(
        self, lane_request: lane_pb.LaneRequest, deadline_s: float
    ) -> lane_pb.LaneResponse:
        """One call: the agent's answer, or its error status raised as gRPC would."""
        if self._authorization is not None:
            lane_request.authorization = self._authorization()
        data = lane_request.SerializeToString()
        try:
            async with asyncio.timeout(deadline_s):
                if self._writer is None or self._reader is None or self._reader.at_eof():
                    self.close()  # (one the agent closed between calls)
                    self._reader, self._writer = await asyncio.open_unix_connection(self._path)
                reader, writer = self._reader, self._writer
                writer.write(_HEADER.pack(len(data)) + data)
                await writer.drain()
                (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                if size > MAX_RESPONSE_BYTES:
                    self.close()
                    raise _rpc_error(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the agent's answer of {size} bytes is over {MAX_RESPONSE_BYTES}",
                    )
                body = await reader.readexactly(size)
        except TimeoutError:
            self.close()  # the agent kills the command when the connection closes
            raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except (OSError, asyncio.IncompleteReadError) as exc:
            self.close()
            broke = isinstance(exc, asyncio.IncompleteReadError)
            why = "it closed the connection" if broke else exc
            raise _rpc_error(
                grpc.StatusCode.UNAVAILABLE, f"the agent's exec lane failed: {why}"
            ) from None
        except BaseException:
            self.close()  # cancelled: the agent kills the command
            raise
        try:
            response = lane_pb.LaneResponse.FromString(body)
        except DecodeError:
            self.close()
            raise _rpc_error(
                grpc.StatusCode.INTERNAL, "the agent's exec lane answered what does not parse"
            ) from None
        if response.HasField("error"):
            status = response.error
            raise _rpc_error(
                _CODES.get(status.code, grpc.StatusCode.UNKNOWN),
                status.message,
                grpc.aio.Metadata((_STATUS_DETAILS_KEY, status.SerializeToString())),
            )
        return response

    def close(self) -> None:
        """Close the connection (a call in flight on it fails; the next one reconnects)."""
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()
