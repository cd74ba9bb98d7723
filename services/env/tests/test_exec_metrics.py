"""``orchard_env_exec_seconds`` and ``orchard_env_execs_in_flight`` as recorded per exec."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import generate_latest

from orchard.core.errors import OrchardError, Reason
from orchard.core.metrics import ServiceMetrics
from orchard.env.metrics import EnvMetrics
from orchard.env.v1 import env_pb2


def _scrape(metrics: EnvMetrics) -> str:
    return generate_latest(metrics.registry_owner.registry).decode()


async def _observe(metrics: EnvMetrics, error: BaseException | None) -> None:
    with metrics.exec_observation():  # the plain form, as Exec and ExecStream use it
        await asyncio.sleep(0)
        if error is not None:
            raise error


def test_exec_codes_and_in_flight() -> None:
    metrics = EnvMetrics(ServiceMetrics("env"))

    async def run() -> None:
        inside = asyncio.Event()
        release = asyncio.Event()

        async def held() -> None:
            async with metrics.exec_observation():
                inside.set()
                await release.wait()

        task = asyncio.create_task(held())
        await inside.wait()
        # Read at scrape time: one call is inside the block.
        assert "orchard_env_execs_in_flight 1.0" in _scrape(metrics)
        release.set()
        await task

        await _observe(metrics, None)
        async with metrics.exec_observation():  # the async form records the same
            await asyncio.sleep(0)
        with pytest.raises(OrchardError):
            await _observe(metrics, OrchardError(Reason.NOT_FOUND, "no such sandbox"))
        with pytest.raises(grpc.aio.AbortError):
            await _observe(metrics, grpc.aio.AbortError())
        with pytest.raises(asyncio.CancelledError):
            await _observe(metrics, asyncio.CancelledError())

    asyncio.run(run())
    text = _scrape(metrics)
    for line in (
        'orchard_env_exec_seconds_count{code="OK"} 3.0',
        'orchard_env_exec_seconds_count{code="NOT_FOUND"} 1.0',
        'orchard_env_exec_seconds_count{code="AGENT_ERROR"} 1.0',
        'orchard_env_exec_seconds_count{code="CANCELLED"} 1.0',
        "orchard_env_execs_in_flight 0.0",
    ):
        assert line in text, line


def test_state_counts_set_every_state() -> None:
    metrics = EnvMetrics(ServiceMetrics("env"))
    metrics.set_state_counts([env_pb2.SANDBOX_STATE_READY] * 3 + [env_pb2.SANDBOX_STATE_PENDING])
    text = _scrape(metrics)
    assert 'orchard_env_sandboxes{state="READY"} 3.0' in text
    assert 'orchard_env_sandboxes{state="PENDING"} 1.0' in text
    metrics.set_state_counts([])
    assert 'orchard_env_sandboxes{state="READY"} 0.0' in _scrape(metrics)
