"""SFT through the DeepSpeed engine: it learns, it follows its schedule, and a world of two
processes computes what a world of one does on the same micro-batches."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orchard.trainer.batch import collate
from orchard.trainer.datasets import write_trajectories
from orchard.trainer.distributed import free_port
from orchard.trainer.engine import EngineConfig, deepspeed_config
from orchard.trainer.losses import sft_loss
from orchard.trainer.masks import build_sft_samples
from orchard.trainer.microbatches import MicroBatchPlan
from orchard.trainer.policy import load_policy
from orchard.trainer.sft import SftRunConfig, run_offline_sft
from orchard.trainer.telemetry import read_run_log

VOCAB, PAD = 48, 0


def held_out_scores(model, batch) -> tuple[float, float]:
    """(masked loss, fraction of samples whose every trained target is the greedy choice)."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        loss = float(sft_loss(logits, batch.targets, batch.loss_mask))
    right = (logits.argmax(-1) == batch.targets) | ~batch.loss_mask
    return loss, float(right.all(dim=-1).float().mean())


@pytest.mark.slow
def test_sft_through_deepspeed_lowers_the_loss_and_learns_the_actions(tmp_path, synthetic):
    data = tmp_path / "train.jsonl"
    write_trajectories(data, synthetic(512, seed=1))
    held_out = collate(build_sft_samples(synthetic(32, seed=2)).samples, pad_id=PAD)
    config = SftRunConfig(
        data=data,
        model="builtin:tiny",
        output_dir=tmp_path / "run",
        engine=EngineConfig(
            zero_stage=2,
            micro_batch_size=16,
            gradient_accumulation=2,
            learning_rate=1e-2,
            warmup_steps=5,
            total_steps=100,
            gradient_clipping=0.0,
        ),
        vocab_size=VOCAB,
        progress=False,
    )
    start_loss, start_match = held_out_scores(
        load_policy("builtin:tiny", vocab_size=VOCAB).model, held_out
    )
    result = run_offline_sft(config, keep_engine=True)
    assert result.engine is not None
    try:
        end_loss, end_match = held_out_scores(result.engine.module, held_out)
    finally:
        result.engine.close()

    assert result.samples == 512
    assert start_match == 0.0
    assert end_loss < 0.25 * start_loss, (start_loss, end_loss)
    assert end_match >= 0.8, end_match

    records = read_run_log(tmp_path / "run" / "run.jsonl")
    assert [r.step for r in records] == list(range(1, 101))
    # Every step saw 2 micro-batches of 16 samples, each training on its 5 action tokens.
    assert {r.loss_tokens for r in records} == {2 * 16 * 5}
    rates = [r.learning_rate for r in records]
    # Linear warmup from 0 to the peak over 5 steps, then a cosine down to near 0.
    assert rates[:6] == pytest.approx([0.0, 2e-3, 4e-3, 6e-3, 8e-3, 1e-2])
    assert all(a >= b for a, b in itertools.pairwise(rates[5:]))
    assert rates[-1] < 0.01 * rates[5]
    assert all(r.grad_norm > 0 for r in records)
    assert all(r.extra["entropy"] > 0 for r in records)
    png = tmp_path / "run" / "run.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_two_processes_give_the_loss_of_one(tmp_path, synthetic):
    data = tmp_path / "train.jsonl"
    write_trajectories(data, synthetic(64, seed=3))
    worker = Path(__file__).with_name("distributed_sft_worker.py")
    port = free_port()
    steps = 6
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(worker),
                str(data),
                str(tmp_path / f"r{rank}.json"),
                str(rank),
                "2",
                str(port),
                "1",
                "3",
                str(steps),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in (0, 1)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=100)
            outputs.append(out.decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-3000:]
    two = [json.loads((tmp_path / f"r{rank}.json").read_text()) for rank in (0, 1)]
    # Both ranks report the loss averaged over the world.
    assert two[0]["losses"] == pytest.approx(two[1]["losses"], rel=1e-9)

    # One process, ZeRO 0, twice the accumulation: the same micro-batches per step.
    one = run_offline_sft(
        SftRunConfig(
            data=data,
            model="builtin:tiny",
            output_dir=tmp_path / "one",
            engine=EngineConfig(
                zero_stage=0,
                micro_batch_size=8,
                gradient_accumulation=2,
                learning_rate=3e-3,
                warmup_steps=2,
                total_steps=steps,
            ),
            vocab_size=VOCAB,
            progress=False,
            plot=False,
        )
    )
    one_losses = [s.loss for s in one.steps]
    assert len(one_losses) == steps
    # The loss moved (so the steps really updated the weights) and matched at every step.
    assert one_losses[-1] < one_losses[0]
    assert two[0]["losses"] == pytest.approx(one_losses, rel=1e-4)
    assert sum(two[0]["tokens"]) + sum(two[1]["tokens"]) > 0


def test_micro_batch_plan_gives_each_step_the_same_data_in_any_world(synthetic):
    samples = build_sft_samples(synthetic(40, seed=4)).samples
    one = MicroBatchPlan(
        samples, micro_batch_size=4, gradient_accumulation=4, world_size=1, pad_id=PAD
    )
    two = MicroBatchPlan(
        samples, micro_batch_size=4, gradient_accumulation=2, world_size=2, pad_id=PAD
    )
    for step in range(5):  # 10 micro-batches an epoch: steps 2.. cross into epoch 1
        single = one.for_step(step, 0)
        split = two.for_step(step, 0) + two.for_step(step, 1)
        assert len(single) == len(split) == 4
        for a, b in zip(single, split, strict=True):
            assert torch.equal(a.input_ids, b.input_ids)
    # Each epoch visits every sample once, in a new order.
    epoch0 = torch.cat([one.micro_batch(j).input_ids[:, :6] for j in range(10)])
    epoch1 = torch.cat([one.micro_batch(j).input_ids[:, :6] for j in range(10, 20)])
    assert sorted(map(tuple, epoch0.tolist())) == sorted(map(tuple, epoch1.tolist()))
    assert not torch.equal(epoch0, epoch1)


def test_engine_config_is_checked_and_maps_to_deepspeed():
    with pytest.raises(ValueError, match="zero_stage"):
        EngineConfig(zero_stage=4)
    with pytest.raises(ValueError, match="warmup_steps"):
        EngineConfig(warmup_steps=20, total_steps=10)
    ds = deepspeed_config(
        EngineConfig(zero_stage=3, micro_batch_size=4, gradient_accumulation=3), 2
    )
    assert ds["train_batch_size"] == 24
    assert ds["zero_optimization"]["stage"] == 3
    # No GPU here: auto precision is fp32.
    if not torch.cuda.is_available():
        assert EngineConfig().dtype == torch.float32
        assert ds["bf16"] == {"enabled": False}
    assert EngineConfig(precision="bf16").dtype == torch.bfloat16
