"""The capture proxy's Anthropic Messages API through the official `anthropic` client: text and
tool_use blocks, streaming and not (with pings while sampling), exact tokens recorded per call,
tool_use ids round-tripping through tool_result blocks, count_tokens with the real tokenizer, and
errors in Anthropic's shape."""

from __future__ import annotations

import json

import aiohttp
import anthropic
import pytest

from orchard.lm.chat import ChatRenderer
from orchard.rollout.engines.base import SamplingParams
from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig

from .conftest import ANSWER, BASH, CONTENT, TOOL_CALL, WEIGHT_VERSION

TOOL = {
    "name": "bash",
    "description": BASH["function"]["description"],
    "input_schema": BASH["function"]["parameters"],
}
USER_TEXT = "List the files."
MESSAGES = [{"role": "user", "content": USER_TEXT}]
GREEDY = {"temperature": 0}
"""Anthropic's client has no temperature parameter (the API takes one): sent as an extra."""


def client_for(endpoint) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=endpoint.anthropic_base_url, api_key=endpoint.api_key, max_retries=0
    )


async def test_a_tool_use_comes_back_and_the_tokens_are_the_engines(proxy, engine, tokenizer):
    endpoint = proxy.open_session("r-msg")
    async with client_for(endpoint) as client:
        message = await client.messages.create(
            model="policy", max_tokens=200, messages=MESSAGES, tools=[TOOL], extra_body=GREEDY
        )
    assert message.stop_reason == "tool_use"
    text, tool_use = message.content
    assert text.type == "text" and text.text == CONTENT
    assert tool_use.type == "tool_use" and tool_use.name == "bash"
    assert tool_use.input == json.loads(TOOL_CALL.arguments)
    assert tool_use.id.startswith("toolu_")

    [record] = await proxy.settle("r-msg", timeout=10)
    renderer = ChatRenderer(tokenizer)
    prompt = renderer.render(MESSAGES, [BASH]).token_ids
    assert record.prompt_token_ids == prompt
    assert record.metadata["api"] == "messages"
    assert record.call_id == message.id and message.id.startswith("msg_")
    assert record.output_text == ANSWER
    assert record.tool_calls[0]["id"] == tool_use.id
    assert message.usage.input_tokens == len(prompt)
    assert message.usage.output_tokens == len(record.output_token_ids)
    direct = await engine.generate(
        prompt,
        SamplingParams(max_tokens=200, temperature=0, stop_token_ids=renderer.stop_token_ids),
    )
    assert record.output_token_ids == direct.token_ids
    assert record.output_logprobs == pytest.approx(direct.logprobs, abs=1e-4)
    assert record.weight_version == WEIGHT_VERSION


async def test_streaming_events_in_order_and_the_sdk_accumulates_them(proxy):
    endpoint = proxy.open_session("r-msg-stream")
    async with client_for(endpoint) as client:
        stream = await client.messages.create(
            model="policy",
            max_tokens=200,
            messages=MESSAGES,
            tools=[TOOL],
            extra_body=GREEDY,
            stream=True,
        )
        events = [event async for event in stream]
        async with client.messages.stream(
            model="policy", max_tokens=200, messages=MESSAGES, tools=[TOOL], extra_body=GREEDY
        ) as managed:
            final = await managed.get_final_message()
    assert [e.type for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[2].delta.text == CONTENT
    assert events[5].delta.partial_json == TOOL_CALL.arguments
    assert events[7].delta.stop_reason == "tool_use" and events[7].usage.output_tokens > 0
    assert final.content[0].text == CONTENT
    assert final.content[1].input == json.loads(TOOL_CALL.arguments)
    assert final.stop_reason == "tool_use"
    records = await proxy.settle("r-msg-stream", timeout=10)
    assert [r.metadata["stream"] for r in records] == ["true", "true"]
    assert events[0].message.id == records[0].call_id
    assert events[0].message.usage.input_tokens == len(records[0].prompt_token_ids)


async def test_pings_flow_while_sampling(engine):
    config = CaptureProxyConfig(keepalive_interval_s=0.001)
    async with CaptureProxy(engine, config) as proxy:
        endpoint = proxy.open_session("r-msg-ping")
        body = {"model": "policy", "max_tokens": 60, "messages": MESSAGES, "stream": True}
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"{endpoint.anthropic_base_url}/v1/messages?beta=true",
                json=body,
                headers={"anthropic-version": "2023-06-01"},
            ) as response,
        ):
            assert response.status == 200
            raw = (await response.read()).decode()
    names = [e.split("\n")[0] for e in raw.split("\n\n") if e]
    assert names[0] == "event: message_start"
    assert names[1] == "event: ping" and names[-1] == "event: message_stop"
    first_block = names.index("event: content_block_start")
    assert set(names[1:first_block]) == {"event: ping"}


async def test_tool_use_ids_round_trip_through_tool_results(proxy, tokenizer):
    endpoint = proxy.open_session("r-msg-two")
    system = [
        {"type": "text", "text": "You are a shell agent.", "cache_control": {"type": "ephemeral"}}
    ]
    async with client_for(endpoint) as client:
        first = await client.beta.messages.create(
            model="policy",
            max_tokens=200,
            system=system,
            messages=MESSAGES,
            tools=[TOOL],
            extra_body=GREEDY,
            metadata={"user_id": "someone"},
            betas=["interleaved-thinking-2025-05-14"],
        )
        tool_use = first.content[1]
        history = [
            *MESSAGES,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    *(block.model_dump(exclude_none=True) for block in first.content),
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": tool_use.id,
                        "content": [{"type": "text", "text": "a.txt"}],
                        "is_error": False,
                    },
                    {"type": "text", "text": "Go on."},
                ],
            },
        ]
        await client.messages.create(
            model="policy",
            max_tokens=8,
            system=system,
            messages=history,
            tools=[TOOL],
            extra_body=GREEDY,
            thinking={"type": "disabled"},
            extra_headers={"anthropic-beta": "fine-grained-tool-streaming-2025-05-14"},
        )
        with pytest.raises(anthropic.BadRequestError, match="names no tool_use"):
            await client.messages.create(
                model="policy",
                max_tokens=8,
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}],
                    }
                ],
            )
    one, two = await proxy.settle("r-msg-two", timeout=10)
    expected = [
        {"role": "system", "content": "You are a shell agent."},
        {"role": "user", "content": USER_TEXT},
        {
            "role": "assistant",
            "content": CONTENT,
            "tool_calls": [
                {
                    "id": tool_use.id,
                    "type": "function",
                    "function": {"name": "bash", "arguments": TOOL_CALL.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": tool_use.id, "content": "a.txt"},
        {"role": "user", "content": [{"type": "text", "text": "Go on."}]},
    ]
    assert list(two.request_messages) == expected
    renderer = ChatRenderer(tokenizer)
    assert one.prompt_token_ids == renderer.render(expected[:2], [BASH]).token_ids
    assert two.prompt_token_ids == renderer.render(expected, [BASH]).token_ids
    # The sampled turn renders back as the text the policy wrote, after the first prompt.
    first_text = renderer.render(expected[:2], [BASH]).text
    assert renderer.render(expected, [BASH]).text.startswith(
        first_text + one.output_text + "<|im_end|>"
    )


async def test_system_messages_among_the_messages_render_where_they_stand(proxy, tokenizer):
    # As Claude Code sends its environment, with fields that change nothing here.
    endpoint = proxy.open_session("r-msg-system")
    messages = [
        {"role": "user", "content": [{"type": "text", "text": USER_TEXT}]},
        {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /srv"}]},
    ]
    async with client_for(endpoint) as client:
        await client.messages.create(
            model="policy",
            max_tokens=3,
            system="Be brief.",
            messages=messages,
            tools=[TOOL],
            thinking={"type": "adaptive"},
            output_config={"effort": "high"},
            extra_body={"context_management": {"edits": [{"type": "clear_thinking_20251015"}]}},
        )
    [record] = await proxy.settle("r-msg-system", timeout=10)
    expected = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": USER_TEXT}]},
        {"role": "system", "content": "# Environment\ncwd: /srv"},
    ]
    assert list(record.request_messages) == expected
    assert record.prompt_token_ids == ChatRenderer(tokenizer).render(expected, [BASH]).token_ids


async def test_count_tokens_is_the_rendered_prompt_length(proxy, tokenizer):
    endpoint = proxy.open_session("r-msg-count")
    async with client_for(endpoint) as client:
        counted = await client.messages.count_tokens(
            model="policy", system="Be brief.", messages=MESSAGES, tools=[TOOL]
        )
        message = await client.messages.create(
            model="policy", max_tokens=3, system="Be brief.", messages=MESSAGES, tools=[TOOL]
        )
    [record] = await proxy.settle("r-msg-count", timeout=10)
    assert counted.input_tokens == len(record.prompt_token_ids) == message.usage.input_tokens
    system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    assert counted.input_tokens == len(ChatRenderer(tokenizer).render(system, [BASH]).token_ids)


async def test_stop_sequences_and_max_tokens_set_the_stop_reason(proxy):
    endpoint = proxy.open_session("r-msg-stop")
    async with client_for(endpoint) as client:
        stopped = await client.messages.create(
            model="policy",
            max_tokens=200,
            messages=MESSAGES,
            stop_sequences=["look"],
            extra_body=GREEDY,
        )
        cut = await client.messages.create(
            model="policy", max_tokens=2, messages=MESSAGES, extra_body=GREEDY
        )
        plain = await client.messages.create(
            model="policy",
            max_tokens=200,
            messages=MESSAGES,
            tools=[TOOL],
            tool_choice={"type": "none"},
            extra_body=GREEDY,
        )
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "look")
    assert stopped.content[0].text == "Let me "
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    assert plain.stop_reason == "end_turn" and plain.content[0].text == ANSWER


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"max_tokens": None}, "max_tokens is required"),
        ({"messages": []}, "non-empty array"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "must be 'user', 'assistant' or"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "'image' blocks are not supported",
        ),
        ({"temperature": 1.5}, "between 0.0 and 1.0"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice must be"),
        ({"tools": [{"name": "x"}]}, "input_schema must be an object"),
        ({"system": 3}, "system must be a string"),
    ],
)
async def test_bad_requests_are_400_in_anthropics_shape(proxy, overrides, match):
    endpoint = proxy.open_session("r-msg-bad")
    body = {"model": "policy", "max_tokens": 10, "messages": MESSAGES, **overrides}
    body = {k: v for k, v in body.items() if v is not None}
    async with client_for(endpoint) as client:
        with pytest.raises(anthropic.BadRequestError, match=match) as raised:
            await client.post("/v1/messages", body=body, cast_to=object)
    assert raised.value.body["type"] == "error"
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert await proxy.settle("r-msg-bad", timeout=5) == ()


async def test_invalid_json_is_400_in_anthropics_shape(proxy):
    endpoint = proxy.open_session("r-msg-json")
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{endpoint.anthropic_base_url}/v1/messages",
            data=b"{not json",
            headers={"Content-Type": "application/json"},
        ) as response,
    ):
        assert response.status == 400
        body = await response.json()
    assert body["type"] == "error" and "not valid JSON" in body["error"]["message"]


async def test_the_key_names_the_rollout_and_an_unknown_one_is_404(proxy):
    proxy.open_session("r-msg-key")
    async with anthropic.AsyncAnthropic(
        base_url=proxy.url, api_key="r-msg-key", max_retries=0
    ) as client:
        message = await client.messages.create(model="policy", max_tokens=3, messages=MESSAGES)
    [record] = await proxy.settle("r-msg-key", timeout=10)
    assert record.call_id == message.id
    async with anthropic.AsyncAnthropic(
        base_url=proxy.url, api_key="nobody", max_retries=0
    ) as client:
        with pytest.raises(anthropic.NotFoundError) as raised:
            await client.messages.create(model="policy", max_tokens=3, messages=MESSAGES)
    assert raised.value.body["error"]["type"] == "not_found_error"
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{proxy.url}/v1/messages",
            json={"model": "policy", "max_tokens": 3, "messages": MESSAGES},
            headers={"anthropic-version": "2023-06-01"},
        ) as response,
    ):
        assert response.status == 401
        body = await response.json()
    assert body["error"]["type"] == "authentication_error"


async def test_a_prompt_longer_than_the_context_is_400(proxy):
    endpoint = proxy.open_session("r-msg-long")
    async with client_for(endpoint) as client:
        for stream in (False, True):
            with pytest.raises(anthropic.BadRequestError, match="context holds 512"):
                await client.messages.create(
                    model="policy",
                    max_tokens=10,
                    messages=[{"role": "user", "content": "word " * 2000}],
                    stream=stream,
                )
    assert proxy.session("r-msg-long").failed_calls == 2
