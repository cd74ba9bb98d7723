"""Fixtures of the trainer tests: hand-built trajectories, exactly as the rollout records them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from orchard.types.v1 import reward_pb2, trajectory_pb2


@dataclass(frozen=True)
class TurnSpec:
    """One turn: input tokens, output tokens, and optionally its kind, mask and logprobs."""

    inputs: Sequence[int]
    outputs: Sequence[int]
    auxiliary: bool = False
    loss_mask: Sequence[bool] = ()
    logprobs: Sequence[float] | None = None


class TrajectoryBuilder:
    """Builds `orchard.types.v1.Trajectory` messages from short specs."""

    Turn = TurnSpec

    def __call__(
        self,
        turns: Sequence[TurnSpec],
        *,
        reward: float | None = 1.0,
        excluded: bool = False,
        aborted: bool = False,
        rise: Sequence[tuple[int, int]] = (),
        trajectory_id: str = "t0",
        task_id: str = "task",
        harness: str = "builtin:swe",
    ) -> trajectory_pb2.Trajectory:
        trajectory = trajectory_pb2.Trajectory(
            id=trajectory_id, rollout_id="r0", task_id=task_id, harness=harness
        )
        for index, spec in enumerate(turns):
            logprobs = (
                spec.logprobs
                if spec.logprobs is not None
                else [-0.1 * (k + 1) for k in range(len(spec.outputs))]
            )
            trajectory.turns.add(
                index=index,
                kind=(
                    trajectory_pb2.TURN_KIND_AUXILIARY
                    if spec.auxiliary
                    else trajectory_pb2.TURN_KIND_POLICY
                ),
                input_token_ids=list(spec.inputs),
                output_token_ids=list(spec.outputs),
                output_logprobs=list(logprobs),
                output_loss_mask=list(spec.loss_mask),
            )
        if excluded:
            trajectory.reward.status = reward_pb2.REWARD_STATUS_EXCLUDED
            trajectory.reward.exclusion = reward_pb2.EXCLUSION_REASON_SANDBOX_FAILURE
        elif reward is not None:
            trajectory.reward.status = reward_pb2.REWARD_STATUS_SCORED
            trajectory.reward.value = reward
        trajectory.outcome = (
            trajectory_pb2.TRAJECTORY_OUTCOME_ABORTED
            if aborted
            else trajectory_pb2.TRAJECTORY_OUTCOME_COMPLETED
        )
        for start, end in rise:
            trajectory.credit.rise_segments.add(start=start, end=end)
        return trajectory


@pytest.fixture
def build() -> TrajectoryBuilder:
    return TrajectoryBuilder()


# The synthetic SFT task of the training tests: four observation tokens; the right action is
# each shifted up by one, then END. A first, wrong attempt (shifted down: as easy a rule) sits
# outside the rise segment of a failed trajectory, so only the right action may be learned.
SYNTH_VOCAB = 48
SYNTH_BOS, SYNTH_SEP, SYNTH_END, SYNTH_PAD = 1, 2, 3, 0
SYNTH_FIRST = 10


def synthetic_trajectories(n: int, seed: int) -> list[trajectory_pb2.Trajectory]:
    import random

    build = TrajectoryBuilder()
    rng = random.Random(seed)
    trajectories = []
    for k in range(n):
        obs = [rng.randrange(SYNTH_FIRST, SYNTH_VOCAB - 1) for _ in range(4)]
        action = [o + 1 for o in obs] + [SYNTH_END]
        wrong = [o - 1 for o in obs]
        trajectories.append(
            build(
                [
                    build.Turn(inputs=[SYNTH_BOS, *obs, SYNTH_SEP], outputs=wrong),
                    build.Turn(inputs=[SYNTH_SEP], outputs=action),
                ],
                trajectory_id=f"s{seed}-{k}",
                reward=0.0,
                rise=[(1, 1)],
            )
        )
    return trajectories


@pytest.fixture
def synthetic():
    """`synthetic(n, seed)`: trajectories of the synthetic SFT task."""
    return synthetic_trajectories
