"""Retries: exponential backoff with full jitter, on UNAVAILABLE only.

UNAVAILABLE is the one status the service promises is safe to retry (see ``EnvService``); every
other code is a decision for the caller. The client retries a call only when repeating it cannot
do anything twice: reads, and mutations that carry the same ``request_id`` on every attempt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import grpc

__all__ = ["RETRYABLE_CODES", "RetryPolicy"]

RETRYABLE_CODES: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry a retryable failure.

    Attempt ``n`` (from 0) sleeps a uniformly random time in
    ``[0, min(max_backoff, initial_backoff * multiplier**n)]`` ("full jitter"), so that many
    clients that failed together do not come back together. ``RetryPolicy(max_attempts=1)``
    disables retries.
    """

    max_attempts: int = 5
    """Attempts in total, the first included."""
    initial_backoff: float = 0.1
    """Upper bound of the first sleep, in seconds."""
    max_backoff: float = 5.0
    """Cap on the upper bound of any sleep, in seconds."""
    multiplier: float = 2.0
    """Growth of the upper bound per attempt."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.initial_backoff < 0 or self.max_backoff < 0 or self.multiplier < 1:
            raise ValueError("backoffs must be non-negative and the multiplier at least 1")

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to sleep after failed attempt number ``attempt`` (0 = the first)."""
        ceiling = min(self.max_backoff, self.initial_backoff * self.multiplier**attempt)
        return (rng or random).uniform(0.0, ceiling)

    def should_retry(self, code: grpc.StatusCode, attempt: int) -> bool:
        """True when a failure with ``code`` on attempt ``attempt`` (0 = first) gets another."""
        return code in RETRYABLE_CODES and attempt + 1 < self.max_attempts
