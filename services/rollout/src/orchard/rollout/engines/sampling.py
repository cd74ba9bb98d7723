"""Batched sampling with a Hugging Face causal LM on PyTorch: the compute half of the local
engine, synchronous, run off the event loop.

Prompts are left-padded into one batch with position ids that ignore the padding, so each row
sees exactly what it would see alone; each row then samples with its own temperature, top-p,
stop conditions and random generator, one forward pass per step for the whole batch (KV cache).
Prompts of different lengths are prefilled one by one and their caches joined for decoding:
a padded batch needs a padding mask, with which the attention (SDPA) can no longer rely on
causal masking alone and builds the mask in full, rows x width x width (gigabytes for a 32k
prompt beside a short one); prefilling row by row needs no mask, skips the padding, and was
faster on the CPU for every mix of lengths measured, from 30 to 4,096 tokens.

A vision-language model's rows may bring image inputs (``pixel_values`` and whatever else its
processor gives): such a batch is always prefilled row by row, each row with its own images,
and decoded together as text is (the images live in the cache from then on).
"""

from __future__ import annotations

import inspect
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

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
    image_inputs: Sequence[Mapping[str, torch.Tensor]] | None = None,
) -> list[RowResult]:
    """Sample one completion per prompt, all rows in one batched forward pass per step.

    Each row's budget is its `max_tokens`, cut to what its prompt leaves of `context_length`.
    `stop_event` aborts between steps (raises `EngineClosed`). `image_inputs`, one mapping per
    row (empty for a row without images), go into the prefill of a vision-language model.
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

    forward = _Forward(model)
    if stop_event is not None and stop_event.is_set():
        raise EngineClosed("the engine closed while sampling")
    images = list(image_inputs) if image_inputs is not None else [{} for _ in prompts]
    last, past = forward.prefill(input_ids, attention, positions, prompts, images)
    step_positions = positions[:, -1:]
    active = list(range(rows))
    """The row of each place in the batch: a finished row leaves the batch."""
    for _ in range(max(budgets)):
        next_ids = torch.full((len(active), 1), int(pad), dtype=torch.long)
        for place, i in enumerate(active):
            if finished[i] is not None:
                continue  # a finished row of a cache that cannot drop rows
            row_params = params[i]
            distribution = sampling_logprobs(last[place], row_params)
            token = _draw(distribution, row_params, generators[i])
            outputs[i].append(token)
            logprobs[i].append(float(distribution[token]))
            next_ids[place, 0] = token
            if token in row_params.stop_token_ids or (
                row_params.stop and _hits_stop_string(tokenizer, outputs[i], row_params.stop)
            ):
                finished[i] = "stop"
            elif len(outputs[i]) >= budgets[i]:
                finished[i] = "length"
        if all(f is not None for f in finished):
            break
        if stop_event is not None and stop_event.is_set():
            raise EngineClosed("the engine closed while sampling")
        keep = [place for place, i in enumerate(active) if finished[i] is None]
        if len(keep) < len(active) and _droppable(past):
            # The batch goes on without the rows that finished: each step after costs less
            # (before, a finished row was fed padding until the longest row ended).
            index = torch.tensor(keep, dtype=torch.long)
            past.batch_select_indices(index)
            attention, step_positions, next_ids = (
                attention[index],
                step_positions[index],
                next_ids[index],
            )
            active = [active[place] for place in keep]
            # Left padding no remaining row needs goes too.
            start = int((attention.sum(0) > 0).to(torch.long).argmax())
            if start > 0:
                attention = attention[:, start:]
                for layer in past.layers:
                    layer.keys = layer.keys[:, :, start:, :]
                    layer.values = layer.values[:, :, start:, :]
        attention = torch.cat([attention, torch.ones((len(active), 1), dtype=torch.long)], dim=1)
        step_positions = step_positions + 1
        last, past = forward(next_ids, attention, step_positions, past)
    return [
        RowResult(tuple(outputs[i]), tuple(logprobs[i]), finished[i] or "length")
        for i in range(rows)
    ]


class _Forward:
    """The model's forward pass as sampling uses it: the last position's logits and the cache."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        parameters = inspect.signature(model.forward).parameters
        # transformers renamed `past_key_values` to `cache` (5.2x); speak whichever this one takes.
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"
        # Only the last position's logits are sampled from: at 32k prompt tokens the others
        # would be 32k x vocabulary floats.
        self.extra: dict[str, Any] = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention: torch.Tensor,
        positions: torch.Tensor,
        past: Any,
        *,
        images: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, Any]:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            **{self.cache_argument: past},
            **self.extra,
            **(images or {}),
        )
        return out.logits[:, -1, :], out.get(self.cache_argument)

    def prefill(
        self,
        input_ids: torch.Tensor,
        attention: torch.Tensor,
        positions: torch.Tensor,
        prompts: Sequence[Sequence[int]],
        images: Sequence[Mapping[str, torch.Tensor]],
    ) -> tuple[torch.Tensor, Any]:
        """The prompts' last logits and cache: the batch as one when its prompts are equally
        long (no padding) and bring no images, else row by row (each row with its images) with
        the rows' caches left-padded into one (see the module docstring)."""
        width = input_ids.shape[1]
        if len({len(p) for p in prompts}) == 1 and not any(images):
            return self(input_ids, attention, positions, None)
        lasts: list[torch.Tensor] = []
        caches: list[Any] = []
        for i, prompt in enumerate(prompts):
            start = width - len(prompt)
            one = slice(i, i + 1)
            last, cache = self(
                input_ids[one, start:],
                attention[one, start:],
                positions[one, start:],
                None,
                images=images[i],
            )
            if len(prompts) == 1:
                return last, cache
            if not _joinable(cache):
                return self(input_ids, attention, positions, None, images=_concatenated(images))
            lasts.append(last)
            caches.append(cache)
        return torch.cat(lasts), _join_left_padded(caches, width)


def _concatenated(images: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The rows' image inputs as one batch's, in row order (the order of the image tokens in
    the flattened batch, which is how the models scatter image features)."""
    keys = [key for row in images for key in row]
    return {
        key: torch.cat([row[key] for row in images if key in row]) for key in dict.fromkeys(keys)
    }


def _droppable(cache: Any) -> bool:
    """Whether rows can leave the batch between steps: a `DynamicCache` of whole key and value
    tensors (no sliding window), as the text models of the local engine keep."""
    return _joinable(cache) and all(isinstance(layer, DynamicLayer) for layer in cache.layers)


def _joinable(cache: Any) -> bool:
    """Whether `_join_left_padded` can join this cache: a `DynamicCache` whose layers each hold
    a whole key and value tensor (no sliding window)."""
    if not isinstance(cache, DynamicCache):
        return False
    # Each layer iterates as (keys, values) or (keys, values, sliding window or None).
    return all(len(layer) == 2 or layer[2] is None for layer in cache)


def _join_left_padded(caches: Sequence[DynamicCache], width: int) -> DynamicCache:
    """One batch cache of rows' caches, each row's keys and values left-padded with zeros to
    `width` positions (the attention mask hides them), as a batched prefill would have left it."""

    def padded(states: torch.Tensor) -> torch.Tensor:
        missing = width - states.shape[-2]
        if missing == 0:
            return states
        zeros = states.new_zeros((*states.shape[:-2], missing, states.shape[-1]))
        return torch.cat([zeros, states], dim=-2)

    layers = []
    for per_row in zip(*(list(c) for c in caches), strict=True):
        keys = torch.cat([padded(layer[0]) for layer in per_row])
        values = torch.cat([padded(layer[1]) for layer in per_row])
        layers.append((keys, values))
    return DynamicCache(layers)


def _hits_stop_string(
    tokenizer: PreTrainedTokenizerBase, output: Sequence[int], stop: Sequence[str]
) -> bool:
    # Only the tail can hold a stop string that was not there a token earlier (a token is at
    # least one byte, a character at most four).
    longest = max(len(s) for s in stop)
    tail = str(tokenizer.decode(list(output[-(4 * longest + 4) :]), skip_special_tokens=False))
    return any(s in tail for s in stop)
