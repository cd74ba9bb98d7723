"""Budgets per rollout and layered retries for infrastructure calls.

A budget ends a rollout as truncated (it is still scored). A retry policy belongs to one layer
(sandbox create, inference call, tool exec, reward); when its attempts run out the layer raises
`InfrastructureError`, and the rollout is excluded from training — never scored as a policy
failure. Backoff is exponential with full jitter so bursts of failures do not retry in step.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from orchard.rollout.provenance import FailureLayer

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RolloutBudget:
    """Limits of one rollout; the first reached ends it."""

    max_steps: int = 30
    """Most model calls."""
    max_tokens: int = 32_768
    """Most sampled tokens in total."""
    max_duration_s: float = 600.0
    """Longest wall-clock time, seconds (default 10 minutes)."""

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.max_tokens < 1 or self.max_duration_s <= 0:
            raise ValueError(
                f"budgets must be positive: max_steps {self.max_steps}, max_tokens "
                f"{self.max_tokens}, max_duration_s {self.max_duration_s}"
            )


@dataclass(frozen=True, slots=True)
class LayerRetry:
    """How one layer's calls are timed out and retried."""

    attempts: int = 3
    """Tries in all, the first included."""
    timeout_s: float = 60.0
    """Deadline of each try."""
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.timeout_s <= 0 or self.initial_backoff_s < 0:
            raise ValueError(
                f"bad retry settings: attempts {self.attempts}, timeout_s {self.timeout_s}, "
                f"initial_backoff_s {self.initial_backoff_s}"
            )

    def backoff(self, attempt: int, rng: random.Random) -> float:
        """Full jitter: uniform in [0, min(max, initial * 2**attempt)]."""
        return rng.uniform(0, min(self.max_backoff_s, self.initial_backoff_s * 2**attempt))


@dataclass(frozen=True, slots=True)
class LayeredRetries:
    """A retry policy per layer."""

    sandbox_create: LayerRetry = field(default_factory=lambda: LayerRetry(timeout_s=300.0))
    inference: LayerRetry = field(default_factory=lambda: LayerRetry(timeout_s=120.0))
    tool_exec: LayerRetry = field(default_factory=lambda: LayerRetry(attempts=2, timeout_s=180.0))
    reward: LayerRetry = field(default_factory=lambda: LayerRetry(timeout_s=300.0))
    create_spread_s: float = 1.0
    """Sandbox creates start after a uniform random delay up to this, against bursts."""

    def for_layer(self, layer: FailureLayer) -> LayerRetry:
        return {
            FailureLayer.SANDBOX_CREATE: self.sandbox_create,
            FailureLayer.INFERENCE: self.inference,
            FailureLayer.TOOL_EXEC: self.tool_exec,
            FailureLayer.REWARD: self.reward,
        }.get(layer, LayerRetry(attempts=1))


class InfrastructureError(Exception):
    """A layer failed for reasons that are not the policy's; the rollout is excluded."""

    def __init__(self, layer: FailureLayer, error: str, attempts: int) -> None:
        super().__init__(f"{layer.value} failed after {attempts} attempt(s): {error}")
        self.layer = layer
        self.error = error
        self.attempts = attempts


async def with_retries(
    layer: FailureLayer,
    policy: LayerRetry,
    attempt_fn: Callable[[int], Awaitable[T]],
    *,
    retryable: tuple[type[BaseException], ...],
    rng: random.Random | None = None,
) -> T:
    """Runs `attempt_fn(attempt)` under the layer's deadline until it succeeds; exceptions in
    `retryable` and timeouts are retried with backoff, then raised as InfrastructureError.
    Other exceptions pass through at once."""
    rng = rng or random.Random()
    last = ""
    for attempt in range(policy.attempts):
        if attempt:
            await asyncio.sleep(policy.backoff(attempt - 1, rng))
        try:
            async with asyncio.timeout(policy.timeout_s):
                return await attempt_fn(attempt)
        except TimeoutError:
            last = f"no answer within {policy.timeout_s:g}s"
        except retryable as exc:
            last = f"{type(exc).__name__}: {exc}"
        log.info("%s attempt %d failed: %s", layer.value, attempt + 1, last)
    raise InfrastructureError(layer, last, policy.attempts)
