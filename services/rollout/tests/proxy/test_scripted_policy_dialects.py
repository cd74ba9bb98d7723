"""The scripted policy's server answers every dialect the capture proxy speaks, through the same
dialect modules: a two-step plan played through the official `openai` (chat completions and
Responses) and `anthropic` clients, streaming and not, with the request's tools passed to
`ScriptedPolicy.next_step`."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from orchard.rollout.scripted_policy import PolicyScript, ScriptedPolicyServer

from .conftest import BASH

SCRIPT = PolicyScript.from_json(
    {
        "model": "teacher",
        "plans": [
            {
                "match": "list the files",
                "solve_rate": 1.0,
                "solution": [
                    {"thought": "Listing.", "tool": "bash", "arguments": {"command": "ls"}},
                    {"thought": "Done."},
                ],
                "failure": [{"thought": "No."}],
            }
        ],
    }
)
TASK = "Please list the files."
FLAT_BASH = {"type": "function", **BASH["function"]}
ANTHROPIC_BASH = {
    "name": "bash",
    "description": "Run a shell command.",
    "input_schema": BASH["function"]["parameters"],
}


@pytest.fixture
async def teacher():
    async with ScriptedPolicyServer(SCRIPT, seed=0) as server:
        seen: list[list[str]] = []
        decide = server.policy.next_step

        def next_step(messages, tools):
            seen.append([t["function"]["name"] for t in tools])
            return decide(messages, tools)

        server.policy.next_step = next_step  # type: ignore[method-assign]
        server.tools_seen = seen  # type: ignore[attr-defined]
        yield server


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_completions(teacher, stream):
    async with openai.AsyncOpenAI(base_url=teacher.base_url, api_key="x", max_retries=0) as client:
        messages = [{"role": "user", "content": TASK}]
        if stream:
            chunks = [
                c
                async for c in await client.chat.completions.create(
                    model="teacher", messages=messages, tools=[BASH], stream=True
                )
            ]
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            [call] = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
        else:
            reply = await client.chat.completions.create(
                model="teacher", messages=messages, tools=[BASH]
            )
            content = reply.choices[0].message.content
            [call] = reply.choices[0].message.tool_calls
        assert content == "Listing."
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "bash",
            {"command": "ls"},
        )
        messages += [
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [call.model_dump(exclude_none=True)],
            },
            {"role": "tool", "tool_call_id": call.id, "content": "a.txt"},
        ]
        last = await client.chat.completions.create(
            model="teacher", messages=messages, tools=[BASH]
        )
    assert last.choices[0].message.content == "Done."
    assert teacher.tools_seen == [["bash"], ["bash"]]


@pytest.mark.parametrize("stream", [False, True])
async def test_responses(teacher, stream):
    async with openai.AsyncOpenAI(base_url=teacher.base_url, api_key="x", max_retries=0) as client:
        items: list[dict] = [{"role": "user", "content": TASK}]
        if stream:
            async with client.responses.stream(
                model="teacher", input=items, tools=[FLAT_BASH]
            ) as s:
                first = await s.get_final_response()
        else:
            first = await client.responses.create(model="teacher", input=items, tools=[FLAT_BASH])
        assert first.output_text == "Listing."
        call = first.output[1]
        assert (call.name, json.loads(call.arguments)) == ("bash", {"command": "ls"})
        items += [item.model_dump(exclude_none=True) for item in first.output]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "a.txt"})
        last = await client.responses.create(model="teacher", input=items, tools=[FLAT_BASH])
    assert last.output_text == "Done."
    assert last.status == "completed"


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_messages(teacher, stream):
    async with anthropic.AsyncAnthropic(
        base_url=teacher.root_url, api_key="x", max_retries=0
    ) as client:
        messages: list[dict] = [{"role": "user", "content": TASK}]
        if stream:
            async with client.messages.stream(
                model="teacher", max_tokens=100, messages=messages, tools=[ANTHROPIC_BASH]
            ) as s:
                first = await s.get_final_message()
        else:
            first = await client.messages.create(
                model="teacher", max_tokens=100, messages=messages, tools=[ANTHROPIC_BASH]
            )
        text, tool_use = first.content
        assert (text.text, tool_use.name, tool_use.input) == ("Listing.", "bash", {"command": "ls"})
        assert first.stop_reason == "tool_use"
        messages += [
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in first.content],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": tool_use.id, "content": "a.txt"}
                ],
            },
        ]
        last = await client.messages.create(
            model="teacher", max_tokens=100, messages=messages, tools=[ANTHROPIC_BASH]
        )
        counted = await client.messages.count_tokens(model="teacher", messages=messages)
        with pytest.raises(anthropic.BadRequestError) as raised:
            await client.messages.create(model="teacher", max_tokens=100, messages=[])
    assert (last.content[0].text, last.stop_reason) == ("Done.", "end_turn")
    assert counted.input_tokens > 0
    assert raised.value.body["error"]["type"] == "invalid_request_error"


async def test_a_tool_not_offered_is_not_called(teacher):
    async with openai.AsyncOpenAI(base_url=teacher.base_url, api_key="x", max_retries=0) as client:
        response = await client.responses.create(
            model="teacher", input=TASK, tools=[{"type": "web_search"}]
        )
    assert [item.type for item in response.output] == ["message"]
    assert teacher.tools_seen == [[]]
