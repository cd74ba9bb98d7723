"""Policy-gradient RL: scored trajectory groups in, optimizer steps through the engine out.

`build_rl_batch` turns a batch of trajectories into samples with one advantage each:

- group-relative advantages per (task, harness) (`losses.group_advantages`);
- excluded, unscored and aborted trajectories get no sample and no advantage: they never enter
  the loss (and are counted by reason);
- trajectories whose advantage is zero carry no policy gradient and are left out
  (`skip_zero_advantage`, on by default);
- without `require_reward` (on-policy distillation, whose advantages come per token from a
  teacher: `orchard.trainer.distillation`) unscored trajectories yield samples too, with a
  batch advantage of 0;
- shared prefixes count once: where trajectories of one rollout (same `rollout_id`) begin with
  the same tokens, only the first of them keeps those positions in its loss mask;
- trajectories sampled by weights more than `max_staleness` versions behind the trainer are
  refused (`StaleBatchError`) or left out, by configuration.

`rl_update` then recomputes the old log-probabilities of every micro-batch with the current
weights (no gradient), optionally the reference policy's, and runs `updates_per_batch`
optimizer steps of the clipped objective (`losses.policy_loss`): the importance weight is
between the rollout engine's log-probabilities and the recomputed old ones, the ratio between
the current and the old ones. A sample whose trajectory lacks the rollout engine's
log-probabilities on a policy turn (`RlBatch.sampled`; e.g. a teacher's turns) takes the
recomputed old ones as its rollout log-probabilities: its importance weight is 1.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
from transformers import PreTrainedModel

from orchard.trainer.batch import TokenBatch, collate
from orchard.trainer.engine import StepResult, TrainingEngine, masked_entropy
from orchard.trainer.losses import (
    AdvantageConfig,
    PolicyLossConfig,
    group_advantages,
    policy_loss,
    token_logprobs,
)
from orchard.trainer.masks import Sample, SampleConfig, build_rl_samples
from orchard.types.v1 import trajectory_pb2

__all__ = [
    "AdvantageFn",
    "RlBatch",
    "RlConfig",
    "StaleBatchError",
    "StalePolicy",
    "build_rl_batch",
    "count_shared_prefixes_once",
    "has_rollout_logprobs",
    "rank_micro_batches",
    "rl_update",
    "staleness",
]


class StalePolicy(enum.StrEnum):
    """What happens to trajectories older than `max_staleness` versions."""

    REJECT = "reject"
    """Refuse the whole batch (`StaleBatchError`)."""
    SKIP = "skip"
    """Leave the stale trajectories out and train on the rest."""


class StaleBatchError(ValueError):
    """A batch holds trajectories sampled by weights too many versions old."""


@dataclass(frozen=True, slots=True)
class RlConfig:
    """How a batch of trajectory groups becomes optimizer steps."""

    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    advantages: AdvantageConfig = field(default_factory=AdvantageConfig)
    samples: SampleConfig = field(default_factory=SampleConfig)
    updates_per_batch: int = 1
    """Optimizer steps per batch; the old log-probabilities are computed once before them."""
    skip_zero_advantage: bool = True
    require_reward: bool = True
    """False: unscored trajectories train too (their advantages come from elsewhere, per
    token); excluded and aborted ones still never do."""
    max_staleness: int | None = None
    """Most weight versions a trajectory may lag behind the trainer; None is no bound."""
    stale: StalePolicy = StalePolicy.REJECT

    def __post_init__(self) -> None:
        if self.updates_per_batch < 1:
            raise ValueError(f"updates_per_batch must be >= 1, got {self.updates_per_batch}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")


@dataclass(frozen=True, slots=True)
class RlBatch:
    """Samples that enter the loss, with their advantages, and what was left out."""

    samples: tuple[Sample, ...]
    advantages: tuple[float, ...]
    """One per sample."""
    reward_mean: float
    """Mean reward of the scored trajectories of the batch (NaN when none)."""
    skipped: Counter[str] = field(default_factory=Counter)
    """Trajectories left out, by reason."""
    rewards: tuple[float, ...] = ()
    """The reward of each sample's trajectory, one per sample (for a critic's returns)."""
    sampled: tuple[bool, ...] = ()
    """Per sample: its trajectory carries the rollout engine's log-probabilities on every
    policy turn with output tokens; empty: every sample does."""


AdvantageFn = Callable[[TokenBatch, range], torch.Tensor]
"""(micro-batch, indices of its samples in the batch) -> advantages, `[batch]` or
`[batch, tokens]`."""

VersionLag = Callable[[str], int | None]
"""A weight version -> how many versions it lags behind the trainer (None: unknown)."""


def staleness(trajectory: trajectory_pb2.Trajectory, lag: VersionLag) -> int | None:
    """How many versions behind the oldest policy turn of `trajectory` is; None if unknown."""
    lags = [
        lag(turn.weight_version)
        for turn in trajectory.turns
        if turn.kind == trajectory_pb2.TURN_KIND_POLICY
    ]
    if any(x is None for x in lags):
        return None
    return max((x for x in lags if x is not None), default=0)


def build_rl_batch(
    trajectories: Iterable[trajectory_pb2.Trajectory],
    config: RlConfig = RlConfig(),
    *,
    version_lag: VersionLag | None = None,
) -> RlBatch:
    """The samples and advantages of a batch (see the module docstring)."""
    batch = list(trajectories)
    skipped: Counter[str] = Counter()
    if config.max_staleness is not None and version_lag is not None:
        fresh = []
        for trajectory in batch:
            lag = staleness(trajectory, version_lag)
            if lag is not None and lag <= config.max_staleness:
                fresh.append(trajectory)
                continue
            if config.stale is StalePolicy.REJECT:
                behind = "an unknown weight version" if lag is None else f"{lag} versions behind"
                raise StaleBatchError(
                    f"trajectory {trajectory.id!r} was sampled by {behind}; this job accepts "
                    f"at most {config.max_staleness}"
                )
            skipped["stale"] += 1
        batch = fresh
    advantages = group_advantages(batch, config.advantages)
    sample_set = build_rl_samples(batch, config.samples, require_reward=config.require_reward)
    skipped.update({str(reason): n for reason, n in sample_set.skipped.items()})
    rollout_of = {t.id: t.rollout_id for t in batch}
    samples = count_shared_prefixes_once(sample_set.samples, rollout_of)
    kept: list[Sample] = []
    kept_advantages: list[float] = []
    reward_of = {t.id: t.reward.value for t in batch}
    sampled_of = {t.id: has_rollout_logprobs(t) for t in batch}
    for sample in samples:
        # Without require_reward an unscored trajectory has no group advantage: 0.
        advantage = advantages.get(sample.trajectory_id, 0.0)
        if config.skip_zero_advantage and advantage == 0.0:
            skipped["zero_advantage"] += 1
            continue
        if not any(sample.loss_mask[1:]):
            skipped["shared_prefix_only"] += 1
            continue
        kept.append(sample)
        kept_advantages.append(advantage)
    rewards = [t.reward.value for t in batch if t.id in advantages]
    return RlBatch(
        samples=tuple(kept),
        advantages=tuple(kept_advantages),
        reward_mean=math.fsum(rewards) / len(rewards) if rewards else math.nan,
        skipped=skipped,
        rewards=tuple(reward_of[s.trajectory_id] for s in kept),
        sampled=tuple(sampled_of[s.trajectory_id] for s in kept),
    )


def has_rollout_logprobs(trajectory: trajectory_pb2.Trajectory) -> bool:
    """Whether every policy turn with output tokens carries their sampling log-probabilities
    (a teacher's turns, rendered from text, carry none)."""
    return all(
        len(turn.output_logprobs) == len(turn.output_token_ids)
        for turn in trajectory.turns
        if turn.kind == trajectory_pb2.TURN_KIND_POLICY and turn.output_token_ids
    )


def count_shared_prefixes_once(
    samples: Sequence[Sample], rollout_of: dict[str, str]
) -> list[Sample]:
    """Mask, in later trajectories of a rollout, the leading tokens an earlier one already has.

    Samples are compared only when neither was left-truncated (their positions line up) and
    both come from the same non-empty `rollout_id`.
    """
    seen: dict[str, list[tuple[int, ...]]] = {}
    result: list[Sample] = []
    for sample in samples:
        rollout = rollout_of.get(sample.trajectory_id, "")
        if not rollout or sample.truncated:
            result.append(sample)
            continue
        earlier = seen.setdefault(rollout, [])
        shared = max((_common_prefix(sample.token_ids, e) for e in earlier), default=0)
        earlier.append(sample.token_ids)
        if shared == 0:
            result.append(sample)
            continue
        mask = (False,) * shared + sample.loss_mask[shared:]
        result.append(replace(sample, loss_mask=mask))
    return result


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _split(n: int, parts: int) -> list[range]:
    """`parts` consecutive ranges covering range(n), sizes differing by at most one."""
    base, extra = divmod(n, parts)
    ranges, start = [], 0
    for k in range(parts):
        size = base + (1 if k < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def rank_micro_batches(
    samples: int, *, updates: int, accumulation: int, world: int, rank: int
) -> list[range]:
    """The sample ranges of a batch of `samples` that rank `rank` trains on, `accumulation`
    per update for `updates` updates: the batch is cut into `updates x world` mini-batches of
    `accumulation` micro-batches each, and update `u` of rank `r` takes mini-batch
    `u x world + r`."""
    split = _split(samples, updates * accumulation * world)
    return [
        split[(update * world + rank) * accumulation + k]
        for update in range(updates)
        for k in range(accumulation)
    ]


@dataclass(frozen=True, slots=True)
class _RlMicroBatch:
    tokens: TokenBatch
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None


def rl_update(
    engine: TrainingEngine,
    batch: RlBatch,
    config: RlConfig,
    *,
    pad_id: int,
    reference: PreTrainedModel | None = None,
    advantages_of: AdvantageFn | None = None,
) -> list[StepResult]:
    """Run `updates_per_batch` optimizer steps of the clipped objective on `batch`.

    Every rank passes the same batch. It is cut into `updates_per_batch x world_size`
    mini-batches of `gradient_accumulation` micro-batches each (so it needs at least that many
    samples); update `u` of rank `r` trains on mini-batch `u x world_size + r`, so a world of
    two with accumulation g and a world of one with accumulation 2g see the same micro-batches
    in each update. `advantages_of` replaces the batch's group-relative advantages, one
    micro-batch at a time, before any step (a critic's per-token advantages:
    `orchard.trainer.critic.ppo_update`).
    """
    accumulation = engine.config.gradient_accumulation
    world, rank = engine.world_size, engine.rank
    pieces = config.updates_per_batch * accumulation * world
    if len(batch.samples) < pieces:
        raise ValueError(
            f"an RL update of {config.updates_per_batch} step(s) x {accumulation} micro-batches "
            f"x {world} rank(s) needs at least {pieces} trainable samples, got "
            f"{len(batch.samples)}"
        )
    mine = rank_micro_batches(
        len(batch.samples),
        updates=config.updates_per_batch,
        accumulation=accumulation,
        world=world,
        rank=rank,
    )
    micro: list[_RlMicroBatch] = []
    for piece in mine:
        tokens = collate([batch.samples[i] for i in piece], pad_id=pad_id)
        old = engine.target_logprobs(tokens)
        tokens = _fill_rollout_logprobs(tokens, old, [_sampled(batch, i) for i in piece])
        ref = None
        if reference is not None and config.loss.kl_coef > 0.0:
            ref = _reference_logprobs(reference, tokens, engine.device)
        if advantages_of is not None:
            advantages = advantages_of(tokens, piece).to(engine.device, torch.float32)
        else:
            advantages = torch.tensor(
                [batch.advantages[i] for i in piece], dtype=torch.float32, device=engine.device
            )
        micro.append(_RlMicroBatch(tokens, advantages, old, ref))
    results = []
    for update in range(config.updates_per_batch):
        chunk = micro[update * accumulation : (update + 1) * accumulation]
        loss_fns = [_policy_loss_fn(m, config.loss, batch.reward_mean) for m in chunk]
        # Without length normalization every loss token of the step weighs the same, whatever
        # micro-batch it is in (`TrainingEngine.step`): long episodes are not down-weighted.
        results.append(
            engine.step(
                [m.tokens for m in chunk],
                loss_fns,
                token_weighted=not config.loss.length_normalization,
            )
        )
    return results


def _sampled(batch: RlBatch, index: int) -> bool:
    return not batch.sampled or batch.sampled[index]


def _fill_rollout_logprobs(
    tokens: TokenBatch, old: torch.Tensor, sampled: Sequence[bool]
) -> TokenBatch:
    """`tokens` with the rows that lack sampling log-probabilities (zeros from `collate`) set
    to the recomputed old ones, so their importance weight is 1 rather than exp(old)."""
    if all(sampled):
        return tokens
    rows = torch.tensor([not s for s in sampled], dtype=torch.bool)
    filled = tokens.rollout_logprobs.clone()
    filled[rows] = old.detach().to(filled.device, filled.dtype)[rows]
    return replace(tokens, rollout_logprobs=filled)


def _reference_logprobs(
    reference: PreTrainedModel, tokens: TokenBatch, device: torch.device
) -> torch.Tensor:
    with torch.no_grad():
        logits = reference(
            input_ids=tokens.input_ids.to(device),
            attention_mask=tokens.attention_mask.to(device),
        ).logits
        return token_logprobs(logits, tokens.targets.to(device)).float()


def _policy_loss_fn(
    micro: _RlMicroBatch, config: PolicyLossConfig, reward_mean: float
) -> Callable[[torch.Tensor, TokenBatch], tuple[torch.Tensor, dict[str, float]]]:
    def loss_fn(logits: torch.Tensor, tokens: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs = token_logprobs(logits, tokens.targets)
        out = policy_loss(
            logprobs,
            micro.old_logprobs,
            micro.advantages,
            tokens.loss_mask,
            config=config,
            rollout_logprobs=tokens.rollout_logprobs,
            ref_logprobs=micro.ref_logprobs,
        )
        stats = {k: float(v) for k, v in asdict(out.stats).items() if k != "tokens"}
        stats["entropy"] = masked_entropy(logits, tokens.loss_mask)
        if not math.isnan(reward_mean):
            stats["reward_mean"] = reward_mean
        advantages = micro.advantages
        if advantages.dim() == 2:  # per token: the mean over the loss tokens
            advantages = advantages[tokens.loss_mask.bool()]
        stats["advantage_mean"] = float(advantages.mean()) if advantages.numel() else 0.0
        return out.loss, stats

    return loss_fn
