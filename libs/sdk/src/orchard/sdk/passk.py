"""pass@k and pass^k: how a model does with k attempts at a task, from n >= k attempts.

With n scored attempts at a task, c of them successes, the unbiased estimators over the
C(n, k) ways to pick k of the n attempts are

- pass@k = 1 - C(n - c, k) / C(n, k): at least one of the k succeeds (Chen et al. 2021,
  "Evaluating Large Language Models Trained on Code");
- pass^k = C(c, k) / C(n, k): all k succeed (Yao et al. 2024, tau-bench), a measure of how
  reliably the model solves a task it can solve.

Both are averaged over tasks. A task with fewer than k scored attempts has no estimate: it is
left out and counted. At k = 1 both are the task's success rate c / n, and per task
pass^k <= c / n <= pass@k. ``math.comb`` is exact and Python's division of two integers is
correctly rounded, so the ratios are accurate for any n.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["PassK", "estimate_pass_k", "pass_at_k", "pass_hat_k"]


def _check(n: int, c: int, k: int) -> None:
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= successes <= attempts, got {c} of {n}")
    if n < k:
        raise ValueError(f"{n} attempts are fewer than k = {k}: no unbiased estimate")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k attempts, drawn without replacement from n attempts
    with c successes, succeeds; needs n >= k."""
    _check(n, c, k)
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """The chance that all k attempts, drawn without replacement from n attempts with c
    successes, succeed; needs n >= k."""
    _check(n, c, k)
    return math.comb(c, k) / math.comb(n, k)


@dataclass(frozen=True, slots=True)
class PassK:
    """pass@k and pass^k of one set of tasks."""

    k: int
    pass_at_k: float | None
    """Mean over the tasks used; None when no task had k scored attempts."""
    pass_hat_k: float | None
    """Mean over the tasks used; None when no task had k scored attempts."""
    tasks_used: int
    """Tasks with at least k scored attempts."""
    tasks_short: int
    """Tasks with fewer than k scored attempts (some excluded), left out of both means."""


def estimate_pass_k(tasks: Mapping[str, Sequence[int]], k: int) -> PassK:
    """pass@k and pass^k over ``tasks``, task id to ``(n, c)``: its scored attempts and
    successes (the evaluate stage's ``by_harness[...]["tasks"]``)."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    at_k: list[float] = []
    hat_k: list[float] = []
    short = 0
    for task, counts in tasks.items():
        if len(counts) != 2:
            raise ValueError(f"task {task!r}: expected (attempts, successes), got {counts!r}")
        n, c = int(counts[0]), int(counts[1])
        if not 0 <= c <= n:
            raise ValueError(f"task {task!r}: need 0 <= successes <= attempts, got {c} of {n}")
        if n < k:
            short += 1
            continue
        at_k.append(pass_at_k(n, c, k))
        hat_k.append(pass_hat_k(n, c, k))
    if not at_k:
        return PassK(k, None, None, 0, short)
    used = len(at_k)
    return PassK(k, math.fsum(at_k) / used, math.fsum(hat_k) / used, used, short)
