"""The scripted policy over real HTTP on loopback, driven by the official openai client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from orchard.rollout.scripted_policy import PolicyScript, ScriptedPolicyServer

SCRIPT = {
    "plans": [
        {
            "match": "fix calc",
            "solve_rate": 0.5,
            "solution": [
                {"thought": "The sum is wrong; I will fix it.", "tool": "bash",
                 "arguments": {"command": "echo fixed"}},
                {"thought": "Done.", "tool": "submit", "arguments": {}},
            ],
            "failure": [
                {"thought": "I think the tests are wrong.", "tool": "submit", "arguments": {}},
            ],
        }
    ]
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("bash", "submit")
]


@pytest.fixture
async def server() -> AsyncIterator[ScriptedPolicyServer]:
    async with ScriptedPolicyServer(PolicyScript.from_json(SCRIPT), seed=7) as running:
        yield running


@pytest.fixture
async def client(server: ScriptedPolicyServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as c:
        yield c


def conversation(*replies: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "please fix calc"},
        *replies,
    ]


async def test_both_paths_are_drawn_and_each_is_followed_to_its_end(
    client: openai.AsyncOpenAI,
) -> None:
    firsts = set()
    for _ in range(20):
        reply = await client.chat.completions.create(
            model="m",
            messages=conversation(),
            tools=TOOLS,  # type: ignore[arg-type]
        )
        firsts.add(reply.choices[0].message.content)
    assert firsts == {"The sum is wrong; I will fix it.", "I think the tests are wrong."}

    first = {"role": "assistant", "content": "The sum is wrong; I will fix it."}
    second = await client.chat.completions.create(
        model="m",
        messages=conversation(first, {"role": "tool", "tool_call_id": "a", "content": "ok"}),  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
    )
    choice = second.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    assert choice.message.tool_calls[0].function.name == "submit"  # type: ignore[union-attr]
    assert second.usage is not None and second.usage.completion_tokens > 0


async def test_a_tool_that_is_not_offered_becomes_a_plain_answer(
    client: openai.AsyncOpenAI,
) -> None:
    for _ in range(10):
        reply = await client.chat.completions.create(model="m", messages=conversation())  # type: ignore[arg-type]
        assert reply.choices[0].finish_reason == "stop"
        assert reply.choices[0].message.tool_calls is None


async def test_streaming_gives_the_same_turn_in_chunks(client: openai.AsyncOpenAI) -> None:
    first = {"role": "assistant", "content": "I think the tests are wrong."}
    stream = await client.chat.completions.create(
        model="m",
        messages=conversation(first, {"role": "tool", "tool_call_id": "a", "content": "ok"}),  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        stream=True,
    )
    text, finish = "", None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        text += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    # The failure path had one step; past it the policy says it is done.
    assert text == "I have nothing more to do."
    assert finish == "stop"


async def test_an_unknown_task_gets_a_final_answer(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "write a poem"}],
        tools=TOOLS,  # type: ignore[arg-type]
    )
    assert reply.choices[0].message.content == "I do not know how to solve this task."


async def test_bad_requests_get_400_with_an_openai_error(
    client: openai.AsyncOpenAI, server: ScriptedPolicyServer
) -> None:
    with pytest.raises(openai.BadRequestError, match="messages"):
        await client.chat.completions.create(model="m", messages="nope")  # type: ignore[arg-type]
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{server.base_url}/chat/completions", data=b"{not json") as r:
            assert r.status == 400
            assert "not valid JSON" in (await r.json())["error"]["message"]
        async with session.get(f"{server.base_url}/models") as r:
            assert (await r.json())["data"][0]["id"] == "orchard-scripted-policy"


def test_scripts_that_cannot_be_told_apart_are_refused() -> None:
    same = {"thought": "same", "tool": "submit"}
    with pytest.raises(ValueError, match="must differ"):
        PolicyScript.from_json(
            {"plans": [{"match": "x", "solve_rate": 1, "solution": [same], "failure": [same]}]}
        )
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        PolicyScript.from_json(
            {
                "plans": [
                    {
                        "match": "x",
                        "solve_rate": 2,
                        "solution": [same],
                        "failure": [{"thought": "b"}],
                    }
                ]
            }
        )
