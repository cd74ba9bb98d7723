"""Settling: records are handed over only when nothing is pending and their count has been
stable for the quiet period; a rollout that does not settle in time raises with its counts."""

from __future__ import annotations

import asyncio

import openai
import pytest

from orchard.rollout.engines.local import LocalEngine, LocalEngineConfig
from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig
from orchard.rollout.proxy.sessions import CaptureNotSettled, UnknownRollout

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def slow_proxy(trained_folder):
    """A proxy whose engine holds each batch open for 0.5 s: calls stay pending that long."""
    config = LocalEngineConfig(model_folder=str(trained_folder), batch_window_s=0.5)
    async with (
        LocalEngine(config) as engine,
        CaptureProxy(engine, CaptureProxyConfig(settle_quiet_s=0.05)) as proxy,
    ):
        yield proxy


def client_for(endpoint) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)


async def test_settle_waits_for_a_call_in_flight(slow_proxy):
    proxy = slow_proxy
    endpoint = proxy.open_session("r-inflight")
    async with client_for(endpoint) as client:
        call = asyncio.ensure_future(
            client.chat.completions.create(model="policy", messages=USER, max_tokens=40)
        )
        await asyncio.wait_for(proxy.session("r-inflight").wait_for_calls(1), 30)
        records = await proxy.settle("r-inflight", timeout=30)
        assert call.done()
        assert [r.call_id for r in records] == [(await call).id]


async def test_a_call_arriving_within_the_quiet_period_is_included(proxy):
    endpoint = proxy.open_session("r-quiet")
    async with client_for(endpoint) as client:
        await client.chat.completions.create(model="policy", messages=USER, max_tokens=2)
        settling = asyncio.ensure_future(proxy.settle("r-quiet", timeout=30, quiet_s=1.0))
        await client.chat.completions.create(model="policy", messages=USER, max_tokens=2)
        records = await settling
    assert [r.seq for r in records] == [0, 1]


async def test_a_rollout_that_does_not_settle_raises_with_its_counts(slow_proxy):
    proxy = slow_proxy
    endpoint = proxy.open_session("r-slow")
    async with client_for(endpoint) as client:
        call = asyncio.ensure_future(
            client.chat.completions.create(model="policy", messages=USER, max_tokens=400)
        )
        await asyncio.wait_for(proxy.session("r-slow").wait_for_calls(1), 30)
        with pytest.raises(CaptureNotSettled, match="1 calls pending, 0 recorded") as raised:
            await proxy.settle("r-slow", timeout=0.05)
        assert (raised.value.pending, raised.value.records) == (1, 0)
        await call
    assert len(await proxy.settle("r-slow", timeout=30)) == 1


async def test_settling_an_unknown_rollout(proxy):
    with pytest.raises(UnknownRollout):
        await proxy.settle("never-opened", timeout=1)
