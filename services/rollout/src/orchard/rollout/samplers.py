"""Samplers: how many rollouts of one (task, harness) pair to run, and which of them form its group.

- `FixedNSampler` runs N rollouts and returns them all; with `GroupFilter` and a refilled batch
  (`fill_batch`) it is fixed-N with zero-variance filtering.
- `BalancedAdaptiveSampler` (Balanced Adaptive Rollout) runs rollouts in strides of `stride` and
  after each stride tries to assemble a group of `group_size` whose positive fraction lies in
  `[rho_min, rho_max]`, the count of positives closest to the middle of the interval. Within
  positives and within negatives completed rollouts rank before truncated ones and shorter
  before longer. It stops at the first stride that succeeds. At `max_rollouts` it tries again
  with the interval relaxed to [0, 1] (at least one positive and one negative, aborted
  rollouts as backfill when too few were scored), else it returns the top-ranked `group_size`.

A rollout is positive when its reward is at least `positive_threshold`. Aborted rollouts have no
reward: they never count as positives or negatives, and enter a group only as backfill.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from orchard.rollout.results import GroupKey, RolloutResult, RolloutStatus, RunRollout


class GroupChoice(enum.Enum):
    """Which rule assembled a group."""

    ALL = "all"
    """Fixed-N: every rollout."""
    BALANCED = "balanced"
    """BAR: the positive fraction lies in [rho_min, rho_max]."""
    RELAXED = "relaxed"
    """BAR at its budget: at least one positive and one negative."""
    TOP_RANKED = "top_ranked"
    """BAR at its budget, nothing better: the best-ranked rollouts."""


@dataclass(frozen=True, slots=True)
class SampledGroup:
    """The group a sampler chose for one pair, and every rollout it ran for it."""

    key: GroupKey
    members: tuple[RolloutResult, ...]
    choice: GroupChoice
    rollouts: tuple[RolloutResult, ...]
    """Every rollout run for the pair, members included: what the group cost."""
    sampler: str

    positive_threshold: float
    """A reward at or above it is a positive."""

    def is_positive(self, result: RolloutResult) -> bool:
        return result.reward is not None and result.reward >= self.positive_threshold

    @property
    def positive_count(self) -> int:
        return sum(1 for m in self.members if self.is_positive(m))

    @property
    def scored_count(self) -> int:
        return sum(1 for m in self.members if m.scored)

    @property
    def positive_fraction(self) -> float:
        """Positives among the scored members; 0 when none is scored."""
        return self.positive_count / self.scored_count if self.scored_count else 0.0


class Sampler(Protocol):
    """Runs rollouts of one pair through `run` and returns its group."""

    @property
    def name(self) -> str: ...

    async def sample(self, key: GroupKey, run: RunRollout) -> SampledGroup: ...


async def _run_stride(
    key: GroupKey, run: RunRollout, start: int, count: int
) -> list[RolloutResult]:
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(run(key, start + i)) for i in range(count)]
    results = [t.result() for t in tasks]
    for i, result in enumerate(results):
        if result.key != key or result.index != start + i:
            raise ValueError(
                f"the runner returned rollout {result.key}#{result.index} when asked for "
                f"{key}#{start + i}"
            )
    return results


@dataclass(frozen=True, slots=True)
class FixedNSampler:
    """N rollouts per pair, all in the group."""

    group_size: int = 8
    positive_threshold: float = 0.5
    """A reward at or above it is a positive."""
    name: str = "fixed_n"

    def __post_init__(self) -> None:
        # One rollout per pair is an evaluation's group; training groups need two or more,
        # which the group filter enforces.
        if self.group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {self.group_size}")

    async def sample(self, key: GroupKey, run: RunRollout) -> SampledGroup:
        results = tuple(await _run_stride(key, run, 0, self.group_size))
        return SampledGroup(
            key, results, GroupChoice.ALL, results, self.name, self.positive_threshold
        )


def _rank(result: RolloutResult) -> tuple[int, int, int]:
    order = {RolloutStatus.COMPLETED: 0, RolloutStatus.TRUNCATED: 1, RolloutStatus.ABORTED: 2}
    return (order[result.status], result.length, result.index)


@dataclass(frozen=True, slots=True)
class BalancedAdaptiveSampler:
    """Balanced Adaptive Rollout; the defaults are the published recipe's."""

    group_size: int = 8
    max_rollouts: int = 16
    stride: int = 16
    rho_min: float = 0.375
    rho_max: float = 0.625
    positive_threshold: float = 0.5
    """A reward at or above it is a positive."""
    name: str = "bar"

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2, got {self.group_size}")
        if self.max_rollouts < self.group_size:
            raise ValueError(
                f"max_rollouts ({self.max_rollouts}) must be at least group_size "
                f"({self.group_size})"
            )
        if self.stride < 1:
            raise ValueError(f"stride must be at least 1, got {self.stride}")
        if not 0.0 <= self.rho_min <= self.rho_max <= 1.0:
            raise ValueError(
                f"need 0 <= rho_min <= rho_max <= 1, got [{self.rho_min}, {self.rho_max}]"
            )

    def is_positive(self, result: RolloutResult) -> bool:
        return result.reward is not None and result.reward >= self.positive_threshold

    def assemble(
        self, results: Sequence[RolloutResult], *, relaxed: bool
    ) -> tuple[RolloutResult, ...] | None:
        """A group from `results` under the strict interval (needs `group_size` scored
        rollouts) or the relaxed one (one of each, aborted backfill), or None."""
        positives = sorted((r for r in results if self.is_positive(r)), key=_rank)
        negatives = sorted((r for r in results if r.scored and not self.is_positive(r)), key=_rank)
        aborted = sorted((r for r in results if not r.scored), key=_rank)
        scored = min(self.group_size, len(positives) + len(negatives))
        if not relaxed and scored < self.group_size:
            return None
        low, high = (0.0, 1.0) if relaxed else (self.rho_min, self.rho_max)
        middle = (low + high) / 2 * scored
        best: int | None = None
        for p in range(scored + 1):
            n = scored - p
            if p > len(positives) or n > len(negatives):
                continue
            if relaxed and (p == 0 or n == 0):
                continue
            # A small tolerance so 3/8 counts as 0.375.
            if not low - 1e-9 <= p / scored <= high + 1e-9:
                continue
            if best is None or abs(p - middle) < abs(best - middle):
                best = p
        if best is None:
            return None
        chosen = positives[:best] + negatives[: scored - best]
        backfill = aborted[: self.group_size - scored]
        return tuple(sorted(chosen, key=_rank)) + tuple(backfill)

    async def sample(self, key: GroupKey, run: RunRollout) -> SampledGroup:
        results: list[RolloutResult] = []
        while len(results) < self.max_rollouts:
            count = min(self.stride, self.max_rollouts - len(results))
            results += await _run_stride(key, run, len(results), count)
            group = self.assemble(results, relaxed=False)
            if group is not None:
                return SampledGroup(
                    key,
                    group,
                    GroupChoice.BALANCED,
                    tuple(results),
                    self.name,
                    self.positive_threshold,
                )
        group = self.assemble(results, relaxed=True)
        if group is not None:
            return SampledGroup(
                key, group, GroupChoice.RELAXED, tuple(results), self.name, self.positive_threshold
            )
        top = tuple(sorted(results, key=_rank)[: self.group_size])
        return SampledGroup(
            key, top, GroupChoice.TOP_RANKED, tuple(results), self.name, self.positive_threshold
        )
