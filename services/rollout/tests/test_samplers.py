"""The samplers checked exactly on scripted rollouts: easy, hard, balanced and all-aborted tasks
under Balanced Adaptive Rollout (its default mixed stop rule with random members, and the band
rule with ranked members), fixed-N with zero-variance filtering, and batch refilling."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from orchard.rollout.batches import GroupFilter, fill_batch
from orchard.rollout.results import GroupKey, RolloutResult, RolloutStatus
from orchard.rollout.samplers import (
    BalancedAdaptiveSampler,
    FixedNSampler,
    GroupChoice,
    MemberChoice,
    StopRule,
)

C, T, A = RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED, RolloutStatus.ABORTED
KEY = GroupKey("t1", "builtin:bash")
BAND = {"stop_rule": StopRule.BAND, "member_choice": MemberChoice.RANKED, "stride": 16}
"""The band rule with ranked members in one stride of 16: BAR as it was before the mixed rule."""


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
    group = await BalancedAdaptiveSampler(**BAND).sample(KEY, run)
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
    sampler = BalancedAdaptiveSampler(**{**BAND, "stride": 4})
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
    group = await BalancedAdaptiveSampler(**{**BAND, "stride": 8}).sample(KEY, run)
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
    group = await BalancedAdaptiveSampler(**BAND).sample(KEY, run)
    # The band needs eight scored rollouts; relaxed takes all four and backfills four aborted.
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
    group = await BalancedAdaptiveSampler(**BAND).sample(KEY, run)
    assert group.choice is GroupChoice.BALANCED
    assert group.positive_count == 4
    # 13 positives, 3 negatives: only 5 positives fit, the interval's top.
    outcome = [1] * 13 + [0] * 3
    run = ScriptedRollouts({"t1": [(C, float(o), 10) for o in outcome]})
    group = await BalancedAdaptiveSampler(**BAND).sample(KEY, run)
    assert (group.choice, group.positive_count) == (GroupChoice.BALANCED, 5)
    # The mixed rule aims at the same middle: here it stops after two strides of 8.
    run = ScriptedRollouts({"t1": [(C, float(o), 10) for o in outcome]})
    group = await BalancedAdaptiveSampler().sample(KEY, run)
    assert (group.choice, group.positive_count, len(group.rollouts)) == (GroupChoice.MIXED, 5, 16)


def test_bad_sampler_settings_are_refused() -> None:
    for threshold in (-0.1, 1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"positive_threshold must be a number in \[0, 1\]"):
            BalancedAdaptiveSampler(positive_threshold=threshold)
        with pytest.raises(ValueError, match=r"positive_threshold must be a number in \[0, 1\]"):
            FixedNSampler(positive_threshold=threshold)
    with pytest.raises(ValueError, match="not a valid StopRule"):
        BalancedAdaptiveSampler(stop_rule="sometimes")  # type: ignore[arg-type]
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


# -- BAR as the paper states it: the mixed stop rule, random members, strides below N_max ------


def mixed(outcome: Sequence[int], length: int = 10) -> ScriptedRollouts:
    return ScriptedRollouts({"t1": [(C, float(o), length) for o in outcome]})


async def test_the_default_stops_at_the_first_stride_holding_a_success_and_a_failure() -> None:
    sampler = BalancedAdaptiveSampler()
    assert (sampler.stop_rule, sampler.member_choice) == (StopRule.MIXED, MemberChoice.RANDOM)
    assert (sampler.group_size, sampler.stride, sampler.max_rollouts) == (8, 8, 16)
    # One success among the first 8: the task stops there, far from the band's 3 of each.
    run = mixed([0, 0, 0, 0, 0, 1, 0, 0] + [1] * 8)
    group = await sampler.sample(KEY, run)
    assert group.choice is GroupChoice.MIXED
    assert sorted(run.started) == [("t1", i) for i in range(8)]
    assert (len(group.rollouts), group.positive_count) == (8, 1)
    assert indices(group.members) == list(range(8))
    assert GroupFilter().drop_reason(group) == ""


async def test_a_stride_without_a_mix_runs_another_stride() -> None:
    # The first stride fails every time; the second holds two successes.
    run = mixed([0] * 8 + [0, 1, 0, 0, 1, 0, 0, 0])
    group = await BalancedAdaptiveSampler(seed=1).sample(KEY, run)
    assert group.choice is GroupChoice.MIXED
    assert len(group.rollouts) == 16
    # Both successes and six of the fourteen failures, as close to 4 of 8 as they allow.
    assert group.positive_count == 2
    assert {9, 12} <= set(indices(group.members))
    assert len(group.members) == 8


async def test_strides_below_n_max_cost_only_what_the_task_needs() -> None:
    # Stride 3 of 16: the stop rule is checked after 3, 6 and 9 rollouts; the group needs 8
    # rollouts, so 9 are run although the first stride already held a success and a failure.
    run = mixed([1, 0, 0] + [0] * 13)
    sampler = BalancedAdaptiveSampler(stride=3, seed=7)
    group = await sampler.sample(KEY, run)
    assert group.choice is GroupChoice.MIXED
    assert sorted(run.started) == [("t1", i) for i in range(9)]
    assert (len(group.members), group.positive_count) == (8, 1)
    assert 0 in indices(group.members)
    # The last stride is cut at max_rollouts: strides of 5 run 5, 5, 5 and 1 of 16.
    run = mixed([0] * 15 + [1])
    group = await BalancedAdaptiveSampler(stride=5).sample(KEY, run)
    assert (group.choice, len(group.rollouts)) == (GroupChoice.MIXED, 16)
    assert 15 in indices(group.members)
    # An easy task costs its whole budget in either rule, and gives no signal.
    group = await BalancedAdaptiveSampler(stride=4).sample(KEY, mixed([1] * 16))
    assert (group.choice, len(group.rollouts)) == (GroupChoice.TOP_RANKED, 16)


async def test_random_members_repeat_with_the_seed_and_ranked_ones_are_an_option() -> None:
    outcome = [0, 1] * 8  # 8 successes, 8 failures, all 16 run in one stride
    lengths = [(C, float(o), 100 - i) for i, o in enumerate(outcome)]

    async def draw(**settings: object) -> list[int]:
        sampler = BalancedAdaptiveSampler(stride=16, **settings)  # type: ignore[arg-type]
        group = await sampler.sample(KEY, ScriptedRollouts({"t1": lengths}))
        assert (group.choice, group.positive_count) == (GroupChoice.MIXED, 4)
        return indices(group.members)

    first = await draw(seed=11)
    assert first == await draw(seed=11)  # the same seed, the same members
    assert first == sorted(first)  # random members are listed by index
    draws = {tuple(await draw(seed=s)) for s in range(8)}
    assert len(draws) > 1  # another seed, other members
    # The same seed on another pair draws independently of this one.
    other = await BalancedAdaptiveSampler(stride=16, seed=11).sample(
        GroupKey("t1", "builtin:other"), ScriptedRollouts({"t1": lengths})
    )
    assert len(other.members) == 8
    # Ranked: the shortest completed successes and failures.
    ranked = await draw(member_choice=MemberChoice.RANKED)
    assert sorted(ranked) == [8, 9, 10, 11, 12, 13, 14, 15]


async def test_the_mixed_rule_backfills_with_aborted_rollouts() -> None:
    script: list[tuple[RolloutStatus, float | None, int]] = [(A, None, 0)] * 16
    script[0], script[5], script[7] = (C, 1.0, 30), (C, 1.0, 20), (C, 0.0, 40)
    run = ScriptedRollouts({"t1": script})
    group = await BalancedAdaptiveSampler().sample(KEY, run)
    # The first stride holds a success and a failure and fills a group of 8.
    assert group.choice is GroupChoice.MIXED
    assert len(group.rollouts) == 8
    assert indices(group.members)[:3] == [0, 5, 7]
    assert group.scored_count == 3
    assert group.positive_fraction == pytest.approx(2 / 3)


async def test_a_reward_exactly_at_the_threshold_is_a_positive_in_every_sampler() -> None:
    script = [(C, 0.75, 10), (C, 0.7499, 10), (C, 0.75, 10), (C, 0.7499, 10)]
    run = ScriptedRollouts({"t1": script})
    group = await FixedNSampler(group_size=4, positive_threshold=0.75).sample(KEY, run)
    assert (group.positive_count, group.positive_fraction) == (2, 0.5)
    bar = BalancedAdaptiveSampler(group_size=2, max_rollouts=4, stride=2, positive_threshold=0.75)
    group = await bar.sample(KEY, ScriptedRollouts({"t1": script}))
    assert (group.choice, group.positive_count, len(group.rollouts)) == (GroupChoice.MIXED, 1, 2)
    # At the default threshold (0.5) both rewards are successes: no mix, no signal.
    group = await BalancedAdaptiveSampler(group_size=2, max_rollouts=4, stride=2).sample(
        KEY, ScriptedRollouts({"t1": script})
    )
    assert (group.choice, group.positive_count) == (GroupChoice.TOP_RANKED, 2)
