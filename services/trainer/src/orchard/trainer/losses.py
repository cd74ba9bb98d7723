"""Losses: group-relative advantages, the clipped policy objective, masked SFT loss.

Tensors are `[batch, tokens]` and aligned with the targets: position `t` holds the
log-probability of target token `t` (see `orchard.trainer.batch`, which shifts the samples).
Masks are boolean; only positions where the mask is true enter a loss or a statistic.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from orchard.trainer.masks import trainable_reason
from orchard.types.v1 import trajectory_pb2


@dataclass(frozen=True, slots=True)
class AdvantageConfig:
    """How rewards become advantages within a (task, harness) group."""

    scale_by_std: bool = True
    """Divide the centred reward by the group's standard deviation (population)."""
    eps: float = 1e-6
    """Added to the standard deviation so a near-constant group does not blow up."""


def group_advantages(
    trajectories: Iterable[trajectory_pb2.Trajectory],
    config: AdvantageConfig = AdvantageConfig(),
) -> dict[str, float]:
    """Advantage of every trainable trajectory, by trajectory id.

    Trajectories are grouped by (task_id, harness); each one's advantage is its reward minus
    the group mean, divided by the group standard deviation when `scale_by_std`. A group whose
    rewards are all equal (or that has one member) gives zero advantages. Excluded, unscored
    and aborted trajectories get no entry and do not count in their group's statistics.
    """
    groups: dict[tuple[str, str], list[tuple[str, float]]] = defaultdict(list)
    for trajectory in trajectories:
        if trainable_reason(trajectory) is not None:
            continue
        key = (trajectory.task_id, trajectory.harness)
        groups[key].append((trajectory.id, trajectory.reward.value))
    advantages: dict[str, float] = {}
    for members in groups.values():
        rewards = [r for _, r in members]
        mean = math.fsum(rewards) / len(rewards)
        centred = [r - mean for r in rewards]
        if all(abs(c) <= 1e-12 for c in centred):
            centred = [0.0] * len(centred)
        elif config.scale_by_std:
            std = math.sqrt(math.fsum(c * c for c in centred) / len(centred))
            centred = [c / (std + config.eps) for c in centred]
        for (trajectory_id, _), advantage in zip(members, centred, strict=True):
            if trajectory_id in advantages:
                raise ValueError(f"trajectory id {trajectory_id!r} appears twice in one batch")
            advantages[trajectory_id] = advantage
    return advantages


@dataclass(frozen=True, slots=True)
class PolicyLossConfig:
    """The clipped policy-gradient objective."""

    clip_low: float = 0.2
    """The ratio may fall to 1 - clip_low before the clip binds (negative advantages)."""
    clip_high: float = 0.28
    """The ratio may rise to 1 + clip_high before the clip binds (positive advantages)."""
    importance_cap: float | None = 2.0
    """Cap on the token-level weight exp(old - rollout); None turns the correction off."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy; 0 turns it off."""
    length_normalization: bool = False
    """Average each sequence over its own tokens first, then over sequences; otherwise
    average over all loss tokens of the micro-batch, and the engine weighs micro-batches by
    their loss tokens, so the step's loss is the mean over all its loss tokens (long episodes
    are not down-weighted)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if self.importance_cap is not None and self.importance_cap <= 0.0:
            raise ValueError(f"importance_cap must be > 0 or None, got {self.importance_cap}")
        if self.kl_coef < 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")


@dataclass(frozen=True, slots=True)
class PolicyLossStats:
    """What one loss evaluation saw, over the loss tokens (plain floats, for logging)."""

    tokens: int
    clip_fraction: float
    """Tokens where the clip binds (their gradient is zero)."""
    clip_low_fraction: float
    """Tokens with a negative advantage and ratio below 1 - clip_low."""
    clip_high_fraction: float
    """Tokens with a positive advantage and ratio above 1 + clip_high."""
    ratio_mean: float
    importance_mean: float
    importance_min: float
    importance_max: float
    """Statistics of the weight before the cap."""
    importance_capped_fraction: float
    """Tokens whose weight the cap lowered."""
    kl_mean: float
    """Mean k3 estimate of KL(current || reference); 0 without a reference."""


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    loss: torch.Tensor
    stats: PolicyLossStats


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, *, length_normalization: bool
) -> torch.Tensor:
    """Mean of `values` over true `mask` positions: per token, or per sequence then batch."""
    weights = mask.to(values.dtype)
    if length_normalization:
        per_sequence = (values * weights).sum(dim=-1) / weights.sum(dim=-1).clamp(min=1.0)
        has_tokens = (weights.sum(dim=-1) > 0).to(values.dtype)
        return (per_sequence * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)
    return (values * weights).sum() / weights.sum().clamp(min=1.0)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig = PolicyLossConfig(),
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> PolicyLoss:
    """The PPO-style clipped objective with asymmetric clip and truncated importance weights.

    Per loss token, with ratio r = exp(logprobs - old_logprobs) and advantage A (one per
    sequence, `[batch]`, or one per token, `[batch, tokens]`):

        loss_t = -w_t * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A) + kl_coef * k3_t

    where w_t = min(exp(old_logprobs - rollout_logprobs), importance_cap) corrects for the
    rollout engine sampling from slightly different numbers than the trainer computes (it is
    a constant: no gradient flows through it), and k3_t = exp(ref - cur) - (ref - cur) - 1.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
            f"mask {tuple(mask.shape)} must have the same shape"
        )
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    mask = mask.bool()
    old = old_logprobs.detach()
    ratio = torch.exp(logprobs - old)
    clipped_ratio = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)

    if rollout_logprobs is not None:
        raw_weight = torch.exp(old - rollout_logprobs.detach())
        weight = (
            raw_weight
            if config.importance_cap is None
            else torch.clamp(raw_weight, max=config.importance_cap)
        )
    else:
        raw_weight = torch.ones_like(ratio)
        weight = raw_weight
    per_token = -weight.detach() * surrogate

    kl = torch.zeros_like(ratio)
    if ref_logprobs is not None and config.kl_coef > 0.0:
        delta = ref_logprobs.detach() - logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + config.kl_coef * kl

    loss = masked_mean(per_token, mask, length_normalization=config.length_normalization)

    with torch.no_grad():
        n = int(mask.sum().item())
        r = ratio[mask]
        a = advantages[mask]
        w = raw_weight[mask]
        high = (r > 1.0 + config.clip_high) & (a > 0)
        low = (r < 1.0 - config.clip_low) & (a < 0)
        capped = (
            torch.zeros_like(w, dtype=torch.bool)
            if rollout_logprobs is None or config.importance_cap is None
            else w > config.importance_cap
        )

        def frac(x: torch.Tensor) -> float:
            return float(x.float().mean().item()) if n else 0.0

        stats = PolicyLossStats(
            tokens=n,
            clip_fraction=frac(high | low),
            clip_low_fraction=frac(low),
            clip_high_fraction=frac(high),
            ratio_mean=frac(r),
            importance_mean=frac(w),
            importance_min=float(w.min().item()) if n else 0.0,
            importance_max=float(w.max().item()) if n else 0.0,
            importance_capped_fraction=frac(capped),
            kl_mean=frac(kl[mask]),
        )
    return PolicyLoss(loss, stats)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-probability of each target under `logits` (`[batch, tokens, vocab]`)."""
    # Half-precision logits lose too much in the softmax; float32 and float64 stay as they are.
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the next-token distribution at each position, `[batch, tokens]`."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def sft_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    *,
    length_normalization: bool = False,
) -> torch.Tensor:
    """Masked negative log-likelihood of the targets."""
    if length_normalization:
        nll = -token_logprobs(logits, targets)
        return masked_mean(nll, mask.bool(), length_normalization=True)
    return sft_loss_and_logp(logits, targets, mask)[0]


def sft_loss_and_logp(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token mean negative log-likelihood of the masked targets, and the log-softmax
    it came from at those positions (`[masked tokens, vocab]`, for statistics such as the
    entropy). Only the masked positions go through the softmax over the vocabulary, which is
    most of a small model's loss cost; the other positions get no gradient, as in `sft_loss`.
    """
    selected = mask.bool()
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    logp = torch.log_softmax(logits[selected], dim=-1)
    nll = -logp.gather(-1, targets[selected].unsqueeze(-1)).squeeze(-1)
    return nll.sum() / max(nll.numel(), 1), logp
