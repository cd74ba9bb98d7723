"""An SFT job's validation set and what its evaluations decide.

The validation set is a dataset of its own (`ValidationConfig.dataset`) or tasks held out of the
job's dataset (`ValidationConfig.fraction`): `hold_out_tasks` draws them with the job's seed
among the tasks that give at least one SFT sample, and `split_by_task` puts every row of a
held-out task on the validation side, so no task is trained on and validated on at once.

`ValidationTracker` is the controller's side of the evaluations the ranks run (`rank.RankTrainer`
evaluates after the steps `evaluation_due` names): it keeps every point, the best loss and its
step, and counts evaluations without a new best for early stopping. Its state is the job's
`ValidationProgress`, kept in the job's record, so a resumed job goes on counting where it was.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

from orchard.trainer.masks import Sample, SampleConfig, sft_samples
from orchard.trainer.v1 import trainer_service_pb2 as api
from orchard.types.v1 import trajectory_pb2

__all__ = [
    "ValidationSetError",
    "ValidationTracker",
    "evaluation_due",
    "hold_out_tasks",
    "split_by_task",
    "task_of",
]


class ValidationSetError(ValueError):
    """A validation setting the dataset cannot honour (too few tasks to hold any out)."""


def task_of(row: trajectory_pb2.Trajectory) -> str:
    """The task a row belongs to: its `task_id`, else its own id (a task of its own)."""
    return row.task_id or f"row:{row.id}"


def hold_out_tasks(
    rows: Iterable[trajectory_pb2.Trajectory],
    fraction: float,
    seed: int,
    samples: SampleConfig,
) -> list[str]:
    """The tasks to hold out, sorted: round(`fraction` x tasks) of the tasks whose rows give at
    least one SFT sample (at least one, and at least one left), drawn with `seed`. Raises
    `ValidationSetError` when fewer than two tasks give samples."""
    productive: set[str] = set()
    for row in rows:
        if any(isinstance(s, Sample) for s in sft_samples(row, samples)):
            productive.add(task_of(row))
    if len(productive) < 2:
        raise ValidationSetError(
            f"spec.validation.fraction {fraction} holds out whole tasks, and the dataset has "
            f"{len(productive)} task(s) with SFT samples: it needs at least two (one to train "
            "on, one to validate on); give spec.validation.dataset instead, or no validation"
        )
    count = min(len(productive) - 1, max(1, round(fraction * len(productive))))
    order = sorted(productive)
    random.Random(f"{seed}:validation").shuffle(order)
    return sorted(order[:count])


def split_by_task(
    rows: Iterable[trajectory_pb2.Trajectory], held_out: Iterable[str]
) -> tuple[list[trajectory_pb2.Trajectory], list[trajectory_pb2.Trajectory]]:
    """(training rows, validation rows): the rows of the `held_out` tasks validate."""
    tasks = set(held_out)
    train: list[trajectory_pb2.Trajectory] = []
    validate: list[trajectory_pb2.Trajectory] = []
    for row in rows:
        (validate if task_of(row) in tasks else train).append(row)
    return train, validate


def evaluation_due(
    step: int, *, total_steps: int, interval_steps: int, steps_per_epoch: float
) -> bool:
    """Whether the job evaluates after optimizer step `step` (from 1): every `interval_steps`
    steps, else after each step that completes a pass over the training samples
    (`steps_per_epoch` steps make one), and always after the last step."""
    if step >= total_steps:
        return True
    if interval_steps > 0:
        return step % interval_steps == 0
    return math.floor(step / steps_per_epoch) > math.floor((step - 1) / steps_per_epoch)


@dataclass
class ValidationTracker:
    """Evaluations seen so far, the best one, and whether early stopping has ended the job."""

    config: api.ValidationConfig
    progress: api.ValidationProgress

    def record(self, step: int, epoch: float, loss: float, loss_tokens: int) -> bool:
        """Add the evaluation after `step`; True when it is a new best (the caller keeps a
        checkpoint of it). Sets `stopped_early` once `patience` evaluations in a row brought
        no new best. Points of `step` and later (a resumed job stepping again past its last
        checkpoint, which is never before the best step) are replaced."""
        kept = [p for p in self.progress.points if p.step < step]
        del self.progress.points[:]
        self.progress.points.extend(kept)
        self.progress.points.add(step=step, epoch=epoch, loss=loss, loss_tokens=loss_tokens)
        best = self.progress.best_step == 0 or (
            math.isfinite(loss) and loss < self.progress.best_loss - self.config.min_delta
        )
        if best:
            self.progress.best_step = step
            self.progress.best_loss = loss
        since_best = sum(p.step > self.progress.best_step for p in self.progress.points)
        if self.config.patience > 0 and since_best >= self.config.patience:
            self.progress.stopped_early = True
        return best

    @property
    def stopped_early(self) -> bool:
        return self.progress.stopped_early
