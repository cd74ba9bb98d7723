"""The side requests harnesses make before and beside their model calls get cheap, sensible
answers from the capture proxy, in each dialect's shape where the shapes differ; unknown paths
get a JSON 404."""

from __future__ import annotations

import aiohttp
import anthropic
import openai
import pytest

from .conftest import WEIGHT_VERSION

ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}


@pytest.mark.parametrize("prefix", ["", "/rollouts/r-side"])
async def test_probes_answer_without_a_session(proxy, prefix):
    async with aiohttp.ClientSession() as http:
        for path in ("/", "/api/hello", "/health"):
            async with http.head(f"{proxy.url}{prefix}{path}") as response:
                assert response.status == 200, path
            async with http.get(f"{proxy.url}{prefix}{path}") as response:
                assert (await response.json()) == {"status": "ok"}
        async with http.get(f"{proxy.url}{prefix}/api/tags") as response:
            [model] = (await response.json())["models"]
        assert model["name"] == WEIGHT_VERSION
        async with http.post(f"{proxy.url}{prefix}/api/show", json={"model": "x"}) as response:
            show = await response.json()
        assert show["model_info"]["orchard.context_length"] == 512
        for path in ("/v1/props", "/props"):
            async with http.get(f"{proxy.url}{prefix}{path}") as response:
                props = await response.json()
            assert props["default_generation_settings"]["n_ctx"] == 512
        async with http.get(f"{proxy.url}{prefix}/api/version") as response:
            assert "version" in await response.json()


async def test_models_in_each_dialects_shape(proxy):
    endpoint = proxy.open_session("r-models")
    async with openai.AsyncOpenAI(
        base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
    ) as client:
        listed = await client.models.list()
        named = await client.models.retrieve("org/policy")
    assert [m.id for m in listed.data] == [WEIGHT_VERSION]
    assert named.id == "org/policy" and named.model_extra["max_model_len"] == 512
    async with anthropic.AsyncAnthropic(
        base_url=endpoint.anthropic_base_url, api_key=endpoint.api_key, max_retries=0
    ) as client:
        page = await client.models.list()
        info = await client.models.retrieve("claude-policy")
    assert [m.id for m in page.data] == [WEIGHT_VERSION]
    assert (info.id, info.type, info.max_input_tokens) == ("claude-policy", "model", 512)


async def test_unknown_paths_are_404_with_a_json_body(proxy):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{proxy.url}/v1/embeddings", json={}) as response:
            assert response.status == 404
            body = await response.json()
        assert "no route for POST /v1/embeddings" in body["error"]["message"]
        async with http.get(f"{proxy.url}/v2/nothing", headers=ANTHROPIC_HEADERS) as response:
            assert response.status == 404
            body = await response.json()
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
        async with http.get(f"{proxy.url}/v1/messages") as response:
            assert response.status == 405
            assert "GET is not allowed" in (await response.json())["error"]["message"]


async def test_a_side_request_records_no_call(proxy):
    endpoint = proxy.open_session("r-side-none")
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{endpoint.base_url}/models") as response:
            assert response.status == 200
        async with http.head(f"{endpoint.anthropic_base_url}/api/hello") as response:
            assert response.status == 200
    assert await proxy.settle("r-side-none", timeout=5) == ()
    assert proxy.session("r-side-none").started_calls == 0
