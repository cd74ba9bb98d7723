"""Wrap grpc.aio method handlers of all four kinds with per-call code (for interceptors).

grpc.aio dispatches on the kind of the behaviour function: a coroutine function returns the
response (or writes a stream with ``context.write``), an async generator function yields
responses. A wrapper must keep that kind, so it is built to match.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc

# Given the method name and the call's context, returns a context manager that runs around
# the call; exceptions from the handler pass through its __aexit__.
Around = Callable[[str, grpc.aio.ServicerContext], AbstractAsyncContextManager[None]]

Behaviour = Callable[..., Any]


def wrap_handler(handler: grpc.RpcMethodHandler, method: str, around: Around) -> Any:
    """Return ``handler`` with every call of its behaviour run inside ``around(method, ctx)``."""
    if handler.unary_unary is not None:
        return handler._replace(unary_unary=_wrap(handler.unary_unary, method, around))
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=_wrap(handler.unary_stream, method, around))
    if handler.stream_unary is not None:
        return handler._replace(stream_unary=_wrap(handler.stream_unary, method, around))
    if handler.stream_stream is not None:
        return handler._replace(stream_stream=_wrap(handler.stream_stream, method, around))
    return handler


def _wrap(behaviour: Behaviour, method: str, around: Around) -> Behaviour:
    if inspect.isasyncgenfunction(behaviour):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with around(method, context):
                async for response in behaviour(request, context):
                    yield response

        return stream

    if inspect.iscoroutinefunction(behaviour):

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with around(method, context):
                return await behaviour(request, context)

        return call

    # A plain function runs in grpc's thread pool; the wrapper cannot await around it.
    return behaviour
