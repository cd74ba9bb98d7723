"""Requests that are not valid protobuf become INVALID_ARGUMENT instead of INTERNAL.

grpc.aio deserializes a request before any handler or interceptor code runs; when the bytes
are not a valid message (corrupt wire format, a string field holding bad UTF-8) it fails the
call with INTERNAL "Exception deserializing request!". That reads as a server bug, though the
client is at fault. So each request deserializer of a generated service is wrapped: a
``DecodeError`` yields a :class:`MalformedRequest` marker, and the wrapped behaviour rejects
the marker with INVALID_ARGUMENT (reason MALFORMED_REQUEST) and the parser's own words.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from orchard.core.errors import OrchardError
from orchard.inagent.reasons import AgentReason

__all__ = ["MalformedRequest", "register_guarded"]


@dataclass(frozen=True)
class MalformedRequest:
    """Stands in for a request that could not be parsed."""

    error: str
    """What the parser said, e.g. "... 'x.v1.ExecRequest': Wire format was corrupt"."""

    def reject(self) -> OrchardError:
        """The error to fail the call with."""
        return OrchardError(
            AgentReason.MALFORMED_REQUEST,
            f"the request is not a valid protobuf message: {self.error}",
        )


def register_guarded(
    add_to_server: Callable[[Any, Any], None], servicer: object, server: grpc.aio.Server
) -> None:
    """Like ``add_to_server(servicer, server)``, with every request deserializer guarded."""
    recorder = _HandlerRecorder()
    add_to_server(servicer, recorder)
    for service, handlers in recorder.services.items():
        guarded = {name: _guard(handler) for name, handler in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, guarded),))
        server.add_registered_method_handlers(service, guarded)


class _HandlerRecorder:
    """Stands in for a server to catch the method handlers generated code registers."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Ignored: the same handlers arrive through add_registered_method_handlers."""

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.services[service] = dict(handlers)


def _guard(handler: Any) -> Any:
    parse = handler.request_deserializer
    if parse is None:
        return handler

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return MalformedRequest(str(exc))

    handler = handler._replace(request_deserializer=deserialize)
    if handler.unary_unary is not None:
        return handler._replace(unary_unary=_unary_request(handler.unary_unary))
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=_unary_request(handler.unary_stream))
    if handler.stream_unary is not None:
        return handler._replace(stream_unary=_stream_request(handler.stream_unary))
    if handler.stream_stream is not None:
        return handler._replace(stream_stream=_stream_request(handler.stream_stream))
    return handler


def _unary_request(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behaviour):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, MalformedRequest):
                raise request.reject()
            async for response in behaviour(request, context):
                yield response

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, MalformedRequest):
            raise request.reject()
        return await behaviour(request, context)

    return call


def _stream_request(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, MalformedRequest):
                raise request.reject()
            yield request

    if inspect.isasyncgenfunction(behaviour):

        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in behaviour(checked(requests), context):
                yield response

        return stream

    async def call(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(checked(requests), context)

    return call
