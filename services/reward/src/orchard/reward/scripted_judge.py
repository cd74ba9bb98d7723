"""The scripted credit judge: a judge kind answered in this process, with no model and no network.

It answers the credit-assignment question (:func:`orchard.reward.judged.assign_credit`) by
reading the transcript in the prompt (``### Turn N`` / ``Action:`` / ``Observation:`` blocks)
and valuing each turn by what its action does:

- reading code or running the tests raises the chance of resolving the task a little;
- the last change to the code before the end is the critical error of a failed attempt (the
  value drops there);
- the last turn ends low, as the calibration rules ask.

It is a heuristic standing in for a judge model so credit assignment runs on embedded defaults
(a recipe's ``judge_endpoint: builtin:scripted``); anything else points a judge at a model.
Rubric grades from a judge of this kind come from :mod:`orchard.reward.scripted_rubric`;
outcome verdicts need a model: asked for them it is FAILED_PRECONDITION.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from orchard.reward.judge_client import JudgeAnswer
from orchard.reward.judge_json import MalformedJudgeOutput

__all__ = ["DEFAULT_MODEL", "ScriptedJudge", "judge_reply"]

T = TypeVar("T")

DEFAULT_MODEL = "scripted-judge"
_TURN = re.compile(r"^### Turn (\d+)\nAction:\n(.*?)\nObservation:\n", re.MULTILINE | re.DOTALL)
_EDIT = re.compile(r"sed -i|tool call (edit|create)\(|>\s*\S+\.py|patch ")
_LOOK = re.compile(r"\b(cat|grep|ls|head|tail|sed -n|find)\b|tool call view\(|pytest")


def _kind(action: str) -> str:
    if "tool call submit(" in action:
        return "submit"
    if _EDIT.search(action):
        return "edit"
    if _LOOK.search(action):
        return "look"
    return "other"


def judge_reply(prompt: str) -> dict[str, Any]:
    """The annotation for a credit prompt; raises ValueError when it holds no transcript."""
    actions = {int(m.group(1)): m.group(2) for m in _TURN.finditer(prompt)}
    if not actions:
        raise ValueError("the prompt holds no '### Turn N' transcript to value")
    last = max(actions)
    kinds = [_kind(actions.get(t, "")) for t in range(last + 1)]
    edits = [t for t, kind in enumerate(kinds) if kind == "edit" and t > 0]
    critical = edits[-1] if edits else last
    values = []
    value = 0.4
    for turn, kind in enumerate(kinds):
        if turn == 0:
            value = 0.4
        elif turn == critical:
            value = 0.1
        elif turn == last:
            value = min(value, 0.05)
        elif turn > critical:
            value = min(value, 0.1)
        elif kind == "look":
            value = min(0.7, value + 0.1)
        values.append({"turn": turn, "value": round(value, 3)})
    if values[-1]["value"] >= 0.2:
        values[-1]["value"] = 0.05
    return {"values": values, "critical_turn": critical if critical > 0 else None}


def _prompt(messages: Sequence[dict[str, Any]]) -> str:
    return "\n".join(m["content"] for m in messages if isinstance(m.get("content"), str))


class ScriptedJudge:
    """The judge interface of :class:`~orchard.reward.judge_client.OpenAIJudge`, answered here.

    One attempt per question: the answer is a function of the prompt, so a retry would repeat
    it. A reply the caller's parser refuses is recorded as the problem, like a model's.
    """

    scripted = True
    """Asked for outcome verdicts the service refuses; it answers credit here and rubric grades
    with the scripted rubric grader."""

    def __init__(self, model: str = DEFAULT_MODEL) -> None:
        self.model = model
        self.questions = 0

    async def __aenter__(self) -> ScriptedJudge:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        return None

    async def ask(
        self, messages: Sequence[dict[str, Any]], parse: Callable[[str], T]
    ) -> JudgeAnswer[T]:
        answer: JudgeAnswer[T] = JudgeAnswer()
        self.questions += 1
        try:
            reply = json.dumps(judge_reply(_prompt(messages)))
        except ValueError as exc:
            answer.problems.append(f"attempt 1: the scripted judge answers credit only: {exc}")
            return answer
        answer.replies.append(reply)
        try:
            answer.value = parse(reply)
        except (MalformedJudgeOutput, ValueError) as exc:
            answer.problems.append(f"attempt 1: malformed reply: {exc}")
        return answer
