"""Reading the JSON object out of a model's reply, strictly.

Judges and graders are asked for one JSON object; real replies wrap it in prose or a Markdown
fence. :func:`extract_json_object` finds the first complete, parseable top-level object and
rejects replies with none. Everything a judge could get wrong raises
:class:`MalformedJudgeOutput`, which callers retry and finally turn into an exclusion, never a
score.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["MalformedJudgeOutput", "extract_json_object", "require_probability"]


class MalformedJudgeOutput(ValueError):
    """The reply holds no usable verdict; the message says what was wrong, for the evidence."""


def extract_json_object(text: str) -> dict[str, Any]:
    """The first top-level JSON object in ``text`` that parses.

    Braces inside JSON strings are skipped while scanning, so ``{"reason": "a } b"}`` is found
    whole. Raises :class:`MalformedJudgeOutput` when no object parses.
    """
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
            continue
        if isinstance(value, dict):
            return value
        start = text.find("{", start + 1)
    snippet = text.strip()[:200] or "<empty reply>"
    raise MalformedJudgeOutput(f"no JSON object in the reply: {snippet!r}")


def require_probability(value: Any, what: str) -> float:
    """``value`` as a float in [0, 1], or :class:`MalformedJudgeOutput` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedJudgeOutput(f"{what} must be a number in [0, 1], got {value!r}")
    number = float(value)
    if not math.isfinite(number) or not 0.0 <= number <= 1.0:
        raise MalformedJudgeOutput(f"{what} must be in [0, 1], got {number}")
    return number
