"""GrpcServer against real grpc.aio clients: addresses, health, reflection, sockets, hooks."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from orchard.core.config import ServerConfig
from orchard.core.server import GrpcServer, ServiceBinding

SERVICE = "orchard.test.v1.Echo"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


def echo_service() -> ServiceBinding:
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
    )
    return ServiceBinding.generic(handler)


async def check(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(response.status)


async def test_tcp_port_zero_reports_bound_port() -> None:
    config = ServerConfig(listen=["127.0.0.1:0", "[::1]:0"])
    async with GrpcServer("test", [echo_service()], config) as server:
        assert len(server.addresses) == 2
        assert server.port > 0
        assert server.addresses[0] == f"127.0.0.1:{server.port}"
        assert server.addresses[1].startswith("[::1]:")
        for address in server.addresses:
            async with grpc.aio.insecure_channel(address) as channel:
                assert await channel.unary_unary(f"/{SERVICE}/Echo")(b"hi", timeout=5) == b"hi"


async def test_port_in_use_is_an_error() -> None:
    async with GrpcServer("test", [echo_service()]) as first:
        config = ServerConfig(listen=[first.addresses[0]])
        with pytest.raises(OSError, match="cannot listen"):
            async with GrpcServer("test", [echo_service()], config):
                pass


async def test_health_goes_not_serving_serving_not_serving() -> None:
    server = GrpcServer("test", [echo_service()])
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.addresses[0]) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
            seen = [(await watch.read()).status]
            assert await check(channel) == NOT_SERVING
            assert await check(channel, SERVICE) == NOT_SERVING

            await server.set_serving()
            seen.append((await watch.read()).status)
            assert await check(channel) == SERVING
            assert await check(channel, SERVICE) == SERVING

            stop = asyncio.create_task(server.stop(grace=5))
            seen.append((await watch.read()).status)
            # The drain ends open Watch streams instead of waiting out the grace period.
            assert await watch.read() == grpc.aio.EOF
            assert await watch.code() == grpc.StatusCode.OK
            async with asyncio.timeout(2):
                await stop
            assert seen == [NOT_SERVING, SERVING, NOT_SERVING]
    finally:
        await server.stop(grace=0)


async def test_reflection_lists_services() -> None:
    async with (
        GrpcServer("test", [echo_service()]) as server,
        grpc.aio.insecure_channel(server.addresses[0]) as channel,
    ):
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = [r async for r in stub.ServerReflectionInfo(iter([request]))]
        names = {s.name for s in responses[0].list_services_response.service}
        assert names == {
            SERVICE,
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        }
        # Health's descriptor resolves too, so grpcurl can describe it.
        lookup = reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="grpc.health.v1.Health"
        )
        found = [r async for r in stub.ServerReflectionInfo(iter([lookup]))]
        assert found[0].file_descriptor_response.file_descriptor_proto


async def test_unix_socket_created_with_mode_and_removed(tmp_path: Path) -> None:
    path = tmp_path / "run" / "nested" / "agent.sock"
    config = ServerConfig(listen=[f"unix:{path}"], unix_socket_mode=0o600)
    async with GrpcServer("test", [echo_service()], config) as server:
        assert server.addresses == [f"unix:{path}"]
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        async with grpc.aio.insecure_channel(server.addresses[0]) as channel:
            assert await channel.unary_unary(f"/{SERVICE}/Echo")(b"x", timeout=5) == b"x"
    assert not path.exists()


async def test_stale_unix_socket_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(os.fspath(path))
    leftover.close()  # the file stays, nobody listens: what a killed process leaves behind
    assert path.exists()
    async with (
        GrpcServer("test", [echo_service()], ServerConfig(listen=[f"unix:{path}"])),
        grpc.aio.insecure_channel(f"unix:{path}") as channel,
    ):
        assert await check(channel) == NOT_SERVING
    assert not path.exists()


async def test_live_unix_socket_and_regular_file_are_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "live.sock"
    async with GrpcServer("test", [echo_service()], ServerConfig(listen=[f"unix:{path}"])):
        with pytest.raises(OSError, match="another process"):
            async with GrpcServer("test", [], ServerConfig(listen=[f"unix:{path}"])):
                pass
        assert path.exists()  # the failed second server did not remove the live socket
    regular = tmp_path / "file"
    regular.write_text("keep me")
    with pytest.raises(OSError, match="not a socket"):
        async with GrpcServer("test", [], ServerConfig(listen=[f"unix:{regular}"])):
            pass
    assert regular.read_text() == "keep me"


async def test_hooks_run_around_serving() -> None:
    events: list[str] = []

    async def on_start(server: GrpcServer) -> None:
        async with grpc.aio.insecure_channel(server.addresses[0]) as channel:
            events.append(f"start:{await check(channel) == NOT_SERVING}")

    async def on_stop(server: GrpcServer) -> None:
        events.append(f"stop:{server.draining}")

    async with GrpcServer("test", [], on_start=on_start, on_stop=on_stop):
        events.append("body")
    assert events == ["start:True", "body", "stop:True"]


async def test_failing_on_start_stops_server(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"

    async def on_start(server: GrpcServer) -> None:
        raise RuntimeError("cannot connect to etcd")

    with pytest.raises(RuntimeError, match="etcd"):
        async with GrpcServer("test", [], ServerConfig(listen=[f"unix:{path}"]), on_start=on_start):
            pass
    assert not path.exists()


async def test_a_deferred_server_binds_nothing_until_opened(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    events: list[str] = []

    async def on_start(server: GrpcServer) -> None:
        events.append(f"start:{server.opened}")

    async def on_stop(server: GrpcServer) -> None:
        events.append(f"stop:{server.opened}")

    config = ServerConfig(listen=[f"unix:{path}"])
    server = GrpcServer("test", [echo_service()], config, on_start=on_start, deferred=True)
    server._on_stop = on_stop
    await server.start()
    try:
        assert events == ["start:False"]
        assert not path.exists() and server.addresses == []
        await server.set_serving()  # taken when it opens
        opened = await asyncio.gather(server.open(), server.open())
        assert opened == [[f"unix:{path}"]] * 2 and server.opened
        assert await server.open() == [f"unix:{path}"]  # once open, at once
        async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
            assert await check(channel, SERVICE) == SERVING
            assert await channel.unary_unary(f"/{SERVICE}/Echo")(b"hi", timeout=5) == b"hi"
    finally:
        await server.stop(grace=0)
    assert events == ["start:False", "stop:True"]
    assert not path.exists()
    with pytest.raises(RuntimeError, match="stopping"):
        await server.open()


async def test_a_deferred_server_stops_unopened_and_retries_a_failed_open(tmp_path: Path) -> None:
    stopped: list[bool] = []

    async def on_stop(server: GrpcServer) -> None:
        stopped.append(server.opened)

    async with GrpcServer("test", [], on_stop=on_stop, deferred=True) as server:
        pass
    assert stopped == [False]  # on_stop runs though gRPC never opened

    blocker = tmp_path / "s.sock"
    blocker.write_text("not a socket")
    config = ServerConfig(listen=[f"unix:{blocker}"])
    async with GrpcServer("test", [echo_service()], config, deferred=True) as server:
        with pytest.raises(OSError, match="not a socket"):
            await server.open()
        assert not server.opened and server.addresses == []
        blocker.unlink()
        assert await server.open() == [f"unix:{blocker}"]


async def test_many_concurrent_calls_are_not_cancelled() -> None:
    """Past grpc's default of 1000 pending calls, grpc.aio would cancel some."""
    gate = asyncio.Event()

    async def wait(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await gate.wait()
        return request

    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Wait": grpc.unary_unary_rpc_method_handler(wait)}
    )
    async with (
        GrpcServer("test", [ServiceBinding.generic(handler)]) as server,
        grpc.aio.insecure_channel(server.addresses[0]) as channel,
    ):
        method = channel.unary_unary(f"/{SERVICE}/Wait")
        calls = [method(b"x", timeout=30) for _ in range(1500)]
        await asyncio.sleep(0.5)
        gate.set()
        results = await asyncio.gather(*calls)
        assert len(results) == 1500


def test_server_without_pydantic_or_prometheus() -> None:
    """A server given plain settings and no metrics loads neither pydantic nor prometheus."""
    program = """
import asyncio, dataclasses, sys
from orchard.core.server import GrpcServer

@dataclasses.dataclass(frozen=True)
class Settings:
    listen: tuple[str, ...] = ("127.0.0.1:0",)
    grace_period_s: float = 1.0
    max_concurrent_rpcs: int = 10_000
    max_message_bytes: int = 1 << 22
    metrics_address: str | None = None
    unix_socket_mode: int = 0o600
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None

async def main() -> None:
    async with GrpcServer("toy", [], Settings()) as server:
        assert server.metrics is None and server.port > 0

asyncio.run(main())
heavy = {"pydantic", "yaml", "prometheus_client"} & set(sys.modules)
assert not heavy, heavy
"""
    subprocess.run([sys.executable, "-c", program], check=True, timeout=30)
