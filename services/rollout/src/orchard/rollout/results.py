"""What one finished rollout gives the samplers: how it ended, its reward, its length."""

from __future__ import annotations

import enum
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True, order=True)
class GroupKey:
    """A (task, harness) pair: groups, and the normalization of advantages, never mix pairs."""

    task_id: str
    harness: str


class RolloutStatus(enum.Enum):
    """How a rollout ended, as the samplers rank it."""

    COMPLETED = "completed"
    """The harness finished by itself (submitted or stopped)."""
    TRUNCATED = "truncated"
    """A budget (steps, tokens, wall clock) ended it; it is still scored."""
    ABORTED = "aborted"
    """An infrastructure failure or a cancel ended it; it has no reward and never trains."""


@dataclass(frozen=True, slots=True)
class RolloutResult:
    """One rollout of one (task, harness) pair, scored."""

    key: GroupKey
    index: int
    """Which rollout of the pair this is, from 0 in start order."""
    status: RolloutStatus
    reward: float | None
    """None exactly when the rollout is aborted."""
    length: int
    """Sampled tokens (or steps where tokens are unknown): shorter ranks first."""
    rollout_id: str = ""
    payload: Any = field(default=None, compare=False)
    """Whatever the runner attaches (trajectories, provenance); samplers never read it."""

    def __post_init__(self) -> None:
        if (self.reward is None) != (self.status is RolloutStatus.ABORTED):
            raise ValueError(
                f"rollout {self.key.task_id}#{self.index}: an aborted rollout has no reward and "
                f"every other one has one (status {self.status.value}, reward {self.reward})"
            )

    @property
    def scored(self) -> bool:
        return self.reward is not None


RunRollout = Callable[[GroupKey, int], Coroutine[Any, Any, RolloutResult]]
"""Runs rollout number `index` of a (task, harness) pair to its end and scores it."""
