"""Policy-gradient steps through the DeepSpeed engine: what enters the loss, the importance
weights against a direct computation, clipping on the second update, KL, metrics and learning."""

from __future__ import annotations

import math

import pytest
import torch
from prometheus_client import generate_latest

from orchard.core.metrics import ServiceMetrics
from orchard.trainer.batch import collate
from orchard.trainer.engine import EngineConfig, TrainingEngine
from orchard.trainer.losses import PolicyLossConfig, token_logprobs
from orchard.trainer.policy import load_policy
from orchard.trainer.rl import (
    RlConfig,
    StaleBatchError,
    StalePolicy,
    build_rl_batch,
    rl_update,
)
from orchard.trainer.telemetry import StepRecord, StepRecorder, plot_run_log, read_run_log

VOCAB = 48
PROMPT = [1, 20, 21, 22, 2]
GOOD, BAD = [30, 31, 3], [40, 41, 3]


def group(build, n: int, *, task: str = "task", logprobs=None, version: str = ""):
    """n trajectories of one task: even ones take the good action (reward 1), odd the bad."""
    trajectories = []
    for k in range(n):
        action = GOOD if k % 2 == 0 else BAD
        t = build(
            [build.Turn(inputs=PROMPT, outputs=action, logprobs=logprobs)],
            trajectory_id=f"{task}-{k}",
            task_id=task,
            reward=1.0 if k % 2 == 0 else 0.0,
        )
        t.rollout_id = f"{task}-r{k}"
        for turn in t.turns:
            turn.weight_version = version
        trajectories.append(t)
    return trajectories


def test_excluded_and_zero_advantage_trajectories_never_enter_the_batch(build):
    batch = group(build, 4)
    batch.append(build([build.Turn(PROMPT, GOOD)], trajectory_id="x", excluded=True))
    batch.append(build([build.Turn(PROMPT, GOOD)], trajectory_id="y", aborted=True))
    same = [build([build.Turn(PROMPT, GOOD)], trajectory_id=f"z{k}", task_id="z") for k in (0, 1)]
    rl = build_rl_batch([*batch, *same])
    assert sorted(s.trajectory_id for s in rl.samples) == ["task-0", "task-1", "task-2", "task-3"]
    assert rl.skipped == {"excluded": 1, "aborted": 1, "zero_advantage": 2}
    assert rl.advantages == pytest.approx([1.0, -1.0, 1.0, -1.0], rel=1e-5)
    # Reward mean of the scored, trainable trajectories: 4 of the group, 2 of task z.
    assert rl.reward_mean == pytest.approx(4 / 6)


def test_shared_prefix_of_one_rollout_counts_once(build):
    # Two leaves of one rollout: the same first call, then different second calls.
    first = build.Turn(inputs=[1, 5, 6], outputs=[7, 8])
    a = build([first, build.Turn([9], [10, 11])], trajectory_id="a", reward=1.0)
    b = build([first, build.Turn([9], [12, 13])], trajectory_id="b", reward=0.0)
    c = build([first, build.Turn([9], [10, 11])], trajectory_id="c", reward=0.5)
    a.rollout_id = b.rollout_id = "r1"
    c.rollout_id = "r2"  # another rollout: its own copy of the prefix counts
    rl = build_rl_batch([a, b, c], RlConfig(skip_zero_advantage=False))
    masks = {s.trajectory_id: s.loss_mask for s in rl.samples}
    # tokens: 1 5 6 | 7 8 | 9 | 10 11
    assert masks["a"] == (False, False, False, True, True, False, True, True)
    # b shares 1 5 6 7 8 9 with a: its first call's tokens are a's, only its own call counts.
    assert masks["b"] == (False, False, False, False, False, False, True, True)
    assert masks["c"] == masks["a"]


def test_staleness_bound_rejects_or_skips_old_versions(build):
    fresh = group(build, 2, task="f", version="v9")
    old = group(build, 2, task="o", version="v5")
    lag = {"v9": 0, "v8": 1, "v5": 4}.get
    with pytest.raises(StaleBatchError, match="4 versions behind; this job accepts at most 2"):
        build_rl_batch([*fresh, *old], RlConfig(max_staleness=2), version_lag=lag)
    rl = build_rl_batch(
        [*fresh, *old], RlConfig(max_staleness=2, stale=StalePolicy.SKIP), version_lag=lag
    )
    assert {s.trajectory_id for s in rl.samples} == {"f-0", "f-1"}
    assert rl.skipped["stale"] == 2


@pytest.mark.slow
def test_rl_update_weights_clips_logs_and_learns(build, tmp_path):
    policy = load_policy("builtin:tiny", vocab_size=VOCAB, seed=3)
    reference = load_policy("builtin:tiny", vocab_size=VOCAB, seed=3).model
    # The rollout engine's logprobs: the trainer's own minus a known gap per action token, so
    # the importance weight exp(old - rollout) is exactly exp(gap) (capped at 2).
    gaps = [0.1, 0.5, 1.0]
    probe = group(build, 2)
    tokens = collate(build_rl_batch(probe).samples, pad_id=0)
    with torch.no_grad():
        logits = policy.model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask)
        old = token_logprobs(logits.logits, tokens.targets)
    good_old = old[0, len(PROMPT) - 1 : len(PROMPT) + 2].tolist()
    bad_old = old[1, len(PROMPT) - 1 : len(PROMPT) + 2].tolist()
    groups = []
    for k in range(8):
        trajectories = group(build, 2, task=f"t{k}")
        for t in trajectories:
            base = good_old if t.id.endswith("-0") else bad_old
            t.turns[0].output_logprobs[:] = [o - g for o, g in zip(base, gaps, strict=True)]
        groups.extend(trajectories)
    config = RlConfig(
        loss=PolicyLossConfig(kl_coef=0.05), updates_per_batch=2, skip_zero_advantage=True
    )
    batch = build_rl_batch(groups, config)
    assert len(batch.samples) == 16
    engine = TrainingEngine(
        policy.model,
        EngineConfig(
            micro_batch_size=4, gradient_accumulation=2, learning_rate=0.02, total_steps=12
        ),
    )
    metrics = ServiceMetrics("trainer")
    try:
        with StepRecorder(tmp_path / "run.jsonl", metrics=metrics) as recorder:
            first, second = rl_update(engine, batch, config, pad_id=0, reference=reference)
            for result in (first, second):
                recorder.record(StepRecord.of("job1", "rl", result))
            # Step 1: the weights are the old ones, so the ratio is 1, nothing clips, KL is 0.
            assert first.extra["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
            assert first.extra["clip_fraction"] == 0.0
            assert first.extra["kl_mean"] == pytest.approx(0.0, abs=1e-6)
            # Importance weights before the cap: exactly exp(gap) on every action token.
            expected = [math.exp(g) for g in gaps]
            assert first.extra["importance_mean"] == pytest.approx(sum(expected) / 3, rel=1e-4)
            assert first.extra["importance_min"] == pytest.approx(min(expected), rel=1e-4)
            assert first.extra["importance_max"] == pytest.approx(max(expected), rel=1e-4)
            assert first.extra["importance_capped_fraction"] == pytest.approx(1 / 3)
            assert first.extra["reward_mean"] == pytest.approx(0.5)
            assert first.loss_tokens == 8 * 3 and first.grad_norm > 0
            # Step 2 uses the same old logprobs after a large step: the ratio moved, clips, KL > 0.
            assert abs(second.extra["ratio_mean"] - 1.0) > 1e-3
            assert second.extra["clip_fraction"] > 0.0
            assert second.extra["kl_mean"] > 0.0
            assert second.extra["entropy"] > 0.0
            # More updates on fresh batches: the good action gains, the bad one loses.
            for _ in range(4):
                rl_update(engine, build_rl_batch(groups, config), config, pad_id=0)
            after = engine.target_logprobs(tokens)
        # The first two action tokens tell the actions apart (both end with the same token).
        span = slice(len(PROMPT) - 1, len(PROMPT) + 1)
        assert after[0, span].sum() > old[0, span].sum() + 0.5
        assert after[1, span].sum() < old[1, span].sum() - 0.5
    finally:
        engine.close()

    exposition = generate_latest(metrics.registry).decode()
    for name in (
        "orchard_trainer_loss_ratio",
        "orchard_trainer_clip_fraction_ratio",
        "orchard_trainer_importance_weight_mean_ratio",
        "orchard_trainer_entropy_nats",
        "orchard_trainer_grad_norm_ratio",
        "orchard_trainer_reward_mean_ratio",
        "orchard_trainer_tokens_per_second",
    ):
        assert f'{name}{{job="job1",mode="rl"}}' in exposition, name
    assert 'orchard_trainer_steps_total{job="job1",mode="rl"} 2.0' in exposition
    records = read_run_log(tmp_path / "run.jsonl")
    assert [r.extra["clip_fraction"] for r in records] == [
        first.extra["clip_fraction"],
        second.extra["clip_fraction"],
    ]
    panels = plot_run_log(tmp_path / "run.jsonl", tmp_path / "run.png")
    assert {"loss", "clip_fraction", "importance_mean", "kl_mean", "reward_mean"} <= set(panels)
