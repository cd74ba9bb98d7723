"""Batched sampling with a Hugging Face causal LM on PyTorch: the compute half of the local
engine, synchronous, run off the event loop.

Prompts are left-padded into one batch with position ids that ignore the padding, so each row
sees exactly what it would see alone; each row then samples with its own temperature, top-p,
stop conditions and random generator, one forward pass per step for the whole batch (KV cache).
"""

from __future__ import annotations

import inspect
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from orchard.rollout.engines.base import EngineClosed, FinishReason, SamplingParams


@dataclass(frozen=True, slots=True)
class RowResult:
    """One row of a batch: sampled ids, their logprobs, why it stopped."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution `params` samples from, given one row of logits.

    Greedy requests get the model's own distribution (temperature 1, no nucleus).
    """
    logits = logits.float()
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / params.temperature
    if params.top_p < 1:
        ordered, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # Drop a token once the mass before it already reaches top_p (the first always stays).
        outside = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        ordered = ordered.masked_fill(outside, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(0, order, ordered)
    return torch.log_softmax(scaled, dim=-1)


def _draw(logprobs: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if params.greedy:
        return int(torch.argmax(logprobs))
    return int(torch.multinomial(logprobs.exp(), 1, generator=generator))


def _generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


@torch.inference_mode()
def sample_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    *,
    context_length: int,
    stop_event: threading.Event | None = None,
) -> list[RowResult]:
    """Sample one completion per prompt, all rows in one batched forward pass per step.

    Each row's budget is its `max_tokens`, cut to what its prompt leaves of `context_length`.
    `stop_event` aborts between steps (raises `EngineClosed`).
    """
    rows = len(prompts)
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((rows, width), int(pad), dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        attention[i, width - len(prompt) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    budgets = [
        min(p.max_tokens, context_length - len(q)) for p, q in zip(params, prompts, strict=True)
    ]
    generators = [_generator(p.seed) for p in params]
    outputs: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    finished: list[FinishReason | None] = [None] * rows

    step_ids, step_positions, past = input_ids, positions, None
    cache_argument = _cache_argument(model)
    for _ in range(max(budgets)):
        if stop_event is not None and stop_event.is_set():
            raise EngineClosed("the engine closed while sampling")
        out = model(
            input_ids=step_ids,
            attention_mask=attention,
            position_ids=step_positions,
            use_cache=True,
            **{cache_argument: past},
        )
        past = out.get(cache_argument)
        last = out.logits[:, -1, :]
        next_ids = torch.full((rows, 1), int(pad), dtype=torch.long)
        for i in range(rows):
            if finished[i] is not None:
                continue
            row_params = params[i]
            distribution = sampling_logprobs(last[i], row_params)
            token = _draw(distribution, row_params, generators[i])
            outputs[i].append(token)
            logprobs[i].append(float(distribution[token]))
            next_ids[i, 0] = token
            if token in row_params.stop_token_ids or (
                row_params.stop and _hits_stop_string(tokenizer, outputs[i], row_params.stop)
            ):
                finished[i] = "stop"
            elif len(outputs[i]) >= budgets[i]:
                finished[i] = "length"
        if all(f is not None for f in finished):
            break
        step_ids = next_ids
        attention = torch.cat([attention, torch.ones((rows, 1), dtype=torch.long)], dim=1)
        step_positions = step_positions[:, -1:] + 1
    return [
        RowResult(tuple(outputs[i]), tuple(logprobs[i]), finished[i] or "length")
        for i in range(rows)
    ]


def _cache_argument(model: PreTrainedModel) -> str:
    # transformers renamed `past_key_values` to `cache` (5.2x); speak whichever this one takes.
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _hits_stop_string(
    tokenizer: PreTrainedTokenizerBase, output: Sequence[int], stop: Sequence[str]
) -> bool:
    # Only the tail can hold a stop string that was not there a token earlier (a token is at
    # least one byte, a character at most four).
    longest = max(len(s) for s in stop)
    tail = str(tokenizer.decode(list(output[-(4 * longest + 4) :]), skip_special_tokens=False))
    return any(s in tail for s in stop)
