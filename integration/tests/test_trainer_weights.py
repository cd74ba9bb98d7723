"""Trainer to inference engine through etcd: a checkpoint the trainer saves and publishes is
loaded by the local engine that follows the weight registry, and the engine's greedy tokens
are the trainer's model's."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from orchard.core.etcd import EtcdStore
from orchard.lm.weights import WeightRegistry
from orchard.rollout.engines.base import SamplingParams
from orchard.rollout.engines.local import LocalEngine, LocalEngineConfig
from orchard.trainer.checkpoints import publish_checkpoint, save_checkpoint
from orchard.trainer.engine import EngineConfig, TrainingEngine
from orchard.trainer.masks import build_sft_samples
from orchard.trainer.microbatches import MicroBatchPlan
from orchard.trainer.policy import load_policy
from orchard.types.v1 import reward_pb2, trajectory_pb2

STEPS = 30
ANSWER_TOKENS = 8


def greedy(model, prompt: list[int], steps: int) -> tuple[int, ...]:
    """Greedy decoding the plain way: the whole sequence through the model at every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return tuple(ids[len(prompt) :])


def trajectory(prompt: list[int], answer: list[int], k: int) -> trajectory_pb2.Trajectory:
    t = trajectory_pb2.Trajectory(id=f"t{k}", task_id="files", harness="builtin:swe")
    t.turns.add(
        index=0,
        kind=trajectory_pb2.TURN_KIND_POLICY,
        input_token_ids=prompt,
        output_token_ids=answer,
        output_logprobs=[-1.0] * len(answer),
    )
    t.reward.status = reward_pb2.REWARD_STATUS_SCORED
    t.reward.value = 1.0
    return t


@pytest.fixture
async def registry(etcd):
    async with EtcdStore(etcd.endpoint, namespace=f"test/{uuid.uuid4().hex}/") as store:
        yield WeightRegistry(store, "policy")
        await store.delete_prefix("")


@pytest.mark.slow
async def test_a_published_checkpoint_is_what_the_local_engine_samples(registry, tmp_path):
    policy = load_policy("builtin:tiny", seed=1)
    tokenizer = policy.tokenizer
    assert tokenizer is not None
    prompt = tokenizer.encode("<|im_start|>user\nList the files.<|im_end|>\n")
    answer = [*tokenizer.encode("ls -la src")[: ANSWER_TOKENS - 1], tokenizer.eos_token_id]
    untrained = greedy(policy.model, prompt, ANSWER_TOKENS)

    samples = build_sft_samples([trajectory(prompt, answer, k) for k in range(4)]).samples
    plan = MicroBatchPlan(
        samples, micro_batch_size=4, gradient_accumulation=1, world_size=1, pad_id=policy.pad_id
    )
    config = EngineConfig(micro_batch_size=4, learning_rate=1e-2, total_steps=STEPS)
    with TrainingEngine(policy.model, config) as engine:
        for step in range(STEPS):
            engine.sft_step(plan.for_step(step, 0))
        info = await asyncio.to_thread(
            save_checkpoint, engine, tokenizer, tmp_path, metadata={"job": "it"}
        )
        trained = greedy(engine.module, prompt, ANSWER_TOKENS)
    # Training moved the model: the published version is not the starting one.
    assert trained != untrained
    assert list(trained[: len(answer)]) == answer

    published = await publish_checkpoint(registry, info)
    assert published.version == info.version == "step-000030"
    assert published.metadata["step"] == "30"
    assert published.metadata["format"] == "huggingface"
    assert published.location == info.model_dir.resolve().as_uri()  # a URL, never a path
    assert (await registry.latest()) == published

    async with LocalEngine(LocalEngineConfig(), registry=registry) as local:
        await asyncio.wait_for(local.wait_for_weights(info.version), 30)
        out = await local.generate(prompt, SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0))
    assert out.weight_version == info.version
    # The engine stops at the end-of-sequence token; everything up to it is the trainer's.
    assert out.token_ids == trained[: len(out.token_ids)]
    assert len(out.token_ids) >= len(answer)
