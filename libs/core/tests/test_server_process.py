"""A service started by run_service in a real process: startup, SIGTERM drain, exit codes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

SCRIPT = Path(__file__).with_name("slow_service_main.py")
SLEEP = "/orchard.test.v1.Slow/Sleep"
GRACE_S = 1.5


class ServiceProcess:
    """The service subprocess and its JSON log lines."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.logs: list[dict[str, Any]] = []

    async def wait_for_log(self, msg: str) -> dict[str, Any]:
        assert self.process.stderr is not None
        async with asyncio.timeout(10):
            while True:
                for entry in self.logs:
                    if entry.get("msg") == msg:
                        return entry
                line = await self.process.stderr.readline()
                if not line:
                    raise AssertionError(f"process ended before logging {msg!r}: {self.logs}")
                self.logs.append(json.loads(line))

    async def rest_of_logs(self) -> list[dict[str, Any]]:
        assert self.process.stderr is not None
        rest = await self.process.stderr.read()
        self.logs += [json.loads(line) for line in rest.decode().splitlines() if line]
        return self.logs


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[ServiceProcess]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(SCRIPT),
        "--listen",
        f"unix:{tmp_path / 'slow.sock'}",
        "--grace-period-s",
        str(GRACE_S),
        "--set",
        "greeting=hi",
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "ORCHARD_SLOW_SERVER__LOG_LEVEL": "INFO"},
    )
    try:
        yield ServiceProcess(process)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def wait_serving(channel: grpc.aio.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    async for response in stub.Watch(health_pb2.HealthCheckRequest(), timeout=10):
        if response.status == health_pb2.HealthCheckResponse.SERVING:
            return


async def test_sigterm_drains_in_flight_calls_and_exits_zero(
    service: ServiceProcess, tmp_path: Path
) -> None:
    serving = await service.wait_for_log("serving")
    socket_path = tmp_path / "slow.sock"
    assert serving["addresses"] == [f"unix:{socket_path}"]
    assert (await service.wait_for_log("on_start"))["greeting"] == "hi"

    async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
        await wait_serving(channel)
        sleep = channel.unary_unary(SLEEP)
        short_call = asyncio.ensure_future(sleep(b"0.8", timeout=20))
        long_call = asyncio.ensure_future(sleep(b"30", timeout=20))
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        await asyncio.sleep(0.2)  # both calls are in the handler now

        signalled = time.monotonic()
        service.process.send_signal(signal.SIGTERM)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING

        # New connections are refused while the in-flight calls drain.
        async with grpc.aio.insecure_channel(f"unix:{socket_path}") as fresh:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await fresh.unary_unary(SLEEP)(b"0", timeout=2)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        assert await short_call == b"0.8"  # finished within the grace period
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await long_call  # ran past the grace period: cancelled
        assert cut.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)

    async with asyncio.timeout(GRACE_S + 5):
        code = await service.process.wait()
    elapsed = time.monotonic() - signalled
    assert code == 0
    assert GRACE_S - 0.2 < elapsed < GRACE_S + 2
    messages = [entry["msg"] for entry in await service.rest_of_logs()]
    assert "sleep cancelled" in messages
    assert messages.index("draining") < messages.index("on_stop") < messages.index("stopped")
    assert not socket_path.exists()


async def test_idle_service_stops_at_once_on_sigint(service: ServiceProcess) -> None:
    await service.wait_for_log("serving")
    signalled = time.monotonic()
    service.process.send_signal(signal.SIGINT)
    async with asyncio.timeout(5):
        assert await service.process.wait() == 0
    assert time.monotonic() - signalled < 1.0


async def test_bad_configuration_exits_2_naming_the_key() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(SCRIPT),
        "--set",
        "server.grace_period_s=abc",
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "ORCHARD_SLOW_GREETNG": "x", "ORCHARD_OTHER_GREETNG": "ignored"},
    )
    try:
        async with asyncio.timeout(20):
            _, stderr = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 2
    text = stderr.decode()
    assert "server.grace_period_s: Input should be a valid number" in text
    assert "(from --set server.grace_period_s=abc)" in text
    assert "greetng: unknown key; did you mean 'greeting'? (from ORCHARD_SLOW_GREETNG)" in text
    assert "ORCHARD_OTHER" not in text
