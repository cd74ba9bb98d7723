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
