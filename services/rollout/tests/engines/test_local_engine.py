"""The local engine on a tiny model: batching changes nothing but the batch count, logprobs are
those of the sampling distribution, seeds reproduce, stops stop, bad requests are refused."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from orchard.lm.chat import ChatRenderer
from orchard.lm.model_folder import load_model_folder
from orchard.rollout.engines.base import (
    EngineClosed,
    InferenceEngine,
    InvalidRequest,
    NoWeightsLoaded,
    SamplingParams,
)
from orchard.rollout.engines.local import LocalEngine, LocalEngineConfig

from .conftest import greedy_reference

PROMPTS = [
    [{"role": "user", "content": "List the files."}],
    [{"role": "user", "content": "Run the tests, then fix the failing one."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "x" * 40}],
    [{"role": "user", "content": "Edit src/app.py line 3."}],
]


@pytest.fixture
def prompts(tokenizer) -> list[list[int]]:
    renderer = ChatRenderer(tokenizer)
    return [list(renderer.render(m).token_ids) for m in PROMPTS]


def engine_for(folder, **config) -> LocalEngine:
    return LocalEngine(LocalEngineConfig(model_folder=str(folder), weight_version="a", **config))


async def test_engine_serves_the_interface(model_folders):
    async with engine_for(model_folders["a"]) as engine:
        assert isinstance(engine, InferenceEngine)
        assert engine.weight_version == "a"
        assert engine.context_length == 256


async def test_batched_greedy_equals_unbatched_and_the_plain_loop(model_folders, prompts):
    greedy = SamplingParams(max_tokens=12, temperature=0)
    async with engine_for(model_folders["a"], max_batch_size=8, batch_window_s=0.05) as engine:
        together = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))
        assert engine.batch_sizes == [len(prompts)]
    async with engine_for(model_folders["a"], max_batch_size=1) as engine:
        alone = [await engine.generate(p, greedy) for p in prompts]
        assert engine.batch_sizes == [1] * len(prompts)
    model = load_model_folder(model_folders["a"]).model
    for prompt, batched, single in zip(prompts, together, alone, strict=True):
        assert batched.token_ids == single.token_ids
        assert batched.token_ids == tuple(greedy_reference(model, prompt, 12))
        assert batched.logprobs == pytest.approx(single.logprobs, abs=1e-4)
        assert batched.finish_reason == "length"
        assert batched.prompt_tokens == len(prompt)
        assert batched.weight_version == "a"


def reference_logprobs(model, prompt, output, temperature, top_p) -> list[float]:
    """Each sampled token's log-probability under the tempered, nucleus-cut distribution,
    from one forward pass over prompt + output."""
    ids = torch.tensor([prompt + list(output)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    result = []
    for k, token in enumerate(output):
        probs = torch.softmax(logits[len(prompt) + k - 1] / temperature, -1)
        kept, mass = set(), 0.0
        for index in torch.argsort(probs, descending=True).tolist():
            kept.add(index)
            mass += float(probs[index])
            if mass >= top_p:
                break
        assert token in kept, "a token outside the nucleus was sampled"
        result.append(math.log(float(probs[token]) / sum(float(probs[i]) for i in kept)))
    return result


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.5, 0.5)])
async def test_logprobs_match_a_direct_forward_pass(model_folders, prompts, temperature, top_p):
    params = SamplingParams(max_tokens=10, temperature=temperature, top_p=top_p, seed=11)
    async with engine_for(model_folders["a"]) as engine:
        results = await asyncio.gather(*(engine.generate(p, params) for p in prompts[:3]))
    model = load_model_folder(model_folders["a"]).model
    for prompt, result in zip(prompts, results, strict=False):
        expected = reference_logprobs(model, prompt, result.token_ids, temperature, top_p)
        assert list(result.logprobs) == pytest.approx(expected, abs=1e-4)


async def test_greedy_logprobs_are_the_models_own(model_folders, prompts):
    async with engine_for(model_folders["a"]) as engine:
        result = await engine.generate(prompts[0], SamplingParams(max_tokens=5, temperature=0))
    model = load_model_folder(model_folders["a"]).model
    expected = reference_logprobs(model, prompts[0], result.token_ids, 1.0, 1.0)
    assert list(result.logprobs) == pytest.approx(expected, abs=1e-4)


async def test_a_seed_reproduces_whatever_the_batch(model_folders, prompts):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=5)
    async with engine_for(model_folders["a"], batch_window_s=0.05) as engine:
        alone = await engine.generate(prompts[1], seeded)
        crowd = await asyncio.gather(
            engine.generate(prompts[0], SamplingParams(max_tokens=16, seed=1)),
            engine.generate(prompts[1], seeded),
            engine.generate(prompts[2], SamplingParams(max_tokens=3)),
        )
        other = await engine.generate(prompts[1], SamplingParams(max_tokens=16, seed=6))
    assert crowd[1].token_ids == alone.token_ids
    assert other.token_ids != alone.token_ids
    assert len(crowd[2].token_ids) == 3


async def test_stop_tokens_and_stop_strings(model_folders, prompts, tokenizer):
    async with engine_for(model_folders["a"]) as engine:
        free = await engine.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0))
        stop_at = free.token_ids[2]
        first = free.token_ids.index(stop_at)
        by_token = await engine.generate(
            prompts[0], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop_at,))
        )
        # The stop token is part of the output: the policy chose it.
        assert by_token.token_ids == free.token_ids[: first + 1]
        assert by_token.finish_reason == "stop"
        text = tokenizer.decode(list(free.token_ids[: first + 1]))
        by_string = await engine.generate(
            prompts[0], SamplingParams(max_tokens=8, temperature=0, stop=(text[-1],))
        )
        assert by_string.finish_reason == "stop"
        assert text[-1] in tokenizer.decode(list(by_string.token_ids))
        assert len(by_string.token_ids) <= first + 1


async def test_the_context_bounds_the_output(model_folders, tokenizer):
    async with engine_for(model_folders["a"]) as engine:
        prompt = [5] * 250
        result = await engine.generate(prompt, SamplingParams(max_tokens=100, temperature=0))
        assert len(result.token_ids) == 6
        assert result.finish_reason == "length"
        with pytest.raises(InvalidRequest, match="the model's context holds 256"):
            await engine.generate([5] * 256, SamplingParams())
        with pytest.raises(InvalidRequest, match="prompt token ids must be in"):
            await engine.generate([len(tokenizer) + 3], SamplingParams())
        with pytest.raises(InvalidRequest, match="at least one token"):
            await engine.generate([], SamplingParams())


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("max_tokens", 0, "max_tokens"),
        ("temperature", -1.0, "temperature"),
        ("temperature", float("nan"), "temperature"),
        ("top_p", 0.0, "top_p"),
        ("stop", ("",), "stop strings"),
    ],
)
def test_bad_sampling_params(field, value, match):
    with pytest.raises(InvalidRequest, match=match):
        SamplingParams(**{field: value})


async def test_an_engine_needs_weights():
    with pytest.raises(NoWeightsLoaded, match="needs a model_folder"):
        async with LocalEngine(LocalEngineConfig()):
            pass


async def test_closing_fails_waiting_requests(model_folders, prompts):
    engine = engine_for(model_folders["a"], batch_window_s=0.5)
    await engine.start()
    waiting = asyncio.ensure_future(engine.generate(prompts[0], SamplingParams(max_tokens=4)))
    await asyncio.sleep(0.05)
    await engine.close()
    with pytest.raises(EngineClosed):
        await waiting
    with pytest.raises(EngineClosed):
        await engine.generate(prompts[0], SamplingParams())
