"""The samplers checked exactly on scripted rollouts: easy, hard, balanced and all-aborted tasks
under Balanced Adaptive Rollout, fixed-N with zero-variance filtering, and batch refilling."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from orchard.rollout.batches import GroupFilter, fill_batch
from orchard.rollout.results import GroupKey, RolloutResult, RolloutStatus
from orchard.rollout.samplers import BalancedAdaptiveSampler, FixedNSampler, GroupChoice

C, T, A = RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED, RolloutStatus.ABORTED
KEY = GroupKey("t1", "builtin:bash")


class ScriptedRollouts:
    """Rollout i of a pair ends as script[i] = (status, reward, length); records every call."""

    def __init__(self, scripts: dict[str, Sequence[tuple[RolloutStatus, float | None, int]]]):
        self.scripts = scripts
        self.started: list[tuple[str, int]] = []

    async def __call__(self, key: GroupKey, index: int) -> RolloutResult:
        self.started.append((key.task_id, index))
        await asyncio.sleep(0.001 * ((index * 7) % 3))  # finish out of start order
        status, reward, length = self.scripts[key.task_id][index]
        return RolloutResult(
            key, index, status, reward, length, rollout_id=f"{key.task_id}-{index}"
        )


def indices(results: Sequence[RolloutResult]) -> list[int]:
    return [r.index for r in results]


def repeat(
    entry: tuple[RolloutStatus, float | None, int], n: int = 16
) -> list[tuple[RolloutStatus, float | None, int]]:
    return [entry] * n


async def test_easy_task_uses_the_whole_budget_and_falls_back_to_the_top_ranked() -> None:
    # Every rollout passes; lengths differ so the ranking is visible; two are truncated.
    script = [(C, 1.0, 100 - i) for i in range(16)]
    script[15] = (T, 1.0, 1)
    script[14] = (T, 1.0, 2)
    run = ScriptedRollouts({"t1": script})
    group = await BalancedAdaptiveSampler().sample(KEY, run)
    assert group.choice is GroupChoice.TOP_RANKED
    assert len(group.rollouts) == 16
    # Completed before truncated, shorter first: indices 13, 12, ... 6.
    assert indices(group.members) == [13, 12, 11, 10, 9, 8, 7, 6]
    assert group.positive_fraction == 1.0
    assert GroupFilter().drop_reason(group) == "every scored member has reward 1: no variance"


async def test_hard_task_gives_a_zero_group_that_the_filter_drops() -> None:
    run = ScriptedRollouts({"t1": [(C, 0.0, 10 + i) for i in range(16)]})
    group = await BalancedAdaptiveSampler().sample(KEY, run)
    assert group.choice is GroupChoice.TOP_RANKED
    assert indices(group.members) == list(range(8))
    assert group.positive_count == 0
    assert "no variance" in GroupFilter().drop_reason(group)


async def test_balanced_task_takes_four_and_four_shortest_completed_first() -> None:
    # Even indices pass, odd fail; length falls with the index; 14 (a positive) is truncated.
    script: list[tuple[RolloutStatus, float | None, int]] = [
        (C, 1.0 if i % 2 == 0 else 0.0, 100 - i) for i in range(16)
    ]
    script[14] = (T, 1.0, 1)
    run = ScriptedRollouts({"t1": script})
    group = await BalancedAdaptiveSampler().sample(KEY, run)
    assert group.choice is GroupChoice.BALANCED
    assert group.positive_count == 4
    positives = [m.index for m in group.members if m.reward == 1.0]
    negatives = [m.index for m in group.members if m.reward == 0.0]
    assert positives == [12, 10, 8, 6]  # 14 is truncated, so it ranks after every completed one
    assert sorted(negatives, reverse=True) == [15, 13, 11, 9]
    assert GroupFilter().drop_reason(group) == ""


async def test_strides_stop_early_when_a_balanced_group_can_be_assembled() -> None:
    # Stride 4: after 4 rollouts only one positive; after 8, three of eight (0.375) suffice.
    outcome = [0, 0, 1, 0, 0, 1, 1, 0] + [1] * 8
    run = ScriptedRollouts({"t1": [(C, float(o), 10) for o in outcome]})
    sampler = BalancedAdaptiveSampler(stride=4)
    group = await sampler.sample(KEY, run)
    assert group.choice is GroupChoice.BALANCED
    assert len(group.rollouts) == 8
    assert sorted(run.started) == [("t1", i) for i in range(8)]
    assert group.positive_count == 3
    assert indices(group.members) == list(range(8))


async def test_few_positives_fall_back_to_the_relaxed_interval_with_every_positive() -> None:
    outcome = [0] * 16
    outcome[3] = outcome[11] = 1  # 2 of 16: 2/8 = 0.25 < 0.375
    run = ScriptedRollouts({"t1": [(C, float(o), 50) for o in outcome]})
    group = await BalancedAdaptiveSampler(stride=8).sample(KEY, run)
    assert group.choice is GroupChoice.RELAXED
    assert len(group.rollouts) == 16
    assert indices(group.members) == [0, 1, 2, 3, 4, 5, 6, 11]
    assert group.positive_count == 2


async def test_aborted_rollouts_enter_only_as_backfill() -> None:
    # Two scored positives, two scored negatives, twelve aborted.
    script: list[tuple[RolloutStatus, float | None, int]] = [(A, None, 0)] * 16
    script[0], script[5] = (C, 1.0, 30), (C, 1.0, 20)
    script[7], script[9] = (C, 0.0, 40), (T, 0.0, 5)
    run = ScriptedRollouts({"t1": script})
    group = await BalancedAdaptiveSampler().sample(KEY, run)
    # Strict needs eight scored rollouts; relaxed takes all four and backfills four aborted.
    assert group.choice is GroupChoice.RELAXED
    assert indices(group.members) == [5, 0, 7, 9, 1, 2, 3, 4]
    assert group.scored_count == 4
    assert group.positive_fraction == 0.5
    assert GroupFilter().drop_reason(group) == ""


async def test_an_all_aborted_task_returns_aborted_members_that_the_filter_drops() -> None:
    run = ScriptedRollouts({"t1": repeat((A, None, 0))})
    group = await BalancedAdaptiveSampler().sample(KEY, run)
    assert group.choice is GroupChoice.TOP_RANKED
    assert indices(group.members) == list(range(8))
    assert group.scored_count == 0
    assert group.positive_fraction == 0.0
    assert GroupFilter().drop_reason(group) == "0 of 8 members scored, fewer than 2"


async def test_the_positive_count_closest_to_the_middle_of_the_interval_wins() -> None:
    # 12 positives and 4 negatives: 4 negatives allow 4..8 positives; the interval allows 3..5
    # positives of 8; the middle is 4.
    outcome = [1] * 12 + [0] * 4
    run = ScriptedRollouts({"t1": [(C, float(o), 10) for o in outcome]})
    group = await BalancedAdaptiveSampler().sample(KEY, run)
    assert group.choice is GroupChoice.BALANCED
    assert group.positive_count == 4
    # 13 positives, 3 negatives: only 5 positives fit, the interval's top.
    outcome = [1] * 13 + [0] * 3
    run = ScriptedRollouts({"t1": [(C, float(o), 10) for o in outcome]})
    group = await BalancedAdaptiveSampler().sample(KEY, run)
    assert (group.choice, group.positive_count) == (GroupChoice.BALANCED, 5)


def test_bad_sampler_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="at least group_size"):
        BalancedAdaptiveSampler(group_size=8, max_rollouts=4)
    with pytest.raises(ValueError, match="rho_min <= rho_max"):
        BalancedAdaptiveSampler(rho_min=0.7, rho_max=0.3)
    with pytest.raises(ValueError, match="stride"):
        BalancedAdaptiveSampler(stride=0)
    with pytest.raises(ValueError, match="group_size"):
        FixedNSampler(group_size=0)
    with pytest.raises(ValueError, match="no reward"):
        RolloutResult(KEY, 0, A, 1.0, 0)
    with pytest.raises(ValueError, match="no reward"):
        RolloutResult(KEY, 0, C, None, 0)


async def test_fixed_n_with_filtering_resamples_until_the_batch_is_full() -> None:
    run = ScriptedRollouts(
        {
            "easy": [(C, 1.0, 5)] * 4,
            "hard": [(C, 0.0, 5)] * 4,
            "mixed": [(C, 1.0, 5), (C, 0.0, 5), (C, 0.0, 5), (T, 0.0, 9)],
            "mixed2": [(C, 0.0, 5), (A, None, 0), (C, 1.0, 5), (C, 1.0, 5)],
            "unused": [(C, 1.0, 5), (C, 0.0, 5)] * 2,
        }
    )
    pairs = [GroupKey(t, "h") for t in ("easy", "hard", "mixed", "mixed2", "unused")]
    batch = await fill_batch(pairs, FixedNSampler(group_size=4), run, batch_size=2)
    assert [g.key.task_id for g in batch.kept] == ["mixed", "mixed2"]
    assert [(d.group.key.task_id, "no variance" in d.reason) for d in batch.dropped] == [
        ("easy", True),
        ("hard", True),
    ]
    assert batch.rollouts_run == 16
    assert "unused" not in {task for task, _ in run.started}
    assert batch.kept[1].positive_fraction == pytest.approx(2 / 3)


async def test_a_batch_with_parallel_pairs_keeps_the_surplus_and_runs_out_short() -> None:
    script = [(C, 1.0, 5), (C, 0.0, 5)]
    run = ScriptedRollouts({f"t{i}": script for i in range(3)})
    pairs = [GroupKey(f"t{i}", "h") for i in range(3)]
    batch = await fill_batch(
        pairs, FixedNSampler(group_size=2), run, batch_size=1, parallel_pairs=3
    )
    assert len(batch.kept) == 1
    assert len(batch.surplus) == 2
    assert {g.key.task_id for g in [*batch.kept, *batch.surplus]} == {"t0", "t1", "t2"}
    short = await fill_batch(pairs[:1], FixedNSampler(group_size=2), run, batch_size=5)
    assert len(short.kept) == 1
    with pytest.raises(ValueError, match="at least 1"):
        await fill_batch(pairs, FixedNSampler(), run, batch_size=0)


async def test_a_runner_answering_for_the_wrong_rollout_is_refused() -> None:
    async def wrong(key: GroupKey, index: int) -> RolloutResult:
        return RolloutResult(key, index + 1, C, 1.0, 1)

    with pytest.raises(ValueError, match="when asked for"):
        await FixedNSampler(group_size=2).sample(KEY, wrong)
