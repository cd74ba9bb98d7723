"""Loss masks and samples cut from hand-built trajectories, checked token by token."""

from __future__ import annotations

import pytest
import torch

from orchard.trainer.batch import collate
from orchard.trainer.masks import (
    DEFAULT_SUCCESS_THRESHOLD,
    Overflow,
    Sample,
    SampleConfig,
    Skip,
    SkipReason,
    TrajectoryError,
    build_rl_samples,
    build_sft_samples,
    loss_positions,
    rl_sample,
    sft_samples,
)

F, T = False, True


def only_sample(results: list[Sample | Skip]) -> Sample:
    assert len(results) == 1
    (result,) = results
    assert isinstance(result, Sample), result
    return result


def test_successful_trajectory_trains_on_policy_outputs_only(build):
    t = build(
        [
            build.Turn(inputs=[1, 2, 3], outputs=[4, 5]),
            build.Turn(inputs=[6], outputs=[7, 8, 9], loss_mask=[T, F, T]),
        ],
        reward=1.0,
    )
    s = only_sample(sft_samples(t))
    assert s.token_ids == (1, 2, 3, 4, 5, 6, 7, 8, 9)
    assert s.loss_mask == (F, F, F, T, T, F, T, F, T)
    assert s.rollout_logprobs == pytest.approx((0, 0, 0, -0.1, -0.2, 0, -0.1, -0.2, -0.3))
    assert s.truncated == 0


def test_auxiliary_turn_stays_in_context_but_out_of_the_loss(build):
    t = build(
        [
            build.Turn(inputs=[1, 2], outputs=[3]),
            build.Turn(inputs=[4], outputs=[5, 6], auxiliary=True),
            build.Turn(inputs=[7], outputs=[8]),
        ]
    )
    for s in (only_sample(sft_samples(t)), rl_sample(t)):
        assert isinstance(s, Sample)
        assert s.token_ids == (1, 2, 3, 4, 5, 6, 7, 8)
        assert loss_positions(s) == [2, 7]


def test_failed_trajectory_trains_only_inside_inclusive_rise_segments(build):
    turns = [build.Turn(inputs=[10 * k + 1], outputs=[10 * k + 2, 10 * k + 3]) for k in range(4)]
    # Turns 1..2 (inclusive) rose; turn 0 and 3 did not.
    t = build(turns, reward=0.0, rise=[(1, 2)])
    s = only_sample(sft_samples(t))
    assert s.token_ids == (1, 2, 3, 11, 12, 13, 21, 22, 23, 31, 32, 33)
    assert s.loss_mask == (F, F, F, F, T, T, F, T, T, F, F, F)
    # Two one-turn segments: turn 0 and turn 3.
    s = only_sample(sft_samples(build(turns, reward=0.0, rise=[(0, 0), (3, 3)])))
    assert loss_positions(s) == [1, 2, 10, 11]


def test_rise_segment_does_not_override_auxiliary_or_output_mask(build):
    t = build(
        [
            build.Turn(inputs=[1], outputs=[2, 3], loss_mask=[F, T]),
            build.Turn(inputs=[4], outputs=[5], auxiliary=True),
        ],
        reward=0.0,
        rise=[(0, 1)],
    )
    assert loss_positions(only_sample(sft_samples(t))) == [2]


def test_success_threshold_decides_which_masks_apply(build):
    turns = [build.Turn(inputs=[1], outputs=[2]), build.Turn(inputs=[3], outputs=[4])]
    t = build(turns, reward=0.5, rise=[(1, 1)])
    # The default threshold is 0.5, and a reward exactly at it is a success: every turn trains.
    assert SampleConfig().success_threshold == DEFAULT_SUCCESS_THRESHOLD == 0.5
    assert loss_positions(only_sample(sft_samples(t))) == [1, 3]
    strict = SampleConfig(success_threshold=0.9)
    assert loss_positions(only_sample(sft_samples(t, strict))) == [3]
    # Just below the threshold: failed, so only the rise segment trains.
    below = build(turns, reward=0.49, rise=[(1, 1)])
    assert loss_positions(only_sample(sft_samples(below))) == [3]
    # A reward of 0.3 no longer trains on every turn (the old default was "above 0").
    partial = build(turns, reward=0.3)
    assert sft_samples(partial) == [Skip("t0", SkipReason.NO_LOSS_TOKENS)]


@pytest.mark.parametrize("threshold", [-0.01, 1.01, float("nan"), float("inf")])
def test_a_success_threshold_outside_0_1_is_refused(threshold):
    with pytest.raises(ValueError, match=r"success_threshold must be a number in \[0, 1\]"):
        SampleConfig(success_threshold=threshold)


def test_failed_trajectory_without_rise_segments_gives_no_sft_sample(build):
    t = build([build.Turn(inputs=[1], outputs=[2])], reward=0.0)
    assert sft_samples(t) == [Skip("t0", SkipReason.NO_LOSS_TOKENS)]
    # RL trains on it anyway: the advantage carries the sign.
    s = rl_sample(t)
    assert isinstance(s, Sample)
    assert loss_positions(s) == [1]


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"excluded": True}, SkipReason.EXCLUDED),
        ({"reward": None}, SkipReason.UNSCORED),
        ({"aborted": True}, SkipReason.ABORTED),
    ],
)
def test_untrainable_rewards_never_produce_a_sample(build, kwargs, reason):
    t = build([build.Turn(inputs=[1], outputs=[2])], **kwargs)
    assert sft_samples(t) == [Skip("t0", reason)]
    assert sft_samples(t, SampleConfig(per_turn=True)) == [Skip("t0", reason)]
    assert rl_sample(t) == Skip("t0", reason)


def test_left_truncation_keeps_the_last_tokens_and_their_masks(build):
    t = build(
        [build.Turn(inputs=[1, 2, 3], outputs=[4, 5]), build.Turn(inputs=[6], outputs=[7, 8])]
    )
    s = only_sample(sft_samples(t, SampleConfig(context_window=5)))
    assert s.token_ids == (4, 5, 6, 7, 8)
    assert s.loss_mask == (T, T, F, T, T)
    assert s.rollout_logprobs == pytest.approx((-0.1, -0.2, 0.0, -0.1, -0.2))
    assert s.truncated == 3


def test_truncation_that_leaves_no_target_skips_the_sample(build):
    t = build([build.Turn(inputs=[1], outputs=[2, 3]), build.Turn(inputs=[4, 5, 6], outputs=[])])
    # Window [3, 4, 5, 6]: token 3 is first, so it cannot be a target; nothing else counts.
    assert sft_samples(t, SampleConfig(context_window=4)) == [Skip("t0", SkipReason.NO_LOSS_TOKENS)]


def test_drop_policy_leaves_long_samples_out(build):
    t = build([build.Turn(inputs=[1, 2, 3], outputs=[4, 5])])
    config = SampleConfig(context_window=4, overflow=Overflow.DROP)
    assert sft_samples(t, config) == [Skip("t0", SkipReason.TOO_LONG)]
    assert only_sample(sft_samples(t, SampleConfig(context_window=5, overflow=Overflow.DROP)))


def test_per_turn_samples_train_one_turn_each_with_earlier_context(build):
    t = build(
        [
            build.Turn(inputs=[1], outputs=[2]),
            build.Turn(inputs=[3], outputs=[4], auxiliary=True),
            build.Turn(inputs=[5], outputs=[6, 7]),
            build.Turn(inputs=[8], outputs=[9]),
        ],
        reward=0.0,
        rise=[(1, 2)],
    )
    results = sft_samples(t, SampleConfig(per_turn=True))
    # Only turn 2: turn 1 is auxiliary, turns 0 and 3 are outside the rise segment.
    s = only_sample(results)
    assert s.token_ids == (1, 2, 3, 4, 5, 6, 7)
    assert loss_positions(s) == [5, 6]

    ok = build([build.Turn(inputs=[1], outputs=[2]), build.Turn(inputs=[3], outputs=[4])])
    samples = sft_samples(ok, SampleConfig(per_turn=True))
    assert [(r.token_ids, loss_positions(r)) for r in samples if isinstance(r, Sample)] == [
        ((1, 2), [1]),
        ((1, 2, 3, 4), [3]),
    ]


def test_dataset_builders_count_skips_by_reason(build):
    turn = build.Turn(inputs=[1], outputs=[2])
    trajectories = [
        build([turn], trajectory_id="ok"),
        build([turn], trajectory_id="fail", reward=0.0),
        build([turn], trajectory_id="ex1", excluded=True),
        build([turn], trajectory_id="ex2", excluded=True),
    ]
    sft = build_sft_samples(trajectories)
    assert [s.trajectory_id for s in sft.samples] == ["ok"]
    assert sft.skipped == {SkipReason.NO_LOSS_TOKENS: 1, SkipReason.EXCLUDED: 2}
    rl = build_rl_samples(trajectories)
    assert [s.trajectory_id for s in rl.samples] == ["ok", "fail"]
    assert rl.skipped == {SkipReason.EXCLUDED: 2}


def test_malformed_trajectories_are_refused_with_the_field_named(build):
    t = build([build.Turn(inputs=[1], outputs=[2, 3])], reward=0.0, rise=[(0, 1)])
    with pytest.raises(TrajectoryError, match=r"rise_segments\[0\] is \[0, 1\].*1 turns"):
        sft_samples(t)
    t = build([build.Turn(inputs=[1], outputs=[2, 3], loss_mask=[T])])
    with pytest.raises(TrajectoryError, match="1 output_loss_mask entries for 2 output tokens"):
        sft_samples(t)
    t = build([build.Turn(inputs=[1], outputs=[2, 3], logprobs=[-1.0])])
    with pytest.raises(TrajectoryError, match="1 output_logprobs for 2 output tokens"):
        rl_sample(t)
    t = build([build.Turn(inputs=[1], outputs=[2])])
    t.turns[0].index = 3
    with pytest.raises(TrajectoryError, match="position 0 has index 3"):
        sft_samples(t)
    with pytest.raises(ValueError, match="context_window must be at least 2"):
        SampleConfig(context_window=1)


def test_collate_shifts_targets_and_masks_and_pads_right(build):
    a = only_sample(
        sft_samples(build([build.Turn(inputs=[1, 2], outputs=[3, 4], logprobs=[-0.5, -0.25])]))
    )
    b = only_sample(sft_samples(build([build.Turn(inputs=[7], outputs=[8])])))
    batch = collate([a, b], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3], [7, 0, 0]]
    assert batch.targets.tolist() == [[2, 3, 4], [8, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.loss_mask.tolist() == [[F, T, T], [T, F, F]]
    assert torch.allclose(
        batch.rollout_logprobs, torch.tensor([[0.0, -0.5, -0.25], [-0.1, 0.0, 0.0]])
    )


def test_per_turn_samples_mask_exactly_their_own_turn_and_name_it(build):
    t = build(
        [
            build.Turn(inputs=[1, 2], outputs=[3, 4]),
            build.Turn(inputs=[5], outputs=[6, 7, 8], loss_mask=[T, F, T]),
            build.Turn(inputs=[9], outputs=[10], auxiliary=True),
            build.Turn(inputs=[11, 12], outputs=[13, 14]),
        ]
    )
    samples = [r for r in sft_samples(t, SampleConfig(per_turn=True)) if isinstance(r, Sample)]
    assert [s.turn for s in samples] == [0, 1, 3]
    assert [s.loss_mask for s in samples] == [
        (F, F, T, T),
        (F, F, F, F, F, T, F, T),
        (F, F, F, F, F, F, F, F, F, F, F, F, T, T),
    ]
    # Earlier outputs are context only; each sample ends with its own turn.
    assert samples[2].token_ids == tuple(range(1, 15))
    assert samples[1].rollout_logprobs == pytest.approx(
        (0.0, 0.0, -0.1, -0.2, 0.0, -0.1, -0.2, -0.3)
    )
    whole = only_sample(sft_samples(t))
    assert whole.turn is None
    assert loss_positions(whole) == [2, 3, 5, 7, 12, 13]


def test_per_turn_samples_are_left_truncated_each_to_the_window(build):
    t = build(
        [
            build.Turn(inputs=[1, 2, 3], outputs=[4, 5]),
            build.Turn(inputs=[6, 7], outputs=[8, 9, 10]),
        ]
    )
    first, second = sft_samples(t, SampleConfig(per_turn=True, context_window=4))
    assert isinstance(first, Sample) and isinstance(second, Sample)
    assert (first.token_ids, first.loss_mask, first.truncated) == ((2, 3, 4, 5), (F, F, T, T), 1)
    assert (second.token_ids, second.loss_mask, second.truncated) == (
        (7, 8, 9, 10),
        (F, T, T, T),
        6,
    )
    # Dropping instead: the first turn (5 tokens) and the second (10) are both over 4.
    dropped = sft_samples(t, SampleConfig(per_turn=True, context_window=6, overflow="drop"))
    assert isinstance(dropped[0], Sample) and dropped[0].token_ids == (1, 2, 3, 4, 5)
    assert dropped[1] == Skip("t0", SkipReason.TOO_LONG)


def test_drop_over_leaves_far_too_long_samples_out_and_truncates_the_rest(build):
    short = build([build.Turn(inputs=[1, 2], outputs=[3, 4])], trajectory_id="short")
    near = build([build.Turn(inputs=[1, 2, 3], outputs=[4, 5, 6])], trajectory_id="near")
    far = build([build.Turn(inputs=list(range(1, 9)), outputs=[9, 10])], trajectory_id="far")
    config = SampleConfig(context_window=4, drop_over=6)
    built = build_sft_samples([short, near, far], config)
    assert [(s.trajectory_id, s.token_ids, s.truncated) for s in built.samples] == [
        ("short", (1, 2, 3, 4), 0),
        ("near", (3, 4, 5, 6), 2),
    ]
    assert built.skipped == {SkipReason.TOO_LONG: 1}
    # Without a window the limit alone decides; RL samples obey it too.
    assert rl_sample(far, SampleConfig(drop_over=9)) == Skip("far", SkipReason.TOO_LONG)
    assert isinstance(rl_sample(far, SampleConfig(drop_over=10)), Sample)
    with pytest.raises(ValueError, match="drop_over must be at least 2"):
        SampleConfig(drop_over=1)
