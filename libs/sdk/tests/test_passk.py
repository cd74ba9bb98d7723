"""pass@k and pass^k: hand-computed cases, the bounds they keep, the tasks they leave out, and
agreement with counting every k-subset of the attempts."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest

from orchard.sdk.passk import PassK, estimate_pass_k, pass_at_k, pass_hat_k

# n = 3 attempts, c successes: (c, k, pass@k, pass^k), worked by hand from the C(3, k) subsets.
HAND_COMPUTED = [
    (0, 1, 0.0, 0.0),
    (0, 2, 0.0, 0.0),
    (0, 3, 0.0, 0.0),
    (1, 1, 1 / 3, 1 / 3),
    (1, 2, 2 / 3, 0.0),  # of the 3 pairs, 2 hold the success and none is two successes
    (1, 3, 1.0, 0.0),
    (2, 1, 2 / 3, 2 / 3),
    (2, 2, 1.0, 1 / 3),  # every pair holds a success; 1 of the 3 pairs is both successes
    (2, 3, 1.0, 0.0),
    (3, 1, 1.0, 1.0),
    (3, 2, 1.0, 1.0),
    (3, 3, 1.0, 1.0),
]


@pytest.mark.parametrize(("c", "k", "at_k", "hat_k"), HAND_COMPUTED)
def test_three_attempts_match_the_hand_computed_values(
    c: int, k: int, at_k: float, hat_k: float
) -> None:
    assert pass_at_k(3, c, k) == pytest.approx(at_k, abs=1e-12)
    assert pass_hat_k(3, c, k) == pytest.approx(hat_k, abs=1e-12)


@pytest.mark.parametrize(("n", "c"), [(1, 0), (1, 1), (3, 2), (7, 3), (20, 20), (64, 1)])
def test_at_k_1_both_are_the_success_rate(n: int, c: int) -> None:
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    assert pass_hat_k(n, c, 1) == pytest.approx(c / n)


def test_pass_hat_k_stays_below_the_rate_and_pass_at_k_above() -> None:
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                rate = c / n
                assert 0.0 <= pass_hat_k(n, c, k) <= rate + 1e-12
                assert rate - 1e-12 <= pass_at_k(n, c, k) <= 1.0
            # More attempts: pass@k never falls, pass^k never rises.
            at = [pass_at_k(n, c, k) for k in range(1, n + 1)]
            hat = [pass_hat_k(n, c, k) for k in range(1, n + 1)]
            assert at == sorted(at) and hat == sorted(hat, reverse=True)


def test_tasks_with_fewer_than_k_attempts_are_left_out_and_counted() -> None:
    tasks = {"a": [3, 1], "b": [3, 2], "c": [2, 2], "d": [0, 0]}
    estimate = estimate_pass_k(tasks, 3)
    assert estimate == PassK(k=3, pass_at_k=1.0, pass_hat_k=0.0, tasks_used=2, tasks_short=2)
    two = estimate_pass_k(tasks, 2)
    assert (two.tasks_used, two.tasks_short) == (3, 1)
    assert two.pass_at_k == pytest.approx((2 / 3 + 1 + 1) / 3)
    assert two.pass_hat_k == pytest.approx((0 + 1 / 3 + 1) / 3)
    # At k = 1 the mean of the tasks' own rates (not the pooled rate of all attempts).
    one = estimate_pass_k({"a": (3, 1), "b": (1, 1)}, 1)
    assert one.pass_at_k == pytest.approx((1 / 3 + 1) / 2)
    assert one.pass_hat_k == pytest.approx((1 / 3 + 1) / 2)


def test_no_task_with_k_attempts_gives_no_estimate() -> None:
    assert estimate_pass_k({}, 2) == PassK(2, None, None, 0, 0)
    assert estimate_pass_k({"a": (1, 1)}, 2) == PassK(2, None, None, 0, 1)


def test_impossible_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        estimate_pass_k({"a": (3, 1)}, 0)
    with pytest.raises(ValueError, match="task 'a'"):
        estimate_pass_k({"a": (2, 3)}, 1)
    with pytest.raises(ValueError, match="attempts, successes"):
        estimate_pass_k({"a": (2, 1, 0)}, 1)
    with pytest.raises(ValueError, match="fewer than k"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match="successes <= attempts"):
        pass_hat_k(2, -1, 1)


def _enumerated(n: int, c: int, k: int) -> tuple[Fraction, Fraction]:
    """The share of k-subsets of the attempts with at least one success, and with only
    successes, counted one subset at a time."""
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    any_won = sum(any(s) for s in subsets)
    all_won = sum(all(s) for s in subsets)
    return Fraction(any_won, len(subsets)), Fraction(all_won, len(subsets))


def test_random_tasks_agree_with_enumerating_every_subset() -> None:
    rng = random.Random(20240611)
    for _ in range(60):
        k = rng.randint(1, 5)
        tasks: dict[str, tuple[int, int]] = {}
        for i in range(rng.randint(1, 6)):
            n = rng.randint(0, 10)
            tasks[f"t{i}"] = (n, rng.randint(0, n))
        used = {t: nc for t, nc in tasks.items() if nc[0] >= k}
        estimate = estimate_pass_k(tasks, k)
        assert (estimate.tasks_used, estimate.tasks_short) == (len(used), len(tasks) - len(used))
        if not used:
            assert estimate.pass_at_k is None and estimate.pass_hat_k is None
            continue
        pairs = [_enumerated(n, c, k) for n, c in used.values()]
        expected_at = sum(p[0] for p in pairs) / len(pairs)
        expected_hat = sum(p[1] for p in pairs) / len(pairs)
        assert estimate.pass_at_k == pytest.approx(float(expected_at), abs=1e-12)
        assert estimate.pass_hat_k == pytest.approx(float(expected_hat), abs=1e-12)


def test_many_attempts_stay_accurate() -> None:
    # C(64, 32) is about 1.8e18, past a float's exact integers; the ratios are still right.
    n, c, k = 64, 20, 32
    miss = Fraction(math.comb(n - c, k), math.comb(n, k))  # about 1e-8: all k fail
    assert 1 - pass_at_k(n, c, k) == pytest.approx(float(miss), rel=1e-6)
    product = math.prod(1 - k / i for i in range(n - c + 1, n + 1))
    assert pass_at_k(n, c, k) == pytest.approx(1 - product, rel=1e-12)
    n, c = 64, 48
    everything = Fraction(math.comb(c, k), math.comb(n, k))
    assert pass_hat_k(n, c, k) == pytest.approx(float(everything), rel=1e-12)
    assert 0.0 < pass_hat_k(n, c, k) < c / n
    assert pass_at_k(n, c, k) == 1.0  # 16 failures: every 32 attempts hold a success
