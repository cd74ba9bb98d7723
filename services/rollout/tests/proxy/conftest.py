"""Fixtures of the proxy tests: a tiny model trained in a few steps to answer every chat prompt
with some text and a bash tool call, a local engine on it, and a capture proxy in front of that
on a loopback port."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from orchard.lm.chat import IM_END, ChatRenderer, ToolCall, format_assistant_text
from orchard.lm.model_folder import save_model_folder
from orchard.lm.models import tiny_causal_lm_for
from orchard.lm.tokenizer import build_tokenizer
from orchard.rollout.engines.local import LocalEngine, LocalEngineConfig
from orchard.rollout.proxy.server import CaptureProxy, CaptureProxyConfig

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}
CONTENT = "Let me look."
TOOL_CALL = ToolCall("bash", '{"command": "ls"}')
ANSWER = format_assistant_text(CONTENT, [TOOL_CALL])
"""What the trained model answers to any prompt: some text, then a bash tool call."""
USER_TEXTS = ("List the files.", "Run the tests.", "Hi", "What is 2 + 2?")
WEIGHT_VERSION = "proxy-test-v1"


def train_answer(model, tokenizer, steps: int = 80, lr: float = 5e-3) -> None:
    """SFT steps until the model answers chat prompts, with or without tools, with ANSWER."""
    renderer = ChatRenderer(tokenizer)
    target = tokenizer.encode(ANSWER + IM_END, add_special_tokens=False)
    prompts = [
        list(renderer.render([{"role": "user", "content": text}], tools).token_ids)
        for text in USER_TEXTS
        for tools in ([], [BASH])
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        prompt = prompts[step % len(prompts)]
        ids = torch.tensor([prompt + target])
        labels = torch.tensor([[-100] * len(prompt) + target])
        optimizer.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    model.train(False)


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="session")
def trained_folder(tokenizer, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = tiny_causal_lm_for(tokenizer, seed=0, context=512)
    train_answer(model, tokenizer)
    return save_model_folder(tmp_path_factory.mktemp("models") / "trained", model, tokenizer)


@pytest.fixture
async def engine(trained_folder):
    config = LocalEngineConfig(
        model_folder=str(trained_folder), weight_version=WEIGHT_VERSION, batch_window_s=0.02
    )
    async with LocalEngine(config) as engine:
        yield engine


@pytest.fixture
async def proxy(engine):
    async with CaptureProxy(engine, CaptureProxyConfig(settle_quiet_s=0.05)) as proxy:
        yield proxy
