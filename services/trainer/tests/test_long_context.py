"""The long-context built-in size: tiny's shape with a 32k context, accepted by a job spec, and
trained on a sequence the length of a real agent program's prompt (16k tokens) through the
DeepSpeed engine, SFT and RL."""

from __future__ import annotations

import math
import random

import pytest
import torch

from orchard.trainer.batch import collate
from orchard.trainer.engine import EngineConfig, Precision, TrainingEngine
from orchard.trainer.jobs import resolve_spec
from orchard.trainer.masks import build_sft_samples
from orchard.trainer.policy import BUILTIN_SIZES, load_policy
from orchard.trainer.rl import RlConfig, build_rl_batch, rl_update
from orchard.trainer.v1 import trainer_service_pb2 as api

LONG = "builtin:tiny-32k"
PROMPT_TOKENS = 16_384
"""Within the 12-23k tokens of system prompt and tool schemas agent programs send."""
OUTPUT_TOKENS = 32


def test_the_long_size_is_tiny_with_a_32k_context():
    long, tiny = BUILTIN_SIZES["tiny-32k"], BUILTIN_SIZES["tiny"]
    assert long.context == 32_768 and tiny.context == 2048
    policy = load_policy(LONG, seed=4)
    config = policy.model.config
    assert config.max_position_embeddings == 32_768
    assert (config.hidden_size, config.num_hidden_layers) == (tiny.hidden_size, tiny.layers)
    assert (config.num_attention_heads, config.num_key_value_heads) == (tiny.heads, tiny.kv_heads)
    # SDPA keeps attention memory linear in the length; eager would build length^2 per head.
    assert config._attn_implementation == "sdpa"
    assert policy.tokenizer is not None
    assert policy.tokenizer.model_max_length == 32_768
    # Only the context differs: the same seed gives tiny's very weights.
    tiny_weights = load_policy("builtin:tiny", seed=4).model.state_dict()
    for name, tensor in policy.model.state_dict().items():
        assert torch.equal(tensor, tiny_weights[name]), name
    spec = resolve_spec(api.TrainingJobSpec(mode=api.TRAINING_MODE_SFT, model=LONG))
    assert spec.model == LONG


def _long_trajectory(build, vocab: int, *, seed: int, reward: float, task: str = "task"):
    rng = random.Random(seed)
    return build(
        [
            build.Turn(
                inputs=[rng.randrange(10, vocab) for _ in range(PROMPT_TOKENS)],
                outputs=[rng.randrange(10, vocab) for _ in range(OUTPUT_TOKENS)],
                logprobs=[-1.0] * OUTPUT_TOKENS,
            )
        ],
        trajectory_id=f"{task}-{seed}",
        task_id=task,
        reward=reward,
    )


def _engine(policy, *, accumulation: int) -> TrainingEngine:
    return TrainingEngine(
        policy.model,
        EngineConfig(
            micro_batch_size=1,
            gradient_accumulation=accumulation,
            learning_rate=1e-3,
            total_steps=4,
            precision=Precision.FP32,
        ),
    )


@pytest.mark.slow
def test_an_sft_step_on_a_16k_sequence(build):
    policy = load_policy(LONG, seed=0)
    vocab = policy.model.config.vocab_size
    samples = build_sft_samples([_long_trajectory(build, vocab, seed=1, reward=1.0)]).samples
    assert len(samples) == 1 and len(samples[0].token_ids) == PROMPT_TOKENS + OUTPUT_TOKENS
    engine = _engine(policy, accumulation=1)
    try:
        result = engine.sft_step([collate(samples, policy.pad_id)])
    finally:
        engine.close()
    assert result.tokens == PROMPT_TOKENS + OUTPUT_TOKENS - 1
    assert result.loss_tokens == OUTPUT_TOKENS
    # Random weights over a 2k vocabulary: a loss near ln(vocab), and a gradient.
    assert math.isfinite(result.loss) and abs(result.loss - math.log(vocab)) < 1.0
    assert result.grad_norm > 0


@pytest.mark.slow
def test_an_rl_update_on_16k_sequences(build):
    policy = load_policy(LONG, seed=0)
    vocab = policy.model.config.vocab_size
    group = [
        _long_trajectory(build, vocab, seed=2, reward=1.0),
        _long_trajectory(build, vocab, seed=3, reward=0.0),
    ]
    config = RlConfig()
    batch = build_rl_batch(group, config)
    assert len(batch.samples) == 2
    engine = _engine(policy, accumulation=2)
    try:
        (result,) = rl_update(engine, batch, config, pad_id=policy.pad_id)
    finally:
        engine.close()
    assert result.tokens == 2 * (PROMPT_TOKENS + OUTPUT_TOKENS - 1)
    assert result.loss_tokens == 2 * OUTPUT_TOKENS
    assert math.isfinite(result.loss) and result.grad_norm > 0
    # The old log-probabilities were the current weights' own: nothing clipped on step one.
    assert result.extra["clip_fraction"] == 0.0
