"""The one rule of success every service applies."""

from __future__ import annotations

import math

import pytest

from orchard.core.success import DEFAULT_SUCCESS_THRESHOLD, check_success_threshold, is_success


def test_a_reward_at_the_threshold_is_a_success_and_just_below_it_is_not() -> None:
    assert DEFAULT_SUCCESS_THRESHOLD == 0.5
    assert is_success(0.5, 0.5) and is_success(1.0, 0.5)
    assert not is_success(math.nextafter(0.5, 0.0), 0.5)
    assert is_success(0.0, 0.0)


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, math.inf])
def test_a_threshold_outside_0_1_is_refused_naming_the_field(bad: float) -> None:
    with pytest.raises(ValueError, match=r"spec\.x must be a number in \[0, 1\]"):
        check_success_threshold(bad, "spec.x")
