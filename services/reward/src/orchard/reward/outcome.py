"""What a scorer returns: a value a trainer may use, or an exclusion, and evidence to check it.

Scorers build these plain records; the service turns them into ``orchard.types.v1.Reward``
messages. An :class:`Exclusion` is never a low score: a trajectory whose reward is excluded
never enters a loss.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["Evidence", "Exclusion", "ScoreResult", "excluded", "scored"]

EVIDENCE_TEXT_LIMIT = 16_384
"""Characters of one piece of evidence kept; the tail is cut with a marker."""


class Exclusion(enum.Enum):
    """Why no value could be given; mirrors ``orchard.types.v1.ExclusionReason``."""

    SANDBOX_FAILURE = "sandbox_failure"
    TIMEOUT = "timeout"
    JUDGE_UNAVAILABLE = "judge_unavailable"
    CAPTCHA_BLOCKED = "captcha_blocked"
    ABORTED = "aborted"
    OTHER = "other"


@dataclass(frozen=True)
class Evidence:
    """What a scorer ran or saw, for a person checking the reward."""

    title: str
    text: str
    turn_index: int = -1

    @classmethod
    def of(cls, title: str, text: str, turn_index: int = -1) -> Evidence:
        """Evidence with ``text`` cut to :data:`EVIDENCE_TEXT_LIMIT` characters."""
        if len(text) > EVIDENCE_TEXT_LIMIT:
            dropped = len(text) - EVIDENCE_TEXT_LIMIT
            text = text[:EVIDENCE_TEXT_LIMIT] + f"\n[... {dropped} more characters cut]"
        return cls(title, text, turn_index)


@dataclass(frozen=True)
class ScoreResult:
    """One scorer's answer: ``value`` counts only when ``exclusion`` is None."""

    scorer: str
    value: float = 0.0
    exclusion: Exclusion | None = None
    detail: str = ""
    components: dict[str, float] = field(default_factory=dict)
    evidence: tuple[Evidence, ...] = ()

    @property
    def is_scored(self) -> bool:
        return self.exclusion is None


def scored(
    scorer: str,
    value: float,
    *,
    detail: str = "",
    components: dict[str, float] | None = None,
    evidence: tuple[Evidence, ...] = (),
) -> ScoreResult:
    """A value the trainer may use."""
    return ScoreResult(scorer, value, None, detail, dict(components or {}), evidence)


def excluded(
    scorer: str, why: Exclusion, detail: str, *, evidence: tuple[Evidence, ...] = ()
) -> ScoreResult:
    """No value, for a reason outside the policy; ``detail`` says what happened."""
    return ScoreResult(scorer, 0.0, why, detail, {}, evidence)
