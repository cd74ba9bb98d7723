"""Samplers: how many rollouts of one (task, harness) pair to run, and which of them form its group.

- `FixedNSampler` runs N rollouts and returns them all; with `GroupFilter` and a refilled batch
  (`fill_batch`) it is fixed-N with zero-variance filtering.
- `BalancedAdaptiveSampler` (Balanced Adaptive Rollout) runs rollouts in strides of `stride` and
  after each stride checks its stop rule:

  - `StopRule.MIXED` (the default, as the paper states BAR): stop once the pair's rollouts so far
    hold at least one success and one failure, and at least `group_size` rollouts. The group
    holds the count of successes closest to the middle of `[rho_min, rho_max]` that the
    rollouts allow, at least one of each, aborted rollouts as backfill when too few were scored.
  - `StopRule.BAND`: stop once a group of `group_size` scored rollouts whose fraction of
    successes lies in `[rho_min, rho_max]` can be assembled (with the defaults, at least 3
    successes and 3 failures for a group of 8), the count closest to the middle.

  With `stride` below `max_rollouts` BAR is adaptive: a pair that meets its rule early costs
  fewer rollouts. At `max_rollouts` it falls back to the relaxed rule (at least one success and
  one failure, aborted backfill), else it returns the top-ranked `group_size`.

  Once the counts are known, `member_choice` picks the members within the successes and within
  the failures: `MemberChoice.RANDOM` (the default) draws them with `seed`, the draw of a pair
  depending only on the seed, the pair and its rollouts; `MemberChoice.RANKED` takes the
  best-ranked (completed before truncated, shorter before longer, earlier before later).

A rollout is a success (a positive) when its reward is at least `positive_threshold`, the one
success threshold every service shares; below it, a failure (a negative). Aborted rollouts have
no reward: they never count as positives or negatives, and enter a group only as backfill.
"""

from __future__ import annotations

import asyncio
import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from orchard.core.success import DEFAULT_SUCCESS_THRESHOLD
from orchard.core.success import check_success_threshold as check_threshold
from orchard.rollout.results import GroupKey, RolloutResult, RolloutStatus, RunRollout


def check_success_threshold(value: float) -> float:
    """``value`` when it is a finite number in [0, 1], else ValueError saying so."""
    return check_threshold(value, "positive_threshold")


class GroupChoice(enum.Enum):
    """Which rule assembled a group."""

    ALL = "all"
    """Fixed-N: every rollout."""
    MIXED = "mixed"
    """BAR's mixed stop rule: at least one positive and one negative, as balanced as they allow."""
    BALANCED = "balanced"
    """BAR's band stop rule: the positive fraction lies in [rho_min, rho_max]."""
    RELAXED = "relaxed"
    """BAR at its budget: at least one positive and one negative."""
    TOP_RANKED = "top_ranked"
    """BAR at its budget, nothing better: the best-ranked rollouts."""


class StopRule(enum.Enum):
    """When BAR stops running rollouts of a pair (checked after every stride)."""

    MIXED = "mixed"
    """At least one success and one failure, and `group_size` rollouts."""
    BAND = "band"
    """A group of `group_size` scored rollouts with its success fraction in [rho_min, rho_max]."""


class MemberChoice(enum.Enum):
    """How BAR picks members among the successes and among the failures."""

    RANDOM = "random"
    """At random, drawn with the sampler's seed."""
    RANKED = "ranked"
    """The best-ranked: completed before truncated, shorter before longer, earlier first."""


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
    positive_threshold: float = DEFAULT_SUCCESS_THRESHOLD
    """A reward at or above it is a positive."""
    name: str = "fixed_n"

    def __post_init__(self) -> None:
        # One rollout per pair is an evaluation's group; training groups need two or more,
        # which the group filter enforces.
        if self.group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {self.group_size}")
        check_success_threshold(self.positive_threshold)

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
    stride: int = 8
    rho_min: float = 0.375
    rho_max: float = 0.625
    positive_threshold: float = DEFAULT_SUCCESS_THRESHOLD
    """A reward at or above it is a positive."""
    stop_rule: StopRule = StopRule.MIXED
    member_choice: MemberChoice = MemberChoice.RANDOM
    seed: int | None = None
    """Seed of the random member draw; None: a fresh one for this sampler (one job)."""
    name: str = "bar"
    _draw_seed: int = field(init=False, repr=False, compare=False)

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
        check_success_threshold(self.positive_threshold)
        object.__setattr__(self, "stop_rule", StopRule(self.stop_rule))
        object.__setattr__(self, "member_choice", MemberChoice(self.member_choice))
        fresh = random.SystemRandom().getrandbits(63) if self.seed is None else self.seed
        object.__setattr__(self, "_draw_seed", fresh)

    def is_positive(self, result: RolloutResult) -> bool:
        return result.reward is not None and result.reward >= self.positive_threshold

    def _positive_count(
        self, positives: int, negatives: int, size: int, *, both: bool
    ) -> int | None:
        """How many of `size` scored members are positives: the count closest to the middle of
        [rho_min, rho_max] (the lower one on a tie) that the rollouts allow, with at least one
        of each when `both`, else inside the interval; None when none fits."""
        middle = (self.rho_min + self.rho_max) / 2 * size
        best: int | None = None
        for p in range(size + 1):
            n = size - p
            if p > positives or n > negatives:
                continue
            if both and (p == 0 or n == 0):
                continue
            # A small tolerance so 3/8 counts as 0.375.
            if not both and not self.rho_min - 1e-9 <= p / size <= self.rho_max + 1e-9:
                continue
            if best is None or abs(p - middle) < abs(best - middle):
                best = p
        return best

    def _pick(
        self, pool: list[RolloutResult], count: int, rng: random.Random
    ) -> list[RolloutResult]:
        if self.member_choice is MemberChoice.RANKED:
            return sorted(pool, key=_rank)[:count]
        return rng.sample(sorted(pool, key=lambda r: r.index), count)

    def assemble(
        self, key: GroupKey, results: Sequence[RolloutResult], rule: GroupChoice
    ) -> tuple[RolloutResult, ...] | None:
        """A group from `results` by `rule` (MIXED, BALANCED or RELAXED), or None.

        BALANCED needs `group_size` scored rollouts in the band; MIXED needs a positive, a
        negative and `group_size` rollouts; RELAXED a positive and a negative. MIXED and RELAXED
        backfill with aborted rollouts when too few were scored."""
        positives = [r for r in results if self.is_positive(r)]
        negatives = [r for r in results if r.scored and not self.is_positive(r)]
        aborted = sorted((r for r in results if not r.scored), key=_rank)
        scored = min(self.group_size, len(positives) + len(negatives))
        if rule is GroupChoice.BALANCED and scored < self.group_size:
            return None
        if rule is GroupChoice.MIXED and len(results) < self.group_size:
            return None
        count = self._positive_count(
            len(positives), len(negatives), scored, both=rule is not GroupChoice.BALANCED
        )
        if count is None:
            return None
        # The draw depends on the seed, the pair and its rollouts only: never on timing.
        rng = random.Random(f"{self._draw_seed}/{key.task_id}/{key.harness}/{len(results)}")
        chosen = self._pick(positives, count, rng) + self._pick(negatives, scored - count, rng)
        order = _rank if self.member_choice is MemberChoice.RANKED else _by_index
        backfill = aborted[: self.group_size - scored]
        return tuple(sorted(chosen, key=order)) + tuple(backfill)

    async def sample(self, key: GroupKey, run: RunRollout) -> SampledGroup:
        stop = GroupChoice.MIXED if self.stop_rule is StopRule.MIXED else GroupChoice.BALANCED
        results: list[RolloutResult] = []
        while len(results) < self.max_rollouts:
            count = min(self.stride, self.max_rollouts - len(results))
            results += await _run_stride(key, run, len(results), count)
            group = self.assemble(key, results, stop)
            if group is not None:
                return self._group(key, group, stop, results)
        group = self.assemble(key, results, GroupChoice.RELAXED)
        if group is not None:
            return self._group(key, group, GroupChoice.RELAXED, results)
        top = tuple(sorted(results, key=_rank)[: self.group_size])
        return self._group(key, top, GroupChoice.TOP_RANKED, results)

    def _group(
        self,
        key: GroupKey,
        members: tuple[RolloutResult, ...],
        choice: GroupChoice,
        results: Sequence[RolloutResult],
    ) -> SampledGroup:
        return SampledGroup(
            key, members, choice, tuple(results), self.name, self.positive_threshold
        )


def _by_index(result: RolloutResult) -> int:
    return result.index
