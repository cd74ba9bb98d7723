"""Training samples and per-token loss masks built from trajectories.

A trajectory's token sequence is the concatenation, turn by turn, of `input_token_ids` and
`output_token_ids` (shared prefixes are stored once in the proto). A sample keeps that sequence
and marks which tokens count in the loss:

- observation, system and user tokens (`input_token_ids`) never count;
- auxiliary turns (compaction, sub-agents) never count;
- a policy output token counts only where its turn's `output_loss_mask` allows it;
- for SFT, a successful trajectory (its reward at or above `success_threshold`, the success
  threshold every service shares) trains on all its policy turns, a failed one only on the
  turns inside its credit-assignment rise segments (`TurnSpan`, inclusive at both ends);
- for RL, every policy turn counts; the advantage carries the sign;
- a trajectory whose reward is excluded, unscored or aborted never yields a sample (on-policy
  distillation needs no reward: there an unscored one does, `require_reward=False`).

Builders return a `Skip` with a reason instead of a sample, so callers can count what was left
out and why. A malformed trajectory raises `TrajectoryError` with a message naming the field.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from orchard.core.success import DEFAULT_SUCCESS_THRESHOLD, check_success_threshold, is_success
from orchard.types.v1 import reward_pb2, trajectory_pb2


class TrajectoryError(ValueError):
    """A trajectory that cannot be turned into a sample as it stands (bad lengths or spans)."""


class SkipReason(enum.StrEnum):
    """Why a trajectory produced no sample."""

    EXCLUDED = "excluded"
    """The reward is excluded (an infrastructure failure): never trained on."""
    UNSCORED = "unscored"
    """The reward status is unspecified: never trained on."""
    ABORTED = "aborted"
    """The rollout was aborted: never trained on."""
    NO_LOSS_TOKENS = "no_loss_tokens"
    """No token would count in the loss (e.g. a failed trajectory without rise segments)."""
    TOO_LONG = "too_long"
    """Longer than `drop_over`, or than the context window when the overflow policy is drop."""


class Overflow(enum.StrEnum):
    """What to do with a sample longer than the context window."""

    TRUNCATE_LEFT = "truncate_left"
    """Keep the last `context_window` tokens (the oldest context goes first)."""
    DROP = "drop"
    """Leave the sample out."""


@dataclass(frozen=True, slots=True)
class SampleConfig:
    """How samples are cut from trajectories."""

    context_window: int | None = None
    """Most tokens per sample; None means no limit."""
    overflow: Overflow = Overflow.TRUNCATE_LEFT
    """What happens to a sample longer than `context_window`."""
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD
    """A scored trajectory is successful when its reward value is at or above this."""
    per_turn: bool = False
    """SFT only: each trained turn becomes its own sample, with the earlier turns as context."""
    drop_over: int | None = None
    """Samples with more tokens than this are dropped whatever `overflow` says, so that one
    slightly over the window is truncated and one far over it is left out; None: no limit."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "overflow", Overflow(self.overflow))
        if self.context_window is not None and self.context_window < 2:
            raise ValueError(
                f"context_window must be at least 2 tokens (or None), got {self.context_window}"
            )
        if self.drop_over is not None and self.drop_over < 2:
            raise ValueError(f"drop_over must be at least 2 tokens (or None), got {self.drop_over}")
        check_success_threshold(self.success_threshold)


@dataclass(frozen=True, slots=True)
class Sample:
    """One training sequence with its per-token loss mask.

    All tuples have one entry per token. `rollout_logprobs` holds the sampling policy's
    log-probability for output tokens and 0.0 for input tokens.
    """

    trajectory_id: str
    token_ids: tuple[int, ...]
    loss_mask: tuple[bool, ...]
    rollout_logprobs: tuple[float, ...]
    truncated: int = 0
    """How many tokens were cut from the left."""
    turn: int | None = None
    """The one turn it trains on (per-turn samples); None when it trains on the whole."""

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass(frozen=True, slots=True)
class Skip:
    """A trajectory that produced no sample, and why."""

    trajectory_id: str
    reason: SkipReason


def trainable_reason(
    trajectory: trajectory_pb2.Trajectory, *, require_reward: bool = True
) -> SkipReason | None:
    """None when the trajectory may enter a loss, otherwise why not. Without
    `require_reward` an unscored trajectory may (excluded and aborted ones never do)."""
    if trajectory.outcome == trajectory_pb2.TRAJECTORY_OUTCOME_ABORTED:
        return SkipReason.ABORTED
    status = trajectory.reward.status
    if status == reward_pb2.REWARD_STATUS_EXCLUDED:
        return SkipReason.EXCLUDED
    if require_reward and status != reward_pb2.REWARD_STATUS_SCORED:
        return SkipReason.UNSCORED
    return None


def is_successful(trajectory: trajectory_pb2.Trajectory, config: SampleConfig) -> bool:
    """Whether a scored trajectory counts as a success for SFT: its reward is at or above
    `config.success_threshold`."""
    return is_success(trajectory.reward.value, config.success_threshold)


def rise_turns(trajectory: trajectory_pb2.Trajectory) -> set[int]:
    """Turn indices inside the trajectory's rise segments (spans are inclusive)."""
    n = len(trajectory.turns)
    turns: set[int] = set()
    for k, span in enumerate(trajectory.credit.rise_segments):
        if not 0 <= span.start <= span.end < n:
            raise TrajectoryError(
                f"trajectory {trajectory.id!r}: credit.rise_segments[{k}] is "
                f"[{span.start}, {span.end}], which is not a span of its {n} turns "
                f"(need 0 <= start <= end < {n})"
            )
        turns.update(range(span.start, span.end + 1))
    return turns


def _turn_output_mask(trajectory_id: str, turn: trajectory_pb2.Turn) -> list[bool]:
    n = len(turn.output_token_ids)
    mask = list(turn.output_loss_mask)
    if not mask:
        return [True] * n
    if len(mask) != n:
        raise TrajectoryError(
            f"trajectory {trajectory_id!r}: turn {turn.index} has {len(mask)} output_loss_mask "
            f"entries for {n} output tokens (need one per token, or none for all)"
        )
    return mask


def _check_turns(trajectory: trajectory_pb2.Trajectory) -> None:
    for position, turn in enumerate(trajectory.turns):
        if turn.index != position:
            raise TrajectoryError(
                f"trajectory {trajectory.id!r}: turn at position {position} has index "
                f"{turn.index} (turns must be stored in order, indexed from 0)"
            )
        if len(turn.output_logprobs) not in (0, len(turn.output_token_ids)):
            raise TrajectoryError(
                f"trajectory {trajectory.id!r}: turn {turn.index} has "
                f"{len(turn.output_logprobs)} output_logprobs for "
                f"{len(turn.output_token_ids)} output tokens (need one per token)"
            )


def _assemble(
    trajectory: trajectory_pb2.Trajectory,
    trained_turns: set[int],
    last_turn: int,
) -> tuple[list[int], list[bool], list[float]]:
    tokens: list[int] = []
    mask: list[bool] = []
    logprobs: list[float] = []
    for turn in trajectory.turns[: last_turn + 1]:
        tokens.extend(turn.input_token_ids)
        mask.extend([False] * len(turn.input_token_ids))
        logprobs.extend([0.0] * len(turn.input_token_ids))
        out_mask = _turn_output_mask(trajectory.id, turn)
        counts = turn.kind == trajectory_pb2.TURN_KIND_POLICY and turn.index in trained_turns
        tokens.extend(turn.output_token_ids)
        mask.extend(m and counts for m in out_mask)
        logprobs.extend(turn.output_logprobs or [0.0] * len(turn.output_token_ids))
    return tokens, mask, logprobs


def _finish(
    trajectory_id: str,
    tokens: list[int],
    mask: list[bool],
    logprobs: list[float],
    config: SampleConfig,
    *,
    turn: int | None = None,
) -> Sample | Skip:
    if config.drop_over is not None and len(tokens) > config.drop_over:
        return Skip(trajectory_id, SkipReason.TOO_LONG)
    cut = 0
    window = config.context_window
    if window is not None and len(tokens) > window:
        if config.overflow is Overflow.DROP:
            return Skip(trajectory_id, SkipReason.TOO_LONG)
        cut = len(tokens) - window
    sample = Sample(
        trajectory_id=trajectory_id,
        token_ids=tuple(tokens[cut:]),
        loss_mask=tuple(mask[cut:]),
        rollout_logprobs=tuple(logprobs[cut:]),
        truncated=cut,
        turn=turn,
    )
    # The first token has no context to predict it from, so it can never be a target.
    if not any(sample.loss_mask[1:]):
        return Skip(trajectory_id, SkipReason.NO_LOSS_TOKENS)
    return sample


def sft_samples(
    trajectory: trajectory_pb2.Trajectory, config: SampleConfig = SampleConfig()
) -> list[Sample | Skip]:
    """SFT samples of one trajectory: one, or one per trained turn with `per_turn`."""
    reason = trainable_reason(trajectory)
    if reason is not None:
        return [Skip(trajectory.id, reason)]
    _check_turns(trajectory)
    all_turns = set(range(len(trajectory.turns)))
    trained = all_turns if is_successful(trajectory, config) else rise_turns(trajectory)
    if not config.per_turn:
        tokens, mask, logprobs = _assemble(trajectory, trained, len(trajectory.turns) - 1)
        return [_finish(trajectory.id, tokens, mask, logprobs, config)]
    results: list[Sample | Skip] = []
    for index in sorted(trained):
        turn = trajectory.turns[index]
        if turn.kind != trajectory_pb2.TURN_KIND_POLICY:
            continue
        tokens, mask, logprobs = _assemble(trajectory, {index}, index)
        results.append(_finish(trajectory.id, tokens, mask, logprobs, config, turn=index))
    return results or [Skip(trajectory.id, SkipReason.NO_LOSS_TOKENS)]


def rl_sample(
    trajectory: trajectory_pb2.Trajectory,
    config: SampleConfig = SampleConfig(),
    *,
    require_reward: bool = True,
) -> Sample | Skip:
    """The policy-gradient sample of one trajectory: every policy output token counts.
    Without `require_reward` (on-policy distillation) an unscored trajectory gives one too."""
    reason = trainable_reason(trajectory, require_reward=require_reward)
    if reason is not None:
        return Skip(trajectory.id, reason)
    _check_turns(trajectory)
    tokens, mask, logprobs = _assemble(
        trajectory, set(range(len(trajectory.turns))), len(trajectory.turns) - 1
    )
    return _finish(trajectory.id, tokens, mask, logprobs, config)


@dataclass(frozen=True, slots=True)
class SampleSet:
    """Samples cut from many trajectories, and a count of what was left out."""

    samples: tuple[Sample, ...]
    skipped: Counter[SkipReason]


def build_sft_samples(
    trajectories: Iterable[trajectory_pb2.Trajectory], config: SampleConfig = SampleConfig()
) -> SampleSet:
    """SFT samples of a dataset, with skip counts by reason."""
    return _collect(r for t in trajectories for r in sft_samples(t, config))


def build_rl_samples(
    trajectories: Iterable[trajectory_pb2.Trajectory],
    config: SampleConfig = SampleConfig(),
    *,
    require_reward: bool = True,
) -> SampleSet:
    """Policy-gradient samples of a batch, with skip counts by reason."""
    return _collect(rl_sample(t, config, require_reward=require_reward) for t in trajectories)


def _collect(results: Iterable[Sample | Skip]) -> SampleSet:
    samples: list[Sample] = []
    skipped: Counter[SkipReason] = Counter()
    for result in results:
        if isinstance(result, Skip):
            skipped[result.reason] += 1
        else:
            samples.append(result)
    return SampleSet(tuple(samples), skipped)


def loss_positions(sample: Sample) -> Sequence[int]:
    """Positions of the tokens that count in the loss (for reading and tests)."""
    return [i for i, m in enumerate(sample.loss_mask) if m]
