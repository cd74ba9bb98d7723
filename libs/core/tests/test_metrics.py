"""The /metrics endpoint scraped over real HTTP after real gRPC calls."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest

from orchard.core.config import ServerConfig
from orchard.core.errors import OrchardError, Reason
from orchard.core.metrics import ServiceMetrics
from orchard.core.server import GrpcServer, ServiceBinding

SERVICE = "orchard.test.v1.Metered"


async def lookup(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    if request == b"missing":
        raise OrchardError(Reason.NOT_FOUND, "no such thing")
    return request


def metered_service() -> ServiceBinding:
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Lookup": grpc.unary_unary_rpc_method_handler(lookup)}
    )
    return ServiceBinding.generic(handler)


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        return str(response.read().decode())


async def test_rpc_histogram_by_method_and_code() -> None:
    config = ServerConfig(metrics_address="127.0.0.1:0")
    async with GrpcServer("toy", [metered_service()], config) as server:
        assert server.metrics is not None and server.metrics_address is not None
        async with grpc.aio.insecure_channel(server.addresses[0]) as channel:
            method = channel.unary_unary(f"/{SERVICE}/Lookup")
            for _ in range(3):
                await method(b"here", timeout=5)
            with pytest.raises(grpc.aio.AioRpcError):
                await method(b"missing", timeout=5)
        text = await asyncio.to_thread(scrape, server.metrics_address)
    path = f"/{SERVICE}/Lookup"
    assert f'orchard_toy_rpc_seconds_count{{code="OK",method="{path}"}} 3.0' in text
    assert f'orchard_toy_rpc_seconds_count{{code="NOT_FOUND",method="{path}"}} 1.0' in text
    assert "# TYPE orchard_toy_rpc_seconds histogram" in text
    assert f'orchard_toy_rpc_in_flight{{method="{path}"}} 0.0' in text


async def test_endpoint_released_on_stop() -> None:
    config = ServerConfig(metrics_address="127.0.0.1:0")
    async with GrpcServer("toy", [], config) as server:
        address = server.metrics_address
        assert address is not None
    with pytest.raises(OSError):
        await asyncio.to_thread(scrape, address)


async def test_registries_are_per_server() -> None:
    config = ServerConfig(metrics_address="127.0.0.1:0")
    async with GrpcServer("toy", [], config) as one, GrpcServer("toy", [], config) as two:
        assert one.metrics is not None and two.metrics is not None
        assert one.metrics.registry is not two.metrics.registry


def test_service_metric_names() -> None:
    metrics = ServiceMetrics("env")
    metrics.histogram("exec_seconds", "Time to run one command.")
    metrics.counter("sandboxes_created_total", "Sandboxes created.")
    names = {m.name for m in metrics.registry.collect()}
    assert {"orchard_env_exec_seconds", "orchard_env_sandboxes_created"} <= names
    with pytest.raises(ValueError, match="_total"):
        metrics.counter("sandboxes_created", "missing suffix")
    with pytest.raises(ValueError):
        ServiceMetrics("Bad-Name")
