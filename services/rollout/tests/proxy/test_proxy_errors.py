"""Bad input gets HTTP 400 (or 401/404) with an OpenAI-style error body naming the parameter,
through the official client and raw HTTP; nothing is recorded for a refused call."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from .conftest import BASH

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("overrides", "param", "match"),
    [
        ({"messages": []}, "messages", "non-empty array"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "role must be one of"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages", "content must be a string"),
        ({"temperature": 5}, "temperature", "between 0.0 and 2.0"),
        ({"top_p": 1.5}, "top_p", "between 0.0 and 1.0"),
        ({"n": 2}, "n", "only n=1"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"tools": [{"type": "function"}]}, "tools", "needs a name"),
        ({"tools": [BASH], "tool_choice": 3}, "tool_choice", "tool_choice must be"),
        ({"stream": "yes"}, "stream", "boolean"),
    ],
)
async def test_bad_requests_are_400_with_the_parameter(proxy, overrides, param, match):
    endpoint = proxy.open_session("r-bad")
    body = {"model": "policy", "messages": USER, **overrides}
    async with openai.AsyncOpenAI(
        base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
    ) as client:
        with pytest.raises(openai.BadRequestError, match=match) as raised:
            await client.post("/chat/completions", body=body, cast_to=object)
    error = raised.value.body
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert await proxy.settle("r-bad", timeout=5) == ()
    assert proxy.session("r-bad").failed_calls == 0


async def test_a_prompt_longer_than_the_context_is_400(proxy):
    endpoint = proxy.open_session("r-long")
    async with openai.AsyncOpenAI(
        base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
    ) as client:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match="context holds 512") as raised:
                await client.chat.completions.create(
                    model="policy",
                    messages=[{"role": "user", "content": "word " * 2000}],
                    stream=stream,
                )
            assert raised.value.code == "context_length_exceeded"
    assert await proxy.settle("r-long", timeout=5) == ()
    assert proxy.session("r-long").failed_calls == 2


async def test_invalid_json_is_400(proxy):
    endpoint = proxy.open_session("r-json")
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{endpoint.base_url}/chat/completions",
            data=b"{not json",
            headers={"Content-Type": "application/json"},
        ) as response,
    ):
        assert response.status == 400
        body = await response.json()
    assert "not valid JSON" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"


async def test_an_unknown_rollout_is_404_and_a_missing_key_401(proxy):
    async with openai.AsyncOpenAI(
        base_url=f"{proxy.url}/rollouts/nobody/v1", api_key="x", max_retries=0
    ) as client:
        with pytest.raises(openai.NotFoundError) as raised:
            await client.chat.completions.create(model="policy", messages=USER)
    assert raised.value.code == "rollout_not_found"
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{proxy.url}/v1/chat/completions", json={"messages": USER}) as response,
    ):
        assert response.status == 401
        assert (await response.json())["error"]["code"] == "invalid_api_key"


async def test_a_closed_session_takes_no_more_calls(proxy):
    endpoint = proxy.open_session("r-closed")
    proxy.close_session("r-closed")
    async with openai.AsyncOpenAI(
        base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
    ) as client:
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="policy", messages=USER)


def test_bad_rollout_ids_and_duplicate_sessions(proxy):
    with pytest.raises(ValueError, match="must be 1-200 characters"):
        proxy.open_session("a/b")
    proxy.open_session("r-dup")
    with pytest.raises(ValueError, match="already open"):
        proxy.open_session("r-dup")
