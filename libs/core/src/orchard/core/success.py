"""What success means, once for every service: a rollout succeeded when its reward is at or
above the success threshold. A recipe (or its task suite, e.g. Claw's 0.75) sets the threshold
and sends it in every request that needs it (`SamplerConfig.positive_threshold`,
`AssignCreditRequest.success_threshold`, `PrepareDatasetRequest.success_threshold`,
`TrainingJobSpec.success_threshold`); a request without one means `DEFAULT_SUCCESS_THRESHOLD`."""

from __future__ import annotations

import math

__all__ = ["DEFAULT_SUCCESS_THRESHOLD", "check_success_threshold", "is_success"]

DEFAULT_SUCCESS_THRESHOLD = 0.5
"""The threshold where neither the request, nor the recipe, nor its task suite gives one."""


def check_success_threshold(value: float, what: str = "success_threshold") -> float:
    """``value`` when it is a finite number in [0, 1], else ValueError naming ``what``."""
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{what} must be a number in [0, 1], got {value}")
    return value


def is_success(reward: float, threshold: float) -> bool:
    """The one rule: a reward at or above the threshold is a success."""
    return reward >= threshold
