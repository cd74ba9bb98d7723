"""Which samples each rank trains on at each step: a fixed, seeded plan.

Samples are shuffled once per epoch (seeded by `seed` and the epoch) and cut into micro-batches
of `micro_batch_size`. Micro-batch `j` of the whole run goes to step `j // (world * accum)`,
rank `(j // accum) % world`. So the same data, seed and `world_size * gradient_accumulation`
give every step the same micro-batches whatever the number of processes, which is what lets a
world of two be checked against a world of one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from orchard.trainer.batch import TokenBatch, collate
from orchard.trainer.masks import Sample

__all__ = ["Collate", "MicroBatchPlan"]

Collate = Callable[[Sequence[Sample], int], TokenBatch]
"""(samples, pad id) -> a micro-batch: `batch.collate`, or a vision-language student's."""


class MicroBatchPlan:
    """Micro-batches of a sample set for every (step, rank)."""

    def __init__(
        self,
        samples: Sequence[Sample],
        *,
        micro_batch_size: int,
        gradient_accumulation: int,
        world_size: int,
        pad_id: int,
        seed: int = 0,
        collate_fn: Collate = collate,
    ) -> None:
        if not samples:
            raise ValueError("no samples to train on (every trajectory was skipped or filtered)")
        self.samples = tuple(samples)
        self.micro_batch_size = micro_batch_size
        self.gradient_accumulation = gradient_accumulation
        self.world_size = world_size
        self.pad_id = pad_id
        self.seed = seed
        self.collate_fn = collate_fn
        self.micro_batches_per_epoch = math.ceil(len(self.samples) / micro_batch_size)
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.samples)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}  # steps move forward: keep one epoch
        return order

    def micro_batch(self, index: int) -> TokenBatch:
        """Micro-batch `index` of the whole run (epochs follow one another)."""
        epoch, within = divmod(index, self.micro_batches_per_epoch)
        order = self._order(epoch)
        start = within * self.micro_batch_size
        chosen = [self.samples[i] for i in order[start : start + self.micro_batch_size]]
        return self.collate_fn(chosen, self.pad_id)

    def for_step(self, step: int, rank: int) -> list[TokenBatch]:
        """The micro-batches rank `rank` trains on in optimizer step `step` (from 0)."""
        first = (step * self.world_size + rank) * self.gradient_accumulation
        return [self.micro_batch(first + i) for i in range(self.gradient_accumulation)]

    @property
    def steps_per_epoch(self) -> float:
        """Optimizer steps that make one pass over the samples (a fraction when a pass ends
        within a step)."""
        return self.micro_batches_per_epoch / (self.world_size * self.gradient_accumulation)

    def epoch_of(self, step: int) -> float:
        """How many passes over the data have been made by the end of `step`."""
        done = (step + 1) * self.world_size * self.gradient_accumulation
        return done / self.micro_batches_per_epoch
