"""Sampling a batch whose prompts differ in length: each row prefills alone (no padding, so no
attention mask of the square of the width), the rows' caches are joined for decoding, and every
row samples exactly what it samples alone."""

from __future__ import annotations

import random

import pytest

from orchard.lm.models import tiny_causal_lm_for
from orchard.rollout.engines import sampling
from orchard.rollout.engines.base import SamplingParams

CONTEXT = 4096
LENGTHS = [600, 12, 40]
PARAMS = [
    SamplingParams(max_tokens=6, temperature=0),
    SamplingParams(max_tokens=6, temperature=1.0, seed=7),
    SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, seed=3),
]


@pytest.fixture(scope="module")
def model(tokenizer):
    built = tiny_causal_lm_for(tokenizer, seed=1, context=CONTEXT)
    built.train(False)
    return built


@pytest.fixture
def shapes(monkeypatch) -> list[tuple[int, ...]]:
    """The input shape of every forward pass sampling makes."""
    seen: list[tuple[int, ...]] = []
    forward = sampling._Forward.__call__

    def recording(self, input_ids, attention, positions, past, **images):
        seen.append(tuple(input_ids.shape))
        return forward(self, input_ids, attention, positions, past, **images)

    monkeypatch.setattr(sampling._Forward, "__call__", recording)
    return seen


def prompts_of(lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 2000) for _ in range(n)] for n in lengths]


def assert_same_as_alone(model, tokenizer, prompts, together) -> None:
    for prompt, params, row in zip(prompts, PARAMS, together, strict=True):
        (alone,) = sampling.sample_batch(
            model, tokenizer, [prompt], [params], context_length=CONTEXT
        )
        assert row.token_ids == alone.token_ids
        assert row.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
        assert row.finish_reason == alone.finish_reason


def test_prompts_of_different_lengths_prefill_alone_and_decode_together(model, tokenizer, shapes):
    prompts = prompts_of(LENGTHS)
    together = sampling.sample_batch(model, tokenizer, prompts, PARAMS, context_length=CONTEXT)
    # One prefill per row at its own length, then one batched step per token; the third row
    # (4 tokens) leaves the batch once it has its last token.
    assert shapes[:3] == [(1, n) for n in LENGTHS]
    assert shapes[3:] == [(3, 1)] * 3 + [(2, 1)] * 2
    assert_same_as_alone(model, tokenizer, prompts, together)


def test_a_finished_row_leaves_the_batch_with_the_padding_only_it_needed(
    model, tokenizer, monkeypatch
):
    widths: list[tuple[int, int]] = []
    forward = sampling._Forward.__call__

    def recording(self, input_ids, attention, positions, past, **images):
        widths.append(tuple(attention.shape))
        return forward(self, input_ids, attention, positions, past, **images)

    monkeypatch.setattr(sampling._Forward, "__call__", recording)
    prompts = prompts_of([600, 12, 40])
    params = [
        SamplingParams(max_tokens=2, temperature=0),  # the long prompt ends first
        SamplingParams(max_tokens=6, temperature=1.0, seed=7),
        SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, seed=3),
    ]
    together = sampling.sample_batch(model, tokenizer, prompts, params, context_length=CONTEXT)
    # (rows, attention width) of each decoding step: all three over the 600-wide cache; then
    # the two short rows over the 40 prompt positions and what they sampled (the 560 columns
    # of padding went with the long row); then the 12-token row alone, its 5 tokens fed.
    assert widths[3:] == [(3, 601), (2, 42), (2, 43), (2, 44), (1, 17)]
    assert [len(r.token_ids) for r in together] == [2, 6, 5]
    monkeypatch.undo()
    for prompt, row_params, row in zip(prompts, params, together, strict=True):
        (alone,) = sampling.sample_batch(
            model, tokenizer, [prompt], [row_params], context_length=CONTEXT
        )
        assert row.token_ids == alone.token_ids
        assert row.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_prompts_of_one_length_prefill_as_one_batch(model, tokenizer, shapes):
    prompts = prompts_of([50, 50, 50])
    together = sampling.sample_batch(model, tokenizer, prompts, PARAMS, context_length=CONTEXT)
    assert shapes[0] == (3, 50)
    assert_same_as_alone(model, tokenizer, prompts, together)


def test_a_cache_that_cannot_be_joined_falls_back_to_one_padded_batch(
    model, tokenizer, shapes, monkeypatch
):
    class OtherCache:
        """Stands for any cache class the join does not know."""

    monkeypatch.setattr(sampling, "DynamicCache", OtherCache)
    prompts = prompts_of(LENGTHS)
    together = sampling.sample_batch(model, tokenizer, prompts, PARAMS, context_length=CONTEXT)
    assert shapes[:2] == [(1, LENGTHS[0]), (3, max(LENGTHS))]
    monkeypatch.undo()
    assert_same_as_alone(model, tokenizer, prompts, together)
