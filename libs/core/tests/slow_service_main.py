"""A tiny Orchard service run as a real process by the drain tests.

``/orchard.test.v1.Slow/Sleep`` takes the number of seconds to sleep as ASCII bytes and echoes
it back once done. Started via :func:`orchard.core.server.run_service`, like every service.
"""

from __future__ import annotations

import asyncio
import logging
import sys

import grpc
from pydantic import Field

from orchard.core.config import ServiceConfig
from orchard.core.server import GrpcServer, ServiceBinding, run_service

SERVICE = "orchard.test.v1.Slow"
log = logging.getLogger("slow_service")


class SlowConfig(ServiceConfig):
    greeting: str = Field(default="hello", description="Logged when the service starts.")


async def sleep(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    try:
        await asyncio.sleep(float(request))
    except asyncio.CancelledError:
        log.info("sleep cancelled", extra={"seconds": float(request)})
        raise
    return request


def services(config: SlowConfig) -> list[ServiceBinding]:
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Sleep": grpc.unary_unary_rpc_method_handler(sleep)}
    )
    return [ServiceBinding.generic(handler)]


async def on_start(config: SlowConfig, server: GrpcServer) -> None:
    log.info("on_start", extra={"greeting": config.greeting})


async def on_stop(config: SlowConfig, server: GrpcServer) -> None:
    log.info("on_stop")


if __name__ == "__main__":
    sys.exit(run_service("slow", SlowConfig, services, on_start=on_start, on_stop=on_stop))
