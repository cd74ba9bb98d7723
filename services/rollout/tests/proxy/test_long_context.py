"""A long-context model (the shape of the built-in `tiny-32k`) on the local engine behind the
capture proxy: a prompt the size of a real agent program's system prompt and tool schemas
(20k tokens) is answered and recorded token for token, also beside a short prompt in the
same batch, and a prompt past the 32k context is a 400 in each dialect's own error shape."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest

from orchard.lm.chat import ChatRenderer
from orchard.lm.model_folder import save_model_folder
from orchard.lm.models import tiny_causal_lm_for
from orchard.rollout.engines.local import LocalEngine, LocalEngineConfig
from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig

CONTEXT = 32_768
RULE_TEXT = (
    "always never run the tests before you edit a file read it first keep changes small "
    "when the user asks for a command explain what it does and why a tool call returns its "
    "output as text ask before deleting files commit only when told to use absolute paths"
)
WORDS = RULE_TEXT.split()


def harness_prompt(paragraphs: int, tools: int, seed: int = 0):
    """A system prompt and tool schemas shaped like an agent program's: many paragraphs of
    rules, many tools with described parameters."""
    rng = random.Random(seed)

    def sentence(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."

    system = "\n\n".join(
        f"## Rule {k}\n" + " ".join(sentence(12) for _ in range(6)) for k in range(paragraphs)
    )
    schemas = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{k}",
                "description": sentence(30),
                "parameters": {
                    "type": "object",
                    "properties": {
                        f"arg_{j}": {"type": "string", "description": sentence(10)}
                        for j in range(3)
                    },
                    "required": ["arg_0"],
                },
            },
        }
        for k in range(tools)
    ]
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Fix the failing test in src/app.py."},
    ]
    return messages, schemas


@pytest.fixture(scope="module")
def long_folder(tokenizer, tmp_path_factory) -> Path:
    model = tiny_causal_lm_for(tokenizer, seed=0, context=CONTEXT)
    return save_model_folder(tmp_path_factory.mktemp("models") / "tiny-32k", model, tokenizer)


@pytest.fixture
async def long_proxy(long_folder):
    config = LocalEngineConfig(
        # A window long enough for the long prompt's rendering to join the short one's batch.
        model_folder=str(long_folder),
        weight_version="tiny-32k",
        batch_window_s=0.5,
    )
    async with (
        LocalEngine(config) as engine,
        CaptureProxy(engine, CaptureProxyConfig(settle_quiet_s=0.05)) as proxy,
    ):
        yield proxy


def openai_client(endpoint) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)


@pytest.mark.slow
async def test_a_harness_sized_prompt_is_answered_and_recorded(long_proxy, tokenizer):
    messages, tools = harness_prompt(paragraphs=110, tools=30)
    expected = ChatRenderer(tokenizer).render(messages, tools).token_ids
    assert 16_384 <= len(expected) < CONTEXT
    short = [{"role": "user", "content": "Hi"}]
    endpoint = long_proxy.open_session("r-long")
    async with (
        openai_client(endpoint) as client,
        aiohttp.ClientSession() as http,
        http.get(f"{endpoint.base_url}/models/policy") as response,
    ):
        # Harnesses size their prompts from what the side requests report.
        assert (await response.json())["max_model_len"] == CONTEXT
        # The long prompt and a short one arrive together: one batch, both answered.
        long_call, short_call = await asyncio.gather(
            client.chat.completions.create(
                model="policy", messages=messages, tools=tools, max_tokens=8, temperature=0
            ),
            client.chat.completions.create(
                model="policy", messages=short, max_tokens=8, temperature=0
            ),
        )
        alone = await client.chat.completions.create(
            model="policy", messages=short, max_tokens=8, temperature=0
        )
    assert long_proxy.engine.batch_sizes == [2, 1]
    assert long_call.usage.prompt_tokens == len(expected)
    records = {r.call_id: r for r in await long_proxy.settle("r-long", timeout=30)}
    record = records[long_call.id]
    assert record.prompt_token_ids == expected
    assert len(record.output_token_ids) == long_call.usage.completion_tokens > 0
    assert len(record.output_logprobs) == len(record.output_token_ids)
    assert record.weight_version == "tiny-32k"
    # The short prompt sampled beside the long one samples what it samples alone.
    assert records[short_call.id].output_token_ids == records[alone.id].output_token_ids


async def test_a_prompt_past_the_context_is_a_400_in_each_dialect(long_proxy, tokenizer):
    messages, tools = harness_prompt(paragraphs=200, tools=40)
    assert len(ChatRenderer(tokenizer).render(messages, tools).token_ids) > CONTEXT
    endpoint = long_proxy.open_session("r-over")
    async with openai_client(endpoint) as client:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match=f"context holds {CONTEXT}") as raised:
                await client.chat.completions.create(
                    model="policy", messages=messages, tools=tools, stream=stream
                )
            assert raised.value.code == "context_length_exceeded"
            assert raised.value.body["type"] == "invalid_request_error"
    async with anthropic.AsyncAnthropic(
        base_url=endpoint.anthropic_base_url, api_key=endpoint.api_key, max_retries=0
    ) as claude:
        with pytest.raises(anthropic.BadRequestError, match=f"context holds {CONTEXT}") as refused:
            await claude.messages.create(
                model="policy",
                max_tokens=8,
                system=messages[0]["content"],
                messages=[{"role": "user", "content": messages[1]["content"]}],
                tools=[
                    {
                        "name": t["function"]["name"],
                        "description": t["function"]["description"],
                        "input_schema": t["function"]["parameters"],
                    }
                    for t in tools
                ],
            )
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert await long_proxy.settle("r-over", timeout=5) == ()
    assert long_proxy.session("r-over").failed_calls == 3
