"""A scripted teacher behind the capture proxy: every dialect's official client gets the
teacher's step as a call of the tool its request offered (whatever that tool is called), and the
call is captured in the tokenizer's chat template as a model of it would have sampled it."""

from __future__ import annotations

import json

import anthropic
import openai

from orchard.lm.chat import ChatRenderer, ToolCall, format_assistant_text
from orchard.rollout.engines.scripted import ScriptedEngine
from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig
from orchard.rollout.scripted_policy import PolicyScript

TASK = "Tidy the inbox of Ana."
SCRIPT = PolicyScript.from_json(
    {
        "plans": [
            {
                "match": "inbox of Ana",
                "solve_rate": 1.0,
                "solution": [
                    {
                        "thought": "I list it.",
                        "tool": "shell",
                        "arguments": {"command": "mail list"},
                    },
                    {"thought": "Done."},
                ],
                "failure": [{"thought": "No."}],
            }
        ]
    }
)
SCHEMA = {
    "type": "object",
    "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
    "required": ["command", "description"],
}


async def test_each_dialect_gets_the_step_in_its_own_shell_tool_and_it_is_captured(tokenizer):
    engine = ScriptedEngine(SCRIPT, tokenizer, seed=0)
    renderer = ChatRenderer(tokenizer)
    async with CaptureProxy(engine, CaptureProxyConfig(settle_quiet_s=0.05)) as proxy:
        endpoint = proxy.open_session("r-chat")
        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
        ) as client:
            tools = [{"type": "function", "function": {"name": "exec", "parameters": SCHEMA}}]
            messages = [{"role": "user", "content": TASK}]
            chat = await client.chat.completions.create(
                model="teacher", messages=messages, tools=tools
            )
            [call] = chat.choices[0].message.tool_calls
            assert call.function.name == "exec"
            assert json.loads(call.function.arguments) == {
                "command": "mail list",
                "description": "Run: mail list",
            }
            messages += [
                chat.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "m1 hello"},
            ]
            second = await client.chat.completions.create(
                model="teacher", messages=messages, tools=tools
            )
            assert second.choices[0].message.content == "Done."
            assert not second.choices[0].message.tool_calls

        endpoint = proxy.open_session("r-responses")
        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
        ) as client:
            response = await client.responses.create(
                model="teacher",
                input=f"<environment>cwd /srv</environment>\n{TASK}",
                tools=[
                    {
                        "type": "function",
                        "name": "shell",
                        "parameters": {
                            "type": "object",
                            "properties": {"command": {"type": "array", "items": {}}},
                        },
                        "strict": False,
                    }
                ],
            )
            [item] = [o for o in response.output if o.type == "function_call"]
            assert (item.name, json.loads(item.arguments)) == (
                "shell",
                {"command": ["bash", "-lc", "mail list"]},
            )

        endpoint = proxy.open_session("r-messages")
        async with anthropic.AsyncAnthropic(
            base_url=endpoint.anthropic_base_url, api_key=endpoint.api_key, max_retries=0
        ) as claude:
            message = await claude.messages.create(
                model="teacher",
                max_tokens=500,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
                            {"type": "text", "text": TASK},
                        ],
                    }
                ],
                tools=[{"name": "Bash", "input_schema": SCHEMA}],
            )
        [use] = [b for b in message.content if b.type == "tool_use"]
        assert (use.name, use.input["command"]) == ("Bash", "mail list")

        first, last = await proxy.settle("r-chat", timeout=10)
        [in_responses] = await proxy.settle("r-responses", timeout=10)
        [in_messages] = await proxy.settle("r-messages", timeout=10)
    assert engine.turns == 4
    expected = format_assistant_text(
        "I list it.",
        [ToolCall("exec", json.dumps({"command": "mail list", "description": "Run: mail list"}))],
    )
    # The turn in the chat template's tokens, ended by the stop token, as a model samples it.
    assert renderer.parse(first.output_token_ids)[0] == expected
    assert first.output_token_ids[-1] == renderer.stop_token_ids[0]
    assert first.output_logprobs == (0.0,) * len(first.output_token_ids)
    assert first.weight_version == "scripted:orchard-scripted-policy"
    assert first.prompt_token_ids == renderer.render(messages[:1], tools).token_ids
    # The next prompt holds the first call's prompt and output: one path of a prefix tree.
    head = first.prompt_token_ids + first.output_token_ids
    assert last.prompt_token_ids[: len(head)] == head
    assert (in_responses.metadata["api"], in_messages.metadata["api"]) == ("responses", "messages")
