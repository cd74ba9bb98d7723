"""A teacher endpoint behind the capture proxy (`RelayEngine`): a client of another dialect gets
the endpoint's turn in its own tool, streamed or not, and the call is captured; an endpoint that
refuses or does not answer gives the client an error of its dialect that names the endpoint.
The endpoint is a real HTTP server on loopback (`ScriptedPolicyServer`, or a small aiohttp app
that refuses every call)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import anthropic
import pytest
from aiohttp import web

from orchard.rollout.engines.relay import RelayEngine
from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig
from orchard.rollout.scripted_policy import ScriptedPolicyServer

from .test_scripted_engine import SCHEMA, SCRIPT, TASK

TOOLS = [{"name": "Bash", "description": "Run a command.", "input_schema": SCHEMA}]


def _relay(base_url: str, tokenizer: object) -> RelayEngine:
    return RelayEngine(
        base_url=base_url, model="hosted", api_key="k", tokenizer=tokenizer, max_retries=0
    )


async def test_an_anthropic_client_gets_the_endpoint_s_turns_and_they_are_captured(
    tokenizer: object,
) -> None:
    async with (
        ScriptedPolicyServer(SCRIPT, seed=0) as teacher,
        _relay(teacher.base_url, tokenizer) as engine,
        CaptureProxy(engine, CaptureProxyConfig(settle_quiet_s=0.05)) as proxy,
    ):
        endpoint = proxy.open_session("r-relay")
        root = endpoint.base_url.removesuffix("/v1")
        async with anthropic.AsyncAnthropic(base_url=root, api_key="k", max_retries=0) as client:
            messages: list[dict[str, object]] = [{"role": "user", "content": TASK}]
            first = await client.messages.create(
                model="claude-x", max_tokens=300, messages=messages, tools=TOOLS
            )
            [use] = [b for b in first.content if b.type == "tool_use"]
            assert use.name == "Bash"
            assert use.input["command"] == "mail list"
            messages += [
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "m1"}],
                },
            ]
            async with client.messages.stream(
                model="claude-x", max_tokens=300, messages=messages, tools=TOOLS
            ) as stream:
                second = await stream.get_final_message()
            assert [b.text for b in second.content if b.type == "text"] == ["Done."]
        calls = await proxy.settle("r-relay", timeout=10)
    # Both turns were the endpoint's (asked in chat completions), captured in tokens.
    assert teacher.requests == engine.turns == 2
    assert [c.weight_version for c in calls] == ["endpoint:hosted"] * 2
    assert all(c.prompt_token_ids and c.output_token_ids for c in calls)
    assert calls[1].prompt_token_ids[: len(calls[0].prompt_token_ids)] == calls[0].prompt_token_ids


@pytest.fixture
async def refusing_endpoint() -> AsyncIterator[str]:
    """An OpenAI-shaped endpoint that refuses every call with 400 and a message."""

    async def refuse(request: web.Request) -> web.Response:
        error = {"message": "model 'hosted' does not support tools", "type": "invalid_request"}
        return web.json_response({"error": error}, status=400)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", refuse)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("case", ["refuses", "is down"])
async def test_an_endpoint_that_refuses_or_is_down_is_an_error_naming_it(
    case: str, tokenizer: object, refusing_endpoint: str
) -> None:
    base_url = refusing_endpoint if case == "refuses" else f"http://127.0.0.1:{_closed_port()}/v1"
    async with (
        _relay(base_url, tokenizer) as engine,
        CaptureProxy(engine, CaptureProxyConfig(settle_quiet_s=0.05)) as proxy,
    ):
        endpoint = proxy.open_session("r-bad")
        root = endpoint.base_url.removesuffix("/v1")
        async with anthropic.AsyncAnthropic(base_url=root, api_key="k", max_retries=0) as client:
            with pytest.raises(anthropic.APIStatusError) as caught:
                await client.messages.create(
                    model="claude-x",
                    max_tokens=50,
                    messages=[{"role": "user", "content": TASK}],
                    tools=TOOLS,
                )
    message = str(caught.value)
    assert f"the teacher endpoint {base_url}" in message
    if case == "refuses":
        # The request itself was refused: the program's 400, with the endpoint's reason.
        assert caught.value.status_code == 400
        assert "does not support tools" in message
    else:
        assert caught.value.status_code == 500
        assert "did not answer" in message
