"""The capture proxy's Responses API through the official `openai` client: text and function
calls, streaming and not, exact tokens recorded per call, call ids round-tripping through a
function_call_output, and errors in OpenAI's shape."""

from __future__ import annotations

import json

import openai
import pytest

from orchard.lm.chat import ChatRenderer
from orchard.rollout.engines.base import SamplingParams
from orchard.rollout.proxy.responses_api import ResponsesDialect
from orchard.rollout.proxy.turns import ModelTurn, TurnRequest

from .conftest import ANSWER, BASH, CONTENT, TOOL_CALL, WEIGHT_VERSION

FLAT_BASH = {"type": "function", **BASH["function"]}
USER_TEXT = "List the files."
INPUT = [{"role": "user", "content": USER_TEXT}]


def client_for(endpoint) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)


async def test_a_function_call_comes_back_and_the_tokens_are_the_engines(proxy, engine, tokenizer):
    endpoint = proxy.open_session("r-resp")
    async with client_for(endpoint) as client:
        response = await client.responses.create(
            model="policy", input=INPUT, tools=[FLAT_BASH], temperature=0, store=False
        )
    assert response.status == "completed"
    message, call = response.output
    assert message.type == "message" and response.output_text == CONTENT
    assert call.type == "function_call"
    assert (call.name, call.arguments) == (TOOL_CALL.name, TOOL_CALL.arguments)
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")

    [record] = await proxy.settle("r-resp", timeout=10)
    renderer = ChatRenderer(tokenizer)
    prompt = renderer.render([{"role": "user", "content": USER_TEXT}], [BASH]).token_ids
    assert record.prompt_token_ids == prompt
    assert record.metadata["api"] == "responses"
    assert record.call_id == response.id and response.id.startswith("resp_")
    assert record.output_text == ANSWER
    assert record.finish_reason == "tool_calls"
    assert record.tool_calls == (
        {
            "id": call.call_id,
            "type": "function",
            "function": {"name": "bash", "arguments": TOOL_CALL.arguments},
        },
    )
    assert response.usage.input_tokens == len(prompt)
    assert response.usage.output_tokens == len(record.output_token_ids)
    # The same prompt sent to the engine directly samples the same tokens with the same logprobs.
    direct = await engine.generate(
        prompt,
        SamplingParams(max_tokens=1024, temperature=0, stop_token_ids=renderer.stop_token_ids),
    )
    assert record.output_token_ids == direct.token_ids
    assert record.output_logprobs == pytest.approx(direct.logprobs, abs=1e-4)
    assert record.weight_version == WEIGHT_VERSION


async def test_streaming_events_in_order_and_the_sdk_accumulates_them(proxy):
    endpoint = proxy.open_session("r-resp-stream")
    async with client_for(endpoint) as client:
        stream = await client.responses.create(
            model="policy", input=INPUT, tools=[FLAT_BASH], temperature=0, stream=True
        )
        events = [event async for event in stream]
        async with client.responses.stream(
            model="policy", input=INPUT, tools=[FLAT_BASH], temperature=0
        ) as managed:
            final = await managed.get_final_response()
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[4].delta == CONTENT
    assert events[10].arguments == TOOL_CALL.arguments
    completed = events[-1].response
    assert completed.usage.output_tokens > 0
    assert completed.output[1].name == "bash"
    assert final.output_text == CONTENT
    assert final.output[1].arguments == TOOL_CALL.arguments
    records = await proxy.settle("r-resp-stream", timeout=10)
    assert [r.metadata["stream"] for r in records] == ["true", "true"]
    assert records[0].call_id == events[0].response.id


async def test_call_ids_round_trip_through_a_function_call_output(proxy, tokenizer):
    endpoint = proxy.open_session("r-resp-two")
    async with client_for(endpoint) as client:
        first = await client.responses.create(
            model="policy", input=INPUT, tools=[FLAT_BASH], temperature=0, max_output_tokens=200
        )
        call = first.output[1]
        history = [
            *INPUT,
            *(item.model_dump(exclude_none=True) for item in first.output),
            {"type": "function_call_output", "call_id": call.call_id, "output": "a.txt"},
        ]
        await client.responses.create(
            model="policy", input=history, tools=[FLAT_BASH], temperature=0, max_output_tokens=8
        )
        with pytest.raises(openai.BadRequestError, match="no function_call with call_id"):
            await client.responses.create(
                model="policy",
                input=[*INPUT, {"type": "function_call_output", "call_id": "call_x", "output": ""}],
            )
    one, two = await proxy.settle("r-resp-two", timeout=10)
    expected = [
        {"role": "user", "content": USER_TEXT},
        {
            "role": "assistant",
            "content": CONTENT,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "bash", "arguments": TOOL_CALL.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "a.txt"},
    ]
    assert list(two.request_messages) == expected
    renderer = ChatRenderer(tokenizer)
    assert two.prompt_token_ids == renderer.render(expected, [BASH]).token_ids
    # The sampled turn renders back as the text the policy wrote, after the first prompt.
    first_text = renderer.render([expected[0]], [BASH]).text
    second_text = renderer.render(expected, [BASH]).text
    assert second_text.startswith(first_text + one.output_text + "<|im_end|>")
    assert two.prompt_token_ids[: len(one.prompt_token_ids)] == one.prompt_token_ids


async def test_instructions_reasoning_and_hosted_tools(proxy, tokenizer):
    endpoint = proxy.open_session("r-resp-extras")
    tools = [
        FLAT_BASH,
        {"type": "web_search"},
        {"type": "custom", "name": "apply_patch", "description": "Patch files."},
    ]
    items = [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "Be brief."}],
        },
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER_TEXT}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
    ]
    async with client_for(endpoint) as client:
        response = await client.responses.create(
            model="policy",
            instructions="You are a shell agent.",
            input=items,
            tools=tools,
            tool_choice="auto",
            parallel_tool_calls=False,
            max_output_tokens=4,
            store=False,
            include=["reasoning.encrypted_content"],
            reasoning={"effort": "low"},
        )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == "You are a shell agent."
    assert response.parallel_tool_calls is False
    [record] = await proxy.settle("r-resp-extras", timeout=10)
    expected = [
        {"role": "system", "content": "You are a shell agent."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": USER_TEXT},
    ]
    assert list(record.request_messages) == expected
    assert record.prompt_token_ids == ChatRenderer(tokenizer).render(expected, [BASH]).token_ids
    assert record.metadata["ignored_tools"] == "web_search,custom:apply_patch"
    assert record.finish_reason == "length"


async def test_tool_choice_none_keeps_the_markup_as_text(proxy):
    endpoint = proxy.open_session("r-resp-none")
    async with client_for(endpoint) as client:
        response = await client.responses.create(
            model="policy", input=USER_TEXT, tools=[FLAT_BASH], tool_choice="none", temperature=0
        )
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == ANSWER


@pytest.mark.parametrize(
    ("overrides", "param", "match"),
    [
        ({"input": []}, "input", "non-empty array"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input", "role must be one of"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "not supported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "only text content",
        ),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
        ({"temperature": 5}, "temperature", "between 0.0 and 2.0"),
        ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
        ({"tools": [{"type": "function"}]}, "tools", "needs a name"),
        ({"tool_choice": 3}, "tool_choice", "tool_choice must be"),
        ({"stream": "yes"}, "stream", "boolean"),
    ],
)
async def test_bad_requests_are_400_in_openais_shape(proxy, overrides, param, match):
    endpoint = proxy.open_session("r-resp-bad")
    body = {"model": "policy", "input": INPUT, **overrides}
    async with client_for(endpoint) as client:
        with pytest.raises(openai.BadRequestError, match=match) as raised:
            await client.post("/responses", body=body, cast_to=object)
    assert raised.value.body["type"] == "invalid_request_error"
    assert raised.value.body["param"] == param
    assert await proxy.settle("r-resp-bad", timeout=5) == ()


async def test_an_unknown_rollout_is_404_and_the_key_names_a_rollout(proxy):
    async with openai.AsyncOpenAI(
        base_url=f"{proxy.url}/rollouts/nobody/v1", api_key="x", max_retries=0
    ) as client:
        with pytest.raises(openai.NotFoundError) as raised:
            await client.responses.create(model="policy", input=USER_TEXT)
    assert raised.value.code == "rollout_not_found"
    proxy.open_session("r-resp-key")
    async with openai.AsyncOpenAI(
        base_url=f"{proxy.url}/v1", api_key="r-resp-key", max_retries=0
    ) as client:
        response = await client.responses.create(
            model="policy", input=USER_TEXT, max_output_tokens=3
        )
    [record] = await proxy.settle("r-resp-key", timeout=10)
    assert record.call_id == response.id


async def test_a_prompt_longer_than_the_context_fails_in_the_stream_shape(proxy):
    endpoint = proxy.open_session("r-resp-long")
    async with client_for(endpoint) as client:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match="context holds 512") as raised:
                await client.responses.create(model="policy", input="word " * 2000, stream=stream)
            assert raised.value.code == "context_length_exceeded"
    assert proxy.session("r-resp-long").failed_calls == 2


def test_each_stream_event_names_its_type():
    # The stream's events are plain JSON objects with their type, as the SDK reads them.
    request = TurnRequest(
        api="responses",
        model="m",
        messages=(),
        tools=(),
        parse_tool_calls=True,
        stream=True,
        max_tokens=None,
        temperature=1.0,
        top_p=1.0,
        stop=(),
        seed=None,
    )
    turn = ModelTurn(
        id="resp_1",
        created=0,
        model="m",
        content="hi",
        tool_calls=(),
        finish_reason="stop",
        prompt_tokens=3,
        completion_tokens=1,
    )
    stream = ResponsesDialect().stream(request, turn_id="resp_1", model="m", prompt_tokens=3)
    raw = (stream.opening() + stream.turn(turn)).decode()
    for event in filter(None, raw.split("\n\n")):
        name, data = event.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
