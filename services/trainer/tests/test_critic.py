"""The PPO critic: returns and advantages on fixed numbers, the value loss, real updates, value
pretraining, and a checkpoint that resumes the policy and the critic together."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from orchard.trainer.batch import collate
from orchard.trainer.checkpoints import (
    CheckpointError,
    load_checkpoint,
    load_critic,
    save_checkpoint,
)
from orchard.trainer.critic import (
    CriticConfig,
    build_critic,
    gae,
    ppo_update,
    terminal_rewards,
    token_values,
    value_loss,
    value_pretrain,
)
from orchard.trainer.engine import EngineConfig, TrainingEngine
from orchard.trainer.policy import Policy, load_policy
from orchard.trainer.rl import RlConfig, build_rl_batch

F, T = False, True
MASK = torch.tensor([[F, T, T, F, T, F], [T, F, F, F, F, F], [F, F, F, F, F, F]])
VALUES = torch.tensor([[9.0, 0.25, 0.5, 9.0, 0.75, 9.0], [0.1, 9.0, 9.0, 9.0, 9.0, 9.0], [9.0] * 6])
REWARDS = torch.tensor([1.0, -0.5, 2.0])


def test_terminal_reward_sits_on_the_last_loss_token_of_each_row():
    r = terminal_rewards(REWARDS, MASK)
    assert r.tolist() == [
        [0.0, 0.0, 0.0, 0.0, 1.0, 0.0],
        [-0.5, 0.0, 0.0, 0.0, 0.0, 0.0],
        [0.0] * 6,  # no loss token: no reward anywhere
    ]


def test_with_gamma_and_lambda_one_returns_are_the_reward_and_advantages_reward_minus_value():
    advantages, returns = gae(terminal_rewards(REWARDS, MASK), VALUES, MASK)
    assert advantages.tolist() == [
        [0.0, 0.75, 0.5, 0.0, 0.25, 0.0],
        pytest.approx([-0.6, 0.0, 0.0, 0.0, 0.0, 0.0]),
        [0.0] * 6,
    ]
    assert returns.tolist() == [
        [0.0, 1.0, 1.0, 0.0, 1.0, 0.0],
        pytest.approx([-0.5, 0.0, 0.0, 0.0, 0.0, 0.0]),
        [0.0] * 6,
    ]


def test_gae_skips_unmasked_tokens_and_matches_the_recursion_written_out():
    gamma, lam = 0.9, 0.8
    advantages, returns = gae(terminal_rewards(REWARDS, MASK), VALUES, MASK, gamma=gamma, lam=lam)
    # Row 0: loss tokens at 1, 2, 4 with values 0.25, 0.5, 0.75 and the reward 1 at the last.
    v1, v2, v3, r = 0.25, 0.5, 0.75, 1.0
    d3 = r + gamma * 0.0 - v3
    d2 = 0.0 + gamma * v3 - v2
    d1 = 0.0 + gamma * v2 - v1
    a3 = d3
    a2 = d2 + gamma * lam * a3
    a1 = d1 + gamma * lam * a2
    assert advantages[0].tolist() == pytest.approx([0.0, a1, a2, 0.0, a3, 0.0])
    assert returns[0].tolist() == pytest.approx([0.0, a1 + v1, a2 + v2, 0.0, a3 + v3, 0.0])
    with pytest.raises(ValueError, match="gamma and lam"):
        CriticConfig(gamma=1.5)


def test_value_loss_clips_against_the_old_values():
    mask = torch.tensor([[T, T, T, F]])
    old = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    new = torch.tensor([[0.5, 0.1, 0.0, 7.0]], requires_grad=True)
    target = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    loss, stats = value_loss(new, old, target, mask, clip=0.2)
    # Token 0: unclipped (0.5-1)^2 = 0.25, clipped (0.2-1)^2 = 0.64 -> 0.64 (clip binds).
    # Token 1: 0.81 vs 0.81 -> 0.81. Token 2: 0.0 vs (0.8-0)^2 = 0.64 -> 0.64 (clip binds).
    assert float(loss.detach()) == pytest.approx(0.5 * (0.64 + 0.81 + 0.64) / 3)
    assert stats["value_clip_fraction"] == pytest.approx(2 / 3)
    assert stats["value_mean"] == pytest.approx(0.2)
    assert stats["return_mean"] == pytest.approx(2 / 3)
    loss.backward()
    # Where the clip binds the clipped branch is a constant: no gradient.
    assert new.grad is not None
    assert new.grad[0].tolist() == pytest.approx([0.0, 0.5 * 2 * (0.1 - 1.0) / 3, 0.0, 0.0])
    unclipped, _ = value_loss(new, old, target, mask, clip=None)
    assert float(unclipped.detach()) == pytest.approx(0.5 * (0.25 + 0.81 + 0.0) / 3)


def test_critic_shares_the_policy_trunk_and_starts_at_zero():
    policy = load_policy("builtin:tiny", vocab_size=48, seed=2).model
    critic = build_critic(policy)
    for name, tensor in policy.base_model.state_dict().items():
        assert torch.equal(critic.base_model.state_dict()[name], tensor), name
    out = critic(input_ids=torch.tensor([[1, 5, 7, 9]])).logits
    assert out.shape == (1, 4, 1)
    assert torch.count_nonzero(out) == 0
    # No dropout in the head: in training mode the values are the ones inference gives.
    with torch.no_grad():
        critic.score.weight.normal_()
    ids = torch.tensor([[1, 5, 7, 9]])
    assert critic.training
    trained = critic(input_ids=ids).logits
    assert torch.count_nonzero(trained) > 0
    assert torch.equal(trained, critic(input_ids=ids).logits)
    assert torch.equal(trained, critic.eval()(input_ids=ids).logits)


def _trajectories(build, n):
    out = []
    for k in range(n):
        t = build(
            [build.Turn(inputs=[1, 20, 21, 2], outputs=[30, 31, 3] if k % 2 == 0 else [40, 41, 3])],
            trajectory_id=f"p{k}",
            task_id=f"task{k // 2}",
            reward=1.0 if k % 2 == 0 else 0.0,
        )
        t.rollout_id = f"r{k}"
        out.append(t)
    return out


@pytest.mark.slow
def test_ppo_update_trains_the_policy_on_critic_advantages_and_the_critic_on_returns(build):
    policy = load_policy("builtin:tiny", vocab_size=48, seed=4)
    critic_model = build_critic(policy.model)
    config = RlConfig(skip_zero_advantage=False, updates_per_batch=2)
    batch = build_rl_batch(_trajectories(build, 8), config)
    assert batch.rewards == (1.0, 0.0) * 4
    engine_config = EngineConfig(micro_batch_size=4, learning_rate=0.03, total_steps=40)
    engine = TrainingEngine(policy.model, engine_config)
    critic = TrainingEngine(critic_model, engine_config)
    try:
        first = ppo_update(engine, critic, batch, config, pad_id=0)
        assert len(first.policy) == len(first.critic) == 2
        # The critic starts at 0, so every action's advantage is its reward: on each half of
        # the batch (two rewarded, two not, three loss tokens each) the mean is 0.5.
        assert [s.extra["advantage_mean"] for s in first.policy] == pytest.approx([0.5, 0.5])
        assert first.critic[0].extra["value_mean"] == pytest.approx(0.0, abs=1e-6)
        assert first.critic[0].extra["return_mean"] == pytest.approx(0.5)
        assert first.critic[0].loss == pytest.approx(0.5 * 0.5)  # 0.5 * mean((0 - R)^2)
        assert first.critic[0].loss_tokens == 4 * 3
        losses = [first.critic[-1].loss]
        for _ in range(11):
            losses.append(ppo_update(engine, critic, batch, config, pad_id=0).critic[-1].loss)
        # The values learn the rewards from the action tokens: once the action is in the
        # context (the second and third action tokens), a rewarded one is valued higher.
        assert losses[-1] < 0.5 * losses[0]
        tokens = collate(batch.samples[:2], pad_id=0)
        good, bad = token_values(critic, tokens)[:, 4:6].tolist()
        assert min(good) > max(bad) + 0.1
        with pytest.raises(ValueError, match="one reward per sample"):
            ppo_update(engine, critic, replace(batch, rewards=()), config, pad_id=0)
    finally:
        engine.close()
        critic.close()


def _engines(zero_stage: int) -> tuple[Policy, TrainingEngine, TrainingEngine]:
    policy = load_policy("builtin:tiny", vocab_size=48, seed=4)
    critic_model = build_critic(policy.model)  # before the policy's engine partitions it
    config = EngineConfig(
        zero_stage=zero_stage, micro_batch_size=2, learning_rate=0.005, total_steps=16
    )
    engine = TrainingEngine(policy.model, config)
    return policy, engine, TrainingEngine(critic_model, config)


@pytest.mark.slow
def test_value_pretraining_fits_returns_and_a_checkpoint_resumes_both_models(build, tmp_path):
    # ZeRO-3 partitions the policy's weights in its engine: the critic is copied before.
    zero_stage = 3
    config = RlConfig(skip_zero_advantage=False, updates_per_batch=2)
    batch = build_rl_batch(_trajectories(build, 8), config)
    two_steps = CriticConfig(steps_per_update=2)
    policy, engine, critic = _engines(zero_stage)
    try:
        pretrain = value_pretrain(critic, batch, steps=6, updates=2, pad_id=0)
        # The zero head's first loss: 0.5 * mean(R^2), half of each mini-batch rewarded.
        assert pretrain[0].loss == pytest.approx(0.5 * 0.5)
        assert pretrain[-1].loss < 0.5 * pretrain[0].loss
        assert critic.global_step == 6 and engine.global_step == 0
        first = ppo_update(engine, critic, batch, config, two_steps, pad_id=0)
        assert (len(first.policy), len(first.critic)) == (2, 4)
        steps = first.steps()
        for k, step in enumerate(steps):
            assert step.extra["value_loss"] == pytest.approx(
                (first.critic[2 * k].loss + first.critic[2 * k + 1].loss) / 2
            )
            assert step.extra["value_learning_rate"] == first.critic[2 * k].learning_rate
            assert {"value_mean", "return_mean", "value_clip_fraction"} <= set(step.extra)
        info = save_checkpoint(engine, policy.tokenizer, tmp_path, critic=critic)
        assert info.critic_dir.is_dir()
        continued = ppo_update(engine, critic, batch, config, two_steps, pad_id=0).steps()
    finally:
        engine.close()
        critic.close()
    policy, engine, critic = _engines(zero_stage)
    try:
        load_checkpoint(engine, info)
        assert load_critic(critic, info) == 6 + 4
        resumed = ppo_update(engine, critic, batch, config, two_steps, pad_id=0).steps()
        for a, b in zip(continued, resumed, strict=True):
            assert b.loss == pytest.approx(a.loss, rel=1e-6)
            assert b.extra["value_loss"] == pytest.approx(a.extra["value_loss"], rel=1e-6)
            assert b.extra["value_learning_rate"] == pytest.approx(a.extra["value_learning_rate"])
        without = save_checkpoint(engine, policy.tokenizer, tmp_path, version="policy-only")
        with pytest.raises(CheckpointError, match="no value model"):
            load_critic(critic, without)
    finally:
        engine.close()
        critic.close()
