"""Dividing a suite into SFT, RL and held-out splits group by group (families, levels)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, TypeVar

__all__ = ["Split", "deal_splits"]

Split = Literal["sft", "rl", "evaluate"]
T = TypeVar("T")


def deal_splits(
    groups: Iterable[Sequence[T]], fractions: Mapping[Split, float]
) -> dict[Split, list[T]]:
    """Each group, in the order given and its members in theirs, dealt to the held-out and RL
    splits by ``fractions``, the rest to SFT. A group's share is rarely whole: what rounding
    leaves over carries to the next group, so the sizes follow the fractions over all groups.
    Held-out rounds half up and RL down, so a group that gives one more held-out task gives one
    fewer RL task and keeps tasks to train on."""
    out: dict[Split, list[T]] = {"sft": [], "rl": [], "evaluate": []}
    rounding: dict[Split, float] = {"evaluate": 0.5, "rl": 0.0}
    seen = 0
    for members in groups:
        start = 0
        for split, half in rounding.items():
            # What this split should hold after this group, rounded, less what it holds.
            due = math.floor(fractions.get(split, 0.0) * (seen + len(members)) + half)
            take = min(max(0, due - len(out[split])), len(members) - start)
            out[split] += members[start : start + take]
            start += take
        out["sft"] += members[start:]
        seen += len(members)
    return out
