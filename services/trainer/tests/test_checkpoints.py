"""Checkpoints: a DeepSpeed checkpoint resumes training exactly (weights, optimizer, schedule,
step), the Hugging Face folder holds the trained weights, and unfinished saves are not listed."""

from __future__ import annotations

import pytest
import torch

from orchard.lm.model_folder import load_model_folder
from orchard.trainer.checkpoints import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
    step_version,
)
from orchard.trainer.engine import EngineConfig, TrainingEngine
from orchard.trainer.masks import build_sft_samples
from orchard.trainer.microbatches import MicroBatchPlan
from orchard.trainer.policy import load_policy

from .conftest import SYNTH_PAD, SYNTH_VOCAB, synthetic_trajectories


def _engine(zero_stage: int, model: str = "builtin:tiny") -> tuple[TrainingEngine, object]:
    policy = load_policy(model, vocab_size=SYNTH_VOCAB, seed=3)
    config = EngineConfig(
        zero_stage=zero_stage,
        micro_batch_size=4,
        gradient_accumulation=2,
        learning_rate=3e-3,
        warmup_steps=2,
        total_steps=10,
    )
    return TrainingEngine(policy.model, config), policy.tokenizer


@pytest.fixture(scope="module")
def plan() -> MicroBatchPlan:
    samples = build_sft_samples(synthetic_trajectories(32, seed=5)).samples
    return MicroBatchPlan(
        samples, micro_batch_size=4, gradient_accumulation=2, world_size=1, pad_id=SYNTH_PAD
    )


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_resuming_from_a_checkpoint_gives_the_same_next_steps(tmp_path, plan, zero_stage):
    engine, tokenizer = _engine(zero_stage)
    with engine:
        for step in range(3):
            engine.sft_step(plan.for_step(step, 0))
        info = save_checkpoint(engine, tokenizer, tmp_path, metadata={"job": "j1"})
        continued = [engine.sft_step(plan.for_step(step, 0)) for step in (3, 4)]
        trained = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}

    assert info.version == step_version(3) == "step-000003"
    assert read_checkpoint(info.path) == info
    # The Hugging Face folder holds the weights of step 3, not the untrained ones.
    folder = load_model_folder(info.model_dir)
    assert folder.metadata["step"] == "3"
    assert folder.metadata["job"] == "j1"

    fresh, _ = _engine(zero_stage)
    with fresh:
        assert fresh.global_step == 0
        assert load_checkpoint(fresh, info.path) == 3
        assert fresh.global_step == 3
        assert fresh.learning_rate == pytest.approx(continued[0].learning_rate)
        resumed = [fresh.sft_step(plan.for_step(step, 0)) for step in (3, 4)]
        if zero_stage != 3:
            for key, value in fresh.module.state_dict().items():
                torch.testing.assert_close(value, trained[key], rtol=1e-5, atol=1e-6)
    for a, b in zip(continued, resumed, strict=True):
        assert b.step == a.step
        assert b.loss == pytest.approx(a.loss, rel=1e-5)
        assert b.learning_rate == pytest.approx(a.learning_rate)
    # The optimizer state matters: the same weights with fresh Adam moments and schedule take
    # a different second step, so the match above is the restored state's doing.
    weights_only, _ = _engine(zero_stage, model=str(info.model_dir))
    with weights_only:
        fresh_moments = [weights_only.sft_step(plan.for_step(step, 0)) for step in (3, 4)]
    assert fresh_moments[0].loss == pytest.approx(continued[0].loss, rel=1e-5)
    assert abs(fresh_moments[1].loss - continued[1].loss) > 1e-4 * abs(continued[1].loss)


def test_the_model_folder_is_the_trainers_model(tmp_path, plan):
    engine, tokenizer = _engine(0)
    with engine:
        engine.sft_step(plan.for_step(0, 0))
        info = save_checkpoint(engine, tokenizer, tmp_path)
        batch = plan.for_step(1, 0)[0]
        with torch.no_grad():
            expected = engine.module(input_ids=batch.input_ids).logits
    loaded = load_model_folder(info.model_dir).model
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=batch.input_ids).logits, expected)


def test_listing_skips_unfinished_saves_and_versions_do_not_repeat(tmp_path, plan):
    engine, tokenizer = _engine(0)
    with engine:
        first = save_checkpoint(engine, tokenizer, tmp_path)
        engine.sft_step(plan.for_step(0, 0))
        second = save_checkpoint(engine, tokenizer, tmp_path, version="after-one")
        (tmp_path / "step-000009" / "deepspeed").mkdir(parents=True)  # a save that died
        assert [c.version for c in list_checkpoints(tmp_path)] == [first.version, "after-one"]
        assert second.step == 1
        with pytest.raises(CheckpointError, match="exists already"):
            save_checkpoint(engine, tokenizer, tmp_path, version="after-one")
        with pytest.raises(CheckpointError, match="must be 1-128"):
            save_checkpoint(engine, tokenizer, tmp_path, version="../escape")
    with pytest.raises(CheckpointError, match="not a finished checkpoint"):
        read_checkpoint(tmp_path / "step-000009")
    assert list_checkpoints(tmp_path / "nothing") == []
