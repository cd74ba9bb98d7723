"""Fixtures of the engine tests: the offline tokenizer and two tiny models (different seeds)
saved as model folders, built once per session; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from orchard.lm.chat import IM_END, ChatRenderer
from orchard.lm.model_folder import save_model_folder
from orchard.lm.models import tiny_causal_lm_for
from orchard.lm.tokenizer import build_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


TRAINED_ANSWER = "Done."
"""What model "b" was trained to answer to any user message."""


def train_to_answer(model, tokenizer, answer: str, steps: int = 20) -> None:
    """A few SFT steps so that `model` answers `answer` (then <|im_end|>) to chat prompts."""
    renderer = ChatRenderer(tokenizer)
    target = tokenizer.encode(answer + IM_END, add_special_tokens=False)
    samples = []
    for text in ("List the files.", "Run the tests.", "Hi", "What is 2 + 2?", "x" * 40):
        prompt = list(renderer.render([{"role": "user", "content": text}]).token_ids)
        samples.append((prompt, target))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        prompt, answer_ids = samples[step % len(samples)]
        ids = torch.tensor([prompt + answer_ids])
        labels = torch.tensor([[-100] * len(prompt) + answer_ids])
        optimizer.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    model.train(False)


@pytest.fixture(scope="session")
def model_folders(tokenizer, tmp_path_factory) -> dict[str, Path]:
    """Folder "a": random weights (seed 0); "b": the same start trained to answer
    `TRAINED_ANSWER`. Same architecture and tokenizer, different outputs."""
    root = tmp_path_factory.mktemp("models")
    model = tiny_causal_lm_for(tokenizer, seed=0, context=256)
    folders = {"a": save_model_folder(root / "a", model, tokenizer)}
    torch.manual_seed(0)
    train_to_answer(model, tokenizer, TRAINED_ANSWER)
    folders["b"] = save_model_folder(root / "b", model, tokenizer)
    return folders


def greedy_reference(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding the plain way: the whole sequence through the model at every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]
