"""The capture proxy through the official `openai` client: text and tool calls, streaming and
not, exact tokens recorded per call, sessions by path or key, many rollouts at once."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai

from orchard.lm.chat import ChatRenderer
from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig

from .conftest import ANSWER, BASH, CONTENT, TOOL_CALL, WEIGHT_VERSION

USER = [{"role": "user", "content": "List the files."}]


def client_for(endpoint) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)


async def test_a_tool_call_comes_back_parsed_and_the_tokens_are_recorded(proxy, tokenizer):
    endpoint = proxy.open_session("r-tools")
    async with client_for(endpoint) as client:
        completion = await client.chat.completions.create(
            model="policy", messages=USER, tools=[BASH], temperature=0
        )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == CONTENT
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == (TOOL_CALL.name, TOOL_CALL.arguments)
    assert call.id.startswith("call_")

    [record] = await proxy.settle("r-tools", timeout=10)
    renderer = ChatRenderer(tokenizer)
    assert record.prompt_token_ids == renderer.render(USER, [BASH]).token_ids
    assert tokenizer.decode(list(record.output_token_ids)) == ANSWER + "<|im_end|>"
    assert record.output_text == ANSWER
    assert len(record.output_logprobs) == len(record.output_token_ids)
    assert all(lp <= 0 for lp in record.output_logprobs)
    assert record.weight_version == WEIGHT_VERSION
    assert (record.rollout_id, record.seq, record.call_id) == ("r-tools", 0, completion.id)
    assert record.finish_reason == "tool_calls"
    assert record.tool_calls == (call.model_dump(),)
    assert record.request_messages == tuple(USER)
    assert record.latency_s > 0 and record.started_at > 0
    assert completion.usage.prompt_tokens == len(record.prompt_token_ids)
    assert completion.usage.completion_tokens == len(record.output_token_ids)


async def test_tool_choice_none_keeps_the_markup_as_text(proxy):
    endpoint = proxy.open_session("r-none")
    async with client_for(endpoint) as client:
        completion = await client.chat.completions.create(
            model="policy", messages=USER, tools=[BASH], tool_choice="none", temperature=0
        )
    assert completion.choices[0].message.content == ANSWER
    assert completion.choices[0].message.tool_calls is None
    assert completion.choices[0].finish_reason == "stop"


async def test_a_stop_string_ends_the_content(proxy):
    endpoint = proxy.open_session("r-stop")
    async with client_for(endpoint) as client:
        completion = await client.chat.completions.create(
            model="policy", messages=USER, stop=["look"], temperature=0
        )
    assert completion.choices[0].message.content == "Let me "
    assert completion.choices[0].finish_reason == "stop"
    [record] = await proxy.settle("r-stop", timeout=10)
    # The record keeps every sampled token, up to the one that completed the stop string.
    assert record.output_text.endswith("look")


async def test_max_tokens_cuts_the_turn(proxy):
    endpoint = proxy.open_session("r-length")
    async with client_for(endpoint) as client:
        completion = await client.chat.completions.create(
            model="policy", messages=USER, max_tokens=2, temperature=0
        )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 2


async def test_the_cap_bounds_a_call_that_asks_for_more(engine):
    """An agent program asks for tens of thousands of tokens; the policy's budget per call
    (`max_tokens_cap`) still binds, and a call asking less keeps its own bound."""
    async with CaptureProxy(engine, CaptureProxyConfig(max_tokens_cap=3)) as proxy:
        endpoint = proxy.open_session("r-cap")
        async with client_for(endpoint) as client:
            greedy = await client.chat.completions.create(
                model="policy", messages=USER, max_tokens=32000, temperature=0
            )
            modest = await client.chat.completions.create(
                model="policy", messages=USER, max_tokens=2, temperature=0
            )
    assert greedy.choices[0].finish_reason == "length"
    assert greedy.usage.completion_tokens == 3
    assert modest.usage.completion_tokens == 2


async def test_streaming_sends_the_whole_turn_parsed_once(proxy):
    endpoint = proxy.open_session("r-stream")
    async with client_for(endpoint) as client:
        stream = await client.chat.completions.create(
            model="policy",
            messages=USER,
            tools=[BASH],
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert content == CONTENT
    assert len(calls) == 1
    assert (calls[0].function.name, calls[0].function.arguments) == (
        TOOL_CALL.name,
        TOOL_CALL.arguments,
    )
    assert [f for f in finish if f] == ["tool_calls"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    [record] = await proxy.settle("r-stream", timeout=10)
    assert record.metadata["stream"] == "true"
    assert record.output_text == ANSWER
    assert chunks[0].id == record.call_id


async def test_keep_alive_comments_flow_while_sampling(engine):
    config = CaptureProxyConfig(keepalive_interval_s=0.001)
    async with CaptureProxy(engine, config) as proxy:
        endpoint = proxy.open_session("r-keepalive")
        body = {"model": "policy", "messages": USER, "stream": True, "max_tokens": 60}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{endpoint.base_url}/chat/completions", json=body) as response,
        ):
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/event-stream")
            raw = (await response.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    first_data = next(i for i, e in enumerate(events) if e.startswith("data:"))
    assert first_data > 0 and all(e == ": keep-alive" for e in events[:first_data])
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: ") :]) for e in events[first_data:-1]]
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)


async def test_the_api_key_names_the_rollout_on_the_plain_path(proxy):
    proxy.open_session("r-key")
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="r-key", max_retries=0)
    async with client:
        await client.chat.completions.create(model="policy", messages=USER, max_tokens=3)
        models = await client.models.list()
    assert [m.id for m in models.data] == [WEIGHT_VERSION]
    assert len(await proxy.settle("r-key", timeout=10)) == 1


async def test_many_rollouts_share_one_proxy(proxy, engine):
    rollouts = [f"r-many-{k}" for k in range(12)]
    endpoints = [proxy.open_session(r) for r in rollouts]

    async def rollout(endpoint, k):
        async with client_for(endpoint) as client:
            for turn in range(2):
                await client.chat.completions.create(
                    model="policy",
                    messages=[{"role": "user", "content": f"task {k} turn {turn}"}],
                    max_tokens=4,
                    seed=k,
                )

    await asyncio.gather(*(rollout(e, k) for k, e in enumerate(endpoints)))
    for k, rollout_id in enumerate(rollouts):
        records = await proxy.settle(rollout_id, timeout=10)
        assert [r.seq for r in records] == [0, 1]
        assert {r.rollout_id for r in records} == {rollout_id}
        assert [r.request_messages[0]["content"] for r in records] == [
            f"task {k} turn 0",
            f"task {k} turn 1",
        ]
    # Concurrent calls were sampled together.
    assert max(engine.batch_sizes) > 1


async def test_the_branch_header_marks_auxiliary_calls(proxy):
    endpoint = proxy.open_session("r-branch")
    async with client_for(endpoint) as client:
        await client.chat.completions.create(model="policy", messages=USER, max_tokens=2)
        await client.chat.completions.create(
            model="policy",
            messages=USER,
            max_tokens=2,
            extra_headers={"X-Orchard-Branch": "compaction"},
        )
    records = await proxy.settle("r-branch", timeout=10)
    assert [r.branch for r in records] == ["", "compaction"]
