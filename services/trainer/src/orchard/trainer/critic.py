"""PPO with a critic: a value head, returns and advantages with gamma = lambda = 1.

The second RL mode next to group-relative advantages. The critic is the policy's architecture
with a value head instead of the language-model head (`build_critic`: a token-classification
model with one output, its trunk copied from the policy, its head starting at zero), trained in
an engine of its own.

For a sample, the actions are its loss tokens (position t of a `TokenBatch` holds the value of
the state before target t is sampled). The trajectory's reward is given at its last loss token
(`terminal_rewards`) and generalized advantage estimation runs over the loss tokens only
(`gae`: tokens outside the mask, such as observations, are skipped, not discounted). With the
defaults gamma = lambda = 1 the return of every action is the trajectory's reward R and its
advantage is R - V_t.

`ppo_update` computes values with the critic before any step, runs the policy steps of
`rl.rl_update` with those per-token advantages, then `steps_per_update` critic steps per policy
step on the clipped value loss (`value_loss`). `value_pretrain` fits a fresh critic (zero head)
to the returns of a batch before any policy step, so the first advantages are not just the
rewards; `PpoResult.steps` puts the critic's numbers in the policy steps' metrics.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from transformers import AutoModelForTokenClassification, PreTrainedModel

from orchard.trainer.batch import TokenBatch, collate
from orchard.trainer.engine import StepResult, TrainingEngine
from orchard.trainer.losses import masked_mean
from orchard.trainer.rl import RlBatch, RlConfig, rank_micro_batches, rl_update

__all__ = [
    "CriticConfig",
    "PpoResult",
    "build_critic",
    "gae",
    "ppo_update",
    "terminal_rewards",
    "token_values",
    "value_loss",
    "value_pretrain",
]


@dataclass(frozen=True, slots=True)
class CriticConfig:
    gamma: float = 1.0
    """Discount per action token."""
    lam: float = 1.0
    """GAE lambda: 1 is the Monte Carlo return minus the value."""
    value_clip: float | None = 0.2
    """How far a value may move from its old estimate before the clipped loss binds; None: no
    clipping."""
    steps_per_update: int = 1
    """Critic optimizer steps after each policy step, on that step's micro-batches."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")
        if self.value_clip is not None and self.value_clip <= 0.0:
            raise ValueError(f"value_clip must be > 0 or None, got {self.value_clip}")
        if self.steps_per_update < 1:
            raise ValueError(f"steps_per_update must be >= 1, got {self.steps_per_update}")


def build_critic(policy: PreTrainedModel) -> PreTrainedModel:
    """A value model for `policy`: the same trunk and weights, one output per token, head at 0,
    no dropout in the head."""
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    # Token-classification heads default to dropout 0.1: the values trained on would then
    # differ from the ones advantages and the value clip use (no dropout), and between ranks.
    config.classifier_dropout = 0.0
    critic: PreTrainedModel = AutoModelForTokenClassification.from_config(config)  # type: ignore[no-untyped-call]
    in_trunk = {id(m) for m in critic.base_model.modules()}
    for module in critic.modules():
        if isinstance(module, torch.nn.Dropout) and id(module) not in in_trunk:
            module.p = 0.0
    trunk = policy.base_model
    missing = critic.base_model.load_state_dict(trunk.state_dict(), strict=True)
    if missing.missing_keys or missing.unexpected_keys:  # strict=True raises first; be explicit
        raise ValueError(f"critic trunk does not match the policy's: {missing}")
    head = getattr(critic, "score", None) or getattr(critic, "classifier", None)
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(critic).__name__} has no linear value head")
    with torch.no_grad():
        head.weight.zero_()
        if head.bias is not None:
            head.bias.zero_()
    torch.nn.Module.to(critic, policy.dtype)
    critic.train()
    return critic


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[batch, tokens]`: each row's reward at its last loss token, 0 elsewhere."""
    mask = mask.bool()
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards.to(out.device, torch.float32)[rows]
    return out


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns, `[batch, tokens]`, over the loss tokens (0 elsewhere).

    With the loss tokens of a row at positions p_1 < ... < p_k and V_{k+1} = 0:
    delta_j = r_j + gamma V_{j+1} - V_j, A_j = delta_j + gamma lam A_{j+1}, return_j = A_j + V_j.
    """
    mask = mask.bool()
    values = values.detach().float()
    rewards = rewards.float()
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(values.shape[1])):
        here = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(here, advantage, 0.0)
        next_value = torch.where(here, values[:, t], next_value)
        next_advantage = torch.where(here, advantage, next_advantage)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """0.5 * mean over loss tokens of max((V - G)^2, (V_clip - G)^2), V_clip within `clip` of
    the old value; and its statistics (value and return means, clipped fraction)."""
    mask = mask.bool()
    old = old_values.detach()
    error = (values - returns) ** 2
    if clip is not None:
        clipped = old + torch.clamp(values - old, -clip, clip)
        clipped_error = (clipped - returns) ** 2
        per_token = torch.maximum(error, clipped_error)
    else:
        clipped_error = error
        per_token = error
    loss = 0.5 * masked_mean(per_token, mask, length_normalization=False)
    with torch.no_grad():
        n = int(mask.sum())

        def mean(x: torch.Tensor) -> float:
            return float(x[mask].float().mean()) if n else 0.0

        stats = {
            "value_mean": mean(values),
            "return_mean": mean(returns),
            "value_clip_fraction": mean(clipped_error > error),
        }
    return loss, stats


def _on(batch: TokenBatch, device: torch.device) -> TokenBatch:
    return TokenBatch(
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        targets=batch.targets.to(device),
        loss_mask=batch.loss_mask.to(device),
        rollout_logprobs=batch.rollout_logprobs.to(device),
    )


def token_values(critic: TrainingEngine, batch: TokenBatch) -> torch.Tensor:
    """`[batch, tokens]`: the critic's value at each position, without gradients."""
    batch = _on(batch, critic.device)
    was_training = critic.engine.training
    critic.engine.eval()
    try:
        with torch.no_grad():
            return critic.logits(batch).squeeze(-1).float()
    finally:
        critic.engine.train(was_training)


CRITIC_STATS = ("value_mean", "return_mean", "value_clip_fraction")
"""The value-loss statistics `PpoResult.steps` carries over from the critic's steps."""


@dataclass(frozen=True, slots=True)
class PpoResult:
    policy: list[StepResult]
    critic: list[StepResult]
    """`steps_per_update` critic steps per policy step, in order."""

    def steps(self) -> list[StepResult]:
        """The policy steps, each with the numbers of the critic steps that followed it in its
        `extra` (averaged over them): `value_loss`, `value_mean`, `return_mean`,
        `value_clip_fraction`, `value_grad_norm`, `value_learning_rate`."""
        if not self.policy:
            return []
        per_update = len(self.critic) // len(self.policy)
        out = []
        for k, step in enumerate(self.policy):
            mine = self.critic[k * per_update : (k + 1) * per_update]
            if not mine:
                out.append(step)
                continue
            extra = {
                **step.extra,
                "value_loss": _mean([c.loss for c in mine]),
                "value_grad_norm": _mean([c.grad_norm for c in mine]),
                "value_learning_rate": mine[0].learning_rate,
            }
            for key in CRITIC_STATS:
                extra[key] = _mean([c.extra.get(key, 0.0) for c in mine])
            out.append(replace(step, extra=extra))
        return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@dataclass(frozen=True, slots=True)
class _Targets:
    tokens: TokenBatch
    old_values: torch.Tensor
    returns: torch.Tensor


def ppo_update(
    engine: TrainingEngine,
    critic: TrainingEngine,
    batch: RlBatch,
    config: RlConfig,
    critic_config: CriticConfig = CriticConfig(),
    *,
    pad_id: int,
    reference: PreTrainedModel | None = None,
) -> PpoResult:
    """Policy steps with the critic's advantages, each followed by critic steps on its returns.

    Both engines step on the same micro-batches (`gradient_accumulation` must agree); after
    each policy step the critic takes `critic_config.steps_per_update` steps on that step's
    micro-batches. Build the batch with `skip_zero_advantage=False`: a group's mean says nothing
    about a critic's advantages. `batch.rewards` gives each sample's reward.
    """
    _check_rewards(batch, "a PPO update")
    accumulation = engine.config.gradient_accumulation
    if critic.config.gradient_accumulation != accumulation:
        raise ValueError(
            f"the critic's gradient_accumulation ({critic.config.gradient_accumulation}) must "
            f"equal the policy's ({accumulation}): both step on the same micro-batches"
        )
    targets: list[_Targets] = []

    def advantages_of(tokens: TokenBatch, piece: range) -> torch.Tensor:
        values = token_values(critic, tokens)
        rewards = torch.tensor([batch.rewards[i] for i in piece], device=values.device)
        mask = tokens.loss_mask.to(values.device)
        advantages, returns = gae(
            terminal_rewards(rewards, mask),
            values,
            mask,
            gamma=critic_config.gamma,
            lam=critic_config.lam,
        )
        targets.append(_Targets(tokens, values, returns))
        return advantages

    policy_steps = rl_update(
        engine, batch, config, pad_id=pad_id, reference=reference, advantages_of=advantages_of
    )
    critic_steps = []
    for update in range(config.updates_per_batch):
        chunk = targets[update * accumulation : (update + 1) * accumulation]
        loss_fns = [_value_loss_fn(t, critic_config) for t in chunk]
        for _ in range(critic_config.steps_per_update):
            critic_steps.append(critic.step([t.tokens for t in chunk], loss_fns))
    return PpoResult(policy_steps, critic_steps)


def value_pretrain(
    critic: TrainingEngine,
    batch: RlBatch,
    *,
    steps: int,
    updates: int,
    critic_config: CriticConfig = CriticConfig(),
    pad_id: int,
) -> list[StepResult]:
    """`steps` critic-only optimizer steps that fit the values to the returns of `batch`.

    The targets are the discounted returns (`gae` with lambda 1, which do not depend on the
    values: a fresh critic's zero values would otherwise bias lambda-returns towards 0), and the
    loss is unclipped (the clip would hold the values near their zero start). The batch is cut
    as `ppo_update` cuts it for `updates` policy steps (the same micro-batches on each rank) and
    pretraining step `p` takes update `p mod updates`'s micro-batches. Every rank calls it.
    """
    _check_rewards(batch, "value pretraining")
    accumulation = critic.config.gradient_accumulation
    needed = updates * accumulation * critic.world_size
    if len(batch.samples) < needed:
        raise ValueError(
            f"value pretraining for {updates} update(s) x {accumulation} micro-batches x "
            f"{critic.world_size} rank(s) needs at least {needed} samples, got "
            f"{len(batch.samples)}"
        )
    pieces = rank_micro_batches(
        len(batch.samples),
        updates=updates,
        accumulation=accumulation,
        world=critic.world_size,
        rank=critic.rank,
    )
    targets = []
    for piece in pieces:
        tokens = collate([batch.samples[i] for i in piece], pad_id=pad_id)
        mask = tokens.loss_mask
        zeros = torch.zeros(mask.shape, dtype=torch.float32)
        rewards = torch.tensor([batch.rewards[i] for i in piece], dtype=torch.float32)
        _, returns = gae(
            terminal_rewards(rewards, mask), zeros, mask, gamma=critic_config.gamma, lam=1.0
        )
        targets.append(_Targets(tokens, zeros, returns))
    unclipped = replace(critic_config, value_clip=None)
    results = []
    for step in range(steps):
        update = step % updates
        chunk = targets[update * accumulation : (update + 1) * accumulation]
        loss_fns = [_value_loss_fn(t, unclipped) for t in chunk]
        results.append(critic.step([t.tokens for t in chunk], loss_fns))
    return results


def _check_rewards(batch: RlBatch, what: str) -> None:
    if len(batch.rewards) != len(batch.samples):
        raise ValueError(
            f"{what} needs one reward per sample: {len(batch.rewards)} rewards for "
            f"{len(batch.samples)} samples (build the batch with rl.build_rl_batch)"
        )


def _value_loss_fn(
    target: _Targets, config: CriticConfig
) -> Callable[[torch.Tensor, TokenBatch], tuple[torch.Tensor, dict[str, float]]]:
    def loss_fn(logits: torch.Tensor, tokens: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        values = logits.squeeze(-1).float()
        return value_loss(
            values,
            target.old_values.to(values.device),
            target.returns.to(values.device),
            tokens.loss_mask,
            clip=config.value_clip,
        )

    return loss_fn
