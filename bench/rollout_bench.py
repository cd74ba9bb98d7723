"""Benchmark the rollout samplers: Balanced Adaptive Rollout against fixed-N with filtering.

    .venv/bin/python bench/rollout_bench.py [--budget 16000] [--seeds 3]

Every sampler gets the same trajectory budget and the same stream of simulated tasks (common
random numbers: rollout i of task t ends the same way under every sampler). Task pass rates
follow the U-shaped spread agent training sets show: many tasks the policy never solves, some it
always solves, the rest spread out and skewed hard. A few rollouts abort (infrastructure) and a
share of the failures are truncated by a budget.

Reported per sampler: usable groups (kept by the group filter) per 1,000 trajectories, the mean
positive fraction of kept groups, and the advantage mass per 1,000 trajectories — the sum over
kept groups of |reward - group mean|, the signal a group-relative gradient gets (it is largest
for balanced groups) — balanced groups (positive fraction in [0.375, 0.625]) per 1,000
trajectories, and usable groups per 100 tasks drawn (what a finite task set yields).
Writes bench/results/rollout.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from orchard.rollout.batches import GroupFilter
from orchard.rollout.results import GroupKey, RolloutResult, RolloutStatus
from orchard.rollout.samplers import BalancedAdaptiveSampler, FixedNSampler, Sampler

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "rollout.json"

NEVER_SOLVED = 0.30
"""Share of tasks with pass rate 0."""
ALWAYS_SOLVED = 0.15
"""Share of tasks with pass rate in [0.9, 1]."""
ABORT_RATE = 0.03
TRUNCATED_SHARE_OF_FAILURES = 0.3
BALANCED = (0.375, 0.625)
"""A kept group counts as balanced when its positive fraction lies here (BAR's interval)."""


@dataclass(frozen=True, slots=True)
class SimulatedTask:
    task_id: str
    pass_rate: float


def task_stream(seed: int) -> list[SimulatedTask]:
    rng = random.Random(f"tasks-{seed}")
    tasks = []
    for i in range(20_000):
        u = rng.random()
        if u < NEVER_SOLVED:
            p = 0.0
        elif u < NEVER_SOLVED + ALWAYS_SOLVED:
            p = rng.uniform(0.9, 1.0)
        else:
            p = rng.betavariate(0.6, 0.9)
        tasks.append(SimulatedTask(f"s{seed}-t{i}", p))
    return tasks


class SimulatedRollouts:
    """Ends rollout i of a task from a generator seeded by (task, i): the same for every
    sampler."""

    def __init__(self, tasks: list[SimulatedTask]) -> None:
        self.pass_rate = {t.task_id: t.pass_rate for t in tasks}
        self.run_count = 0

    async def __call__(self, key: GroupKey, index: int) -> RolloutResult:
        self.run_count += 1
        rng = random.Random(f"{key.task_id}-{index}")
        length = int(rng.lognormvariate(7.0, 0.5))
        if rng.random() < ABORT_RATE:
            return RolloutResult(key, index, RolloutStatus.ABORTED, None, length)
        if rng.random() < self.pass_rate[key.task_id]:
            return RolloutResult(key, index, RolloutStatus.COMPLETED, 1.0, length)
        if rng.random() < TRUNCATED_SHARE_OF_FAILURES:
            return RolloutResult(key, index, RolloutStatus.TRUNCATED, 0.0, length * 2)
        return RolloutResult(key, index, RolloutStatus.COMPLETED, 0.0, length)


@dataclass(frozen=True, slots=True)
class SamplerScore:
    sampler: str
    settings: dict[str, Any]
    trajectories: int
    tasks: int
    kept_groups: int
    usable_groups_per_1000: float
    mean_positive_fraction_kept: float
    advantage_mass_per_1000: float
    balanced_groups_per_1000: float
    usable_groups_per_100_tasks: float


async def score(name: str, sampler: Sampler, budget: int, seed: int) -> SamplerScore:
    tasks = task_stream(seed)
    run = SimulatedRollouts(tasks)
    keep = GroupFilter()
    kept_fractions: list[float] = []
    mass = 0.0
    used_tasks = 0
    balanced = 0
    for task in tasks:
        if run.run_count >= budget:
            break
        used_tasks += 1
        group = await sampler.sample(GroupKey(task.task_id, "simulated"), run)
        if keep.drop_reason(group):
            continue
        rewards = [m.reward for m in group.members if m.reward is not None]
        mean = statistics.fmean(rewards)
        mass += sum(abs(r - mean) for r in rewards)
        kept_fractions.append(group.positive_fraction)
        if BALANCED[0] - 1e-9 <= group.positive_fraction <= BALANCED[1] + 1e-9:
            balanced += 1
    used = run.run_count
    settings = {k: v for k, v in asdict(sampler).items() if k != "name"}  # type: ignore[call-overload]
    return SamplerScore(
        sampler=name,
        settings=settings,
        trajectories=used,
        tasks=used_tasks,
        kept_groups=len(kept_fractions),
        usable_groups_per_1000=1000 * len(kept_fractions) / used,
        mean_positive_fraction_kept=statistics.fmean(kept_fractions) if kept_fractions else 0.0,
        advantage_mass_per_1000=1000 * mass / used,
        balanced_groups_per_1000=1000 * balanced / used,
        usable_groups_per_100_tasks=100 * len(kept_fractions) / used_tasks,
    )


def average(scores: list[SamplerScore]) -> dict[str, Any]:
    first = scores[0]
    return {
        "sampler": first.sampler,
        "settings": first.settings,
        "trajectories": sum(s.trajectories for s in scores),
        "tasks": sum(s.tasks for s in scores),
        "kept_groups": sum(s.kept_groups for s in scores),
        "usable_groups_per_1000": statistics.fmean(s.usable_groups_per_1000 for s in scores),
        "mean_positive_fraction_kept": statistics.fmean(
            s.mean_positive_fraction_kept for s in scores
        ),
        "advantage_mass_per_1000": statistics.fmean(s.advantage_mass_per_1000 for s in scores),
        "balanced_groups_per_1000": statistics.fmean(s.balanced_groups_per_1000 for s in scores),
        "usable_groups_per_100_tasks": statistics.fmean(
            s.usable_groups_per_100_tasks for s in scores
        ),
    }


SAMPLERS: list[tuple[str, Sampler]] = [
    ("fixed_n N=8 + filter (baseline)", FixedNSampler(group_size=8)),
    ("bar defaults (N=8 Nmax=16 s=16)", BalancedAdaptiveSampler()),
    ("bar s=8", BalancedAdaptiveSampler(stride=8)),
    ("bar s=4", BalancedAdaptiveSampler(stride=4)),
]


async def sampler_comparison(budget: int, seeds: int) -> list[dict[str, Any]]:
    rows = []
    for name, sampler in SAMPLERS:
        scores = [await score(name, sampler, budget, seed) for seed in range(seeds)]
        rows.append(average(scores))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=16_000, help="trajectories per sampler")
    parser.add_argument("--seeds", type=int, default=3, help="task streams averaged")
    args = parser.parse_args(argv)

    rows = asyncio.run(sampler_comparison(args.budget, args.seeds))
    baseline = rows[0]
    for row in rows:
        row["advantage_mass_vs_baseline"] = (
            row["advantage_mass_per_1000"] / baseline["advantage_mass_per_1000"]
        )
        row["usable_groups_vs_baseline"] = (
            row["usable_groups_per_1000"] / baseline["usable_groups_per_1000"]
        )
    result = {
        "benchmark": "rollout",
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "samplers": {
            "budget_trajectories_per_seed": args.budget,
            "seeds": args.seeds,
            "task_spread": {
                "never_solved": NEVER_SOLVED,
                "always_solved": ALWAYS_SOLVED,
                "others": "pass rate ~ Beta(0.6, 0.9)",
                "abort_rate": ABORT_RATE,
                "truncated_share_of_failures": TRUNCATED_SHARE_OF_FAILURES,
            },
            "rows": rows,
        },
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")

    print(f"Samplers at equal budget ({args.budget} trajectories x {args.seeds} task streams)")
    header = (
        f"  {'sampler':<34} {'groups/1k':>9} {'x base':>7} {'pos.frac':>8} "
        f"{'adv.mass/1k':>11} {'x base':>7} {'bal./1k':>7} {'groups/100 tasks':>16}"
    )
    print(header)
    for row in rows:
        print(
            f"  {row['sampler']:<34} {row['usable_groups_per_1000']:>9.1f} "
            f"{row['usable_groups_vs_baseline']:>7.2f} {row['mean_positive_fraction_kept']:>8.3f} "
            f"{row['advantage_mass_per_1000']:>11.1f} {row['advantage_mass_vs_baseline']:>7.2f} "
            f"{row['balanced_groups_per_1000']:>7.1f} {row['usable_groups_per_100_tasks']:>16.1f}"
        )
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
