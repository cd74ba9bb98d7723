"""The group filter, and batches of groups refilled until enough carry signal.

A group carries signal for a group-relative advantage only when at least two of its members are
scored and their rewards differ. The filter drops the others with the reason; `fill_batch` then
samples further pairs (the task resampled) until the batch is full or the pairs run out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from orchard.rollout.results import GroupKey, RunRollout
from orchard.rollout.samplers import SampledGroup, Sampler


@dataclass(frozen=True, slots=True)
class GroupFilter:
    """Drops groups that give no learning signal."""

    min_scored: int = 2
    """Fewest scored (not aborted) members a group needs."""

    def __post_init__(self) -> None:
        if self.min_scored < 2:
            raise ValueError(f"min_scored must be at least 2, got {self.min_scored}")

    def drop_reason(self, group: SampledGroup) -> str:
        """Why the group is dropped; empty when it is kept."""
        rewards = [m.reward for m in group.members if m.reward is not None]
        if len(rewards) < self.min_scored:
            return (
                f"{len(rewards)} of {len(group.members)} members scored, fewer than "
                f"{self.min_scored}"
            )
        if max(rewards) == min(rewards):
            return f"every scored member has reward {rewards[0]:g}: no variance"
        return ""


@dataclass(frozen=True, slots=True)
class DroppedGroup:
    group: SampledGroup
    reason: str


@dataclass(slots=True)
class Batch:
    """Groups kept for training, the ones dropped, and what it all cost."""

    kept: list[SampledGroup] = field(default_factory=list)
    dropped: list[DroppedGroup] = field(default_factory=list)
    surplus: list[SampledGroup] = field(default_factory=list)
    """Kept groups that finished after the batch was full (pairs already in flight)."""

    @property
    def rollouts_run(self) -> int:
        every = [*self.kept, *self.surplus, *(d.group for d in self.dropped)]
        return sum(len(g.rollouts) for g in every)


async def fill_batch(
    pairs: Iterable[GroupKey],
    sampler: Sampler,
    run: RunRollout,
    *,
    batch_size: int,
    group_filter: GroupFilter | None = None,
    parallel_pairs: int = 1,
) -> Batch:
    """Samples pairs in order, `parallel_pairs` at a time, until `batch_size` groups pass the
    filter or the pairs run out (then the batch is short: the caller sees `len(kept)`)."""
    if batch_size < 1 or parallel_pairs < 1:
        raise ValueError(
            f"batch_size and parallel_pairs must be at least 1, got {batch_size}, {parallel_pairs}"
        )
    keep = group_filter or GroupFilter()
    batch = Batch()
    queue = iter(pairs)
    in_flight: set[asyncio.Task[SampledGroup]] = set()

    def start_next() -> bool:
        key = next(queue, None)
        if key is None:
            return False
        in_flight.add(asyncio.ensure_future(sampler.sample(key, run)))
        return True

    try:
        for _ in range(parallel_pairs):
            if not start_next():
                break
        while in_flight:
            done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: t.result().key):
                in_flight.discard(task)
                group = task.result()
                reason = keep.drop_reason(group)
                if reason:
                    batch.dropped.append(DroppedGroup(group, reason))
                elif len(batch.kept) < batch_size:
                    batch.kept.append(group)
                else:
                    batch.surplus.append(group)
            while len(in_flight) < parallel_pairs and len(batch.kept) + len(in_flight) < batch_size:
                if not start_next():
                    break
    finally:
        for task in in_flight:
            task.cancel()
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)
    return batch
