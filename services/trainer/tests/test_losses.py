"""Advantages and the clipped policy objective against a direct computation on fixed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from orchard.trainer.losses import (
    AdvantageConfig,
    PolicyLossConfig,
    group_advantages,
    policy_loss,
    sft_loss,
    sft_loss_and_logp,
    token_entropy,
    token_logprobs,
)


def test_group_advantages_are_centred_and_scaled_within_each_task_harness_group(build):
    turn = build.Turn(inputs=[1], outputs=[2])
    batch = [
        build([turn], trajectory_id="a", reward=1.0),
        build([turn], trajectory_id="b", reward=0.0),
        build([turn], trajectory_id="c", reward=0.5),
        # Same task, other harness: its own group, all equal, so zero.
        build([turn], trajectory_id="d", reward=1.0, harness="external:x"),
        build([turn], trajectory_id="e", reward=1.0, harness="external:x"),
        # Excluded and aborted: no advantage, and not in the group's mean (else it would move).
        build([turn], trajectory_id="x", excluded=True),
        build([turn], trajectory_id="y", reward=1.0, aborted=True),
    ]
    adv = group_advantages(batch)
    std = math.sqrt((0.25 + 0.25 + 0.0) / 3)
    assert adv == pytest.approx(
        {"a": 0.5 / (std + 1e-6), "b": -0.5 / (std + 1e-6), "c": 0.0, "d": 0.0, "e": 0.0}
    )
    unscaled = group_advantages(batch, AdvantageConfig(scale_by_std=False))
    assert unscaled == pytest.approx({"a": 0.5, "b": -0.5, "c": 0.0, "d": 0.0, "e": 0.0})


def test_all_equal_group_and_single_member_give_zero(build):
    turn = build.Turn(inputs=[1], outputs=[2])
    batch = [build([turn], trajectory_id=f"t{k}", reward=0.3) for k in range(4)]
    batch.append(build([turn], trajectory_id="alone", reward=1.0, task_id="other"))
    assert group_advantages(batch) == {"t0": 0.0, "t1": 0.0, "t2": 0.0, "t3": 0.0, "alone": 0.0}


def test_duplicate_trajectory_ids_are_refused(build):
    turn = build.Turn(inputs=[1], outputs=[2])
    with pytest.raises(ValueError, match="appears twice"):
        group_advantages([build([turn], reward=1.0), build([turn], reward=0.0)])


# Fixed numbers for the policy loss: two sequences of four token slots.
CUR = [[-0.9, -0.5, -2.0, -0.3], [-0.2, -1.5, -0.7, -9.0]]
OLD = [[-1.2, -0.5, -1.6, -0.35], [-0.6, -1.0, -0.7, -0.1]]
ROLLOUT = [[-1.0, -0.6, -1.6, -1.5], [-0.6, -1.2, -0.2, -0.1]]
MASK = [[True, True, True, True], [True, True, True, False]]
ADV = [1.5, -0.8]


def direct_policy_loss(config: PolicyLossConfig, ref=None):
    """The objective written out one token at a time in plain floats."""
    per_seq: list[list[float]] = []
    clip_hi = clip_lo = capped = 0
    weights: list[float] = []
    for b in range(2):
        row = []
        for t in range(4):
            if not MASK[b][t]:
                continue
            a = ADV[b]
            r = math.exp(CUR[b][t] - OLD[b][t])
            rc = min(max(r, 1 - config.clip_low), 1 + config.clip_high)
            raw = math.exp(OLD[b][t] - ROLLOUT[b][t])
            weights.append(raw)
            w = min(raw, config.importance_cap) if config.importance_cap else raw
            capped += config.importance_cap is not None and raw > config.importance_cap
            value = -w * min(r * a, rc * a)
            if ref is not None:
                d = ref[b][t] - CUR[b][t]
                value += config.kl_coef * (math.exp(d) - d - 1)
            clip_hi += a > 0 and r > 1 + config.clip_high
            clip_lo += a < 0 and r < 1 - config.clip_low
            row.append(value)
        per_seq.append(row)
    n = sum(len(r) for r in per_seq)
    if config.length_normalization:
        loss = sum(sum(r) / len(r) for r in per_seq) / len(per_seq)
    else:
        loss = sum(sum(r) for r in per_seq) / n
    return loss, clip_hi / n, clip_lo / n, capped / n, weights


def run(config: PolicyLossConfig, ref=None):
    cur = torch.tensor(CUR, dtype=torch.float64, requires_grad=True)
    result = policy_loss(
        cur,
        torch.tensor(OLD, dtype=torch.float64),
        torch.tensor(ADV, dtype=torch.float64),
        torch.tensor(MASK),
        config=config,
        rollout_logprobs=torch.tensor(ROLLOUT, dtype=torch.float64),
        ref_logprobs=None if ref is None else torch.tensor(ref, dtype=torch.float64),
    )
    result.loss.backward()
    assert cur.grad is not None
    return result, cur.grad


@pytest.mark.parametrize(
    "config",
    [
        PolicyLossConfig(),
        PolicyLossConfig(length_normalization=True),
        PolicyLossConfig(importance_cap=None),
        PolicyLossConfig(clip_low=0.1, clip_high=0.5, importance_cap=1.2),
    ],
)
def test_clipped_objective_matches_a_direct_computation(config):
    result, _ = run(config)
    loss, hi, lo, capped, weights = direct_policy_loss(config)
    assert result.loss.item() == pytest.approx(loss, rel=1e-12)
    stats = result.stats
    assert stats.tokens == 7
    assert stats.clip_high_fraction == pytest.approx(hi)
    assert stats.clip_low_fraction == pytest.approx(lo)
    assert stats.clip_fraction == pytest.approx(hi + lo)
    assert stats.importance_capped_fraction == pytest.approx(capped)
    assert stats.importance_mean == pytest.approx(sum(weights) / len(weights))
    assert stats.importance_max == pytest.approx(max(weights))
    assert stats.importance_min == pytest.approx(min(weights))


def test_default_numbers_exercise_both_clips_and_the_cap():
    # Guards the fixture: the comparison above would be weak if nothing clipped or capped.
    _, hi, lo, capped, _ = direct_policy_loss(PolicyLossConfig())
    assert hi > 0 and lo > 0 and capped > 0


def test_gradient_is_zero_where_the_clip_binds_or_the_mask_is_off():
    config = PolicyLossConfig()
    _, grad = run(config)
    n = 7
    for b in range(2):
        for t in range(4):
            a = ADV[b]
            r = math.exp(CUR[b][t] - OLD[b][t])
            bound = (a > 0 and r > 1 + config.clip_high) or (a < 0 and r < 1 - config.clip_low)
            if not MASK[b][t] or bound:
                assert grad[b, t].item() == 0.0, (b, t)
            else:
                w = min(math.exp(OLD[b][t] - ROLLOUT[b][t]), 2.0)
                # d/dcur of -w * r * a / n, with dr/dcur = r.
                assert grad[b, t].item() == pytest.approx(-w * r * a / n, rel=1e-12)


def test_kl_penalty_is_off_by_default_and_adds_k3_when_on():
    ref = [[-1.1, -0.4, -2.2, -0.3], [-0.3, -1.4, -0.9, -0.2]]
    off, _ = run(PolicyLossConfig(), ref=ref)
    base, *_ = direct_policy_loss(PolicyLossConfig())
    assert off.loss.item() == pytest.approx(base, rel=1e-12)
    assert off.stats.kl_mean == 0.0
    on_config = PolicyLossConfig(kl_coef=0.1)
    on, _ = run(on_config, ref=ref)
    expected, *_ = direct_policy_loss(on_config, ref=ref)
    assert on.loss.item() == pytest.approx(expected, rel=1e-12)
    assert on.stats.kl_mean > 0.0


def test_without_rollout_logprobs_the_weights_are_one():
    cur = torch.tensor(CUR, dtype=torch.float64)
    result = policy_loss(
        cur, torch.tensor(OLD, dtype=torch.float64), torch.tensor(ADV), torch.tensor(MASK)
    )
    assert result.stats.importance_mean == 1.0
    assert result.stats.importance_capped_fraction == 0.0


def test_bad_shapes_and_configs_are_refused():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="same shape"):
        policy_loss(x, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="clip_low"):
        PolicyLossConfig(clip_low=1.0)
    with pytest.raises(ValueError, match="importance_cap"):
        PolicyLossConfig(importance_cap=0.0)


def test_sft_loss_is_the_mean_nll_of_masked_targets_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[1, 4, 0], [2, 2, 3]])
    mask = torch.tensor([[False, True, True], [True, False, False]])
    loss = sft_loss(logits, targets, mask)
    logp = torch.log_softmax(logits.detach(), dim=-1)
    expected = -(logp[0, 1, 4] + logp[0, 2, 0] + logp[1, 0, 2]) / 3
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    loss.backward()
    assert logits.grad is not None
    # Masked positions get no gradient at all.
    assert torch.all(logits.grad[0, 0] == 0) and torch.all(logits.grad[1, 1:] == 0)
    assert token_logprobs(logits, targets).shape == (2, 3)


def test_sft_loss_at_masked_positions_matches_the_full_softmax_and_gives_the_entropy():
    torch.manual_seed(1)
    logits = torch.randn(3, 7, 11, dtype=torch.float64)
    targets = torch.randint(0, 11, (3, 7))
    mask = torch.rand(3, 7) > 0.5
    full = logits.clone().requires_grad_(True)
    nll = -token_logprobs(full, targets)
    reference = (nll * mask).sum() / mask.sum()
    reference.backward()
    fused = logits.clone().requires_grad_(True)
    loss, logp = sft_loss_and_logp(fused, targets, mask)
    loss.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-12)
    assert fused.grad is not None and full.grad is not None
    assert torch.allclose(fused.grad, full.grad, rtol=0, atol=1e-12)
    entropy = -(logp.exp() * logp).sum(dim=-1).mean()
    assert entropy.item() == pytest.approx(token_entropy(logits)[mask].mean().item(), rel=1e-12)


def test_sft_loss_without_masked_positions_is_zero_with_a_gradient():
    logits = torch.randn(1, 4, 5, requires_grad=True)
    loss, logp = sft_loss_and_logp(logits, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4))
    assert loss.item() == 0.0 and logp.shape == (0, 5)
    loss.backward()
    assert logits.grad is not None and torch.all(logits.grad == 0)
