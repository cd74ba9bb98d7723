"""The built-in GUI suite's scripted teacher (`orchard.tasks.gui.teacher.ScriptedGuiTeacher`) as
a policy the scripted engine plays, one tool call per call.

A conversation of the GUI harness opens with the task's intent as its first user message, then
the initial observation, then one tool result per call; each observation is the text of
`Observation.summary` (`orchard.tasks.gui.observation.parse_summary` reads it back). The task
is found by that intent in the suite the script names. The teacher is stateful (its place in
the plan, a mistake it is undoing) and older observations lose their page text in the harness's
history, so the policy keeps one teacher per conversation, keyed by the call's capture session
(`SamplingParams.session`, the rollout id) and the task, and feeds it only the latest
observation. An observation whose page could not be read as text gets a wait (the teacher aims
by the page text), a few times in a row at most. A conversation whose intent is no task of the
suite goes to the script's plans.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchard.rollout.scripted_policy import (
    GuiTeacherSettings,
    ScriptedPolicy,
    ScriptedStep,
    assistant_turns,
    content_text,
)
from orchard.rollout.teacher_tools import NoToolFits, adapt_step
from orchard.tasks.gui.observation import Observation, parse_summary
from orchard.tasks.gui.page_text import parse_page_text
from orchard.tasks.gui.suite import GuiTask, generate_suite
from orchard.tasks.gui.teacher import ScriptedGuiTeacher, ToolCall

__all__ = [
    "DEFAULT_MAX_CONVERSATIONS",
    "UNREAD_LIMIT",
    "GuiTeacherPolicy",
    "GuiTeacherRequestError",
]

DEFAULT_MAX_CONVERSATIONS = 4096
"""Conversations whose teachers are kept (least recently used go first)."""
UNREAD_LIMIT = 3
"""Observations in a row without page text the teacher waits through (a busy page); one more
is `GuiTeacherRequestError` (a harness that never sends page text)."""
_WAIT = ToolCall("wait", {"seconds": 1}, "I cannot read the page this time; I wait and look again.")


class GuiTeacherRequestError(ValueError):
    """A call of a suite task's conversation the teacher cannot answer as sent (no session, a
    last message that is no observation, observation after observation without page text, a
    conversation whose teacher is gone); the message says what is missing."""


@dataclass(slots=True)
class _Conversation:
    teacher: ScriptedGuiTeacher
    replies: int = 0
    """Assistant turns the conversation holds once it has the last reply."""
    last: ScriptedStep | None = None
    unread: int = 0
    """Observations in a row without page text."""


def _normalized(text: str) -> str:
    return " ".join(text.split())


class GuiTeacherPolicy:
    """Plays `ScriptedGuiTeacher` for the suite's tasks and `fallback` (the script's plans)
    for other conversations. ``seed`` (the script's) seeds the generator that seeds the
    teachers of calls that bring no seed of their own."""

    def __init__(
        self,
        settings: GuiTeacherSettings,
        fallback: ScriptedPolicy,
        *,
        seed: int | None = None,
        max_conversations: int = DEFAULT_MAX_CONVERSATIONS,
    ) -> None:
        self.settings = settings
        self.fallback = fallback
        self.max_conversations = max_conversations
        self._rng = random.Random(None if seed is None else f"gui-teacher-policy/{seed}")
        self._tasks: dict[str, GuiTask] | None = None
        self._conversations: OrderedDict[tuple[str, str], _Conversation] = OrderedDict()

    @property
    def tasks(self) -> dict[str, GuiTask]:
        """The suite's tasks by intent (whitespace normalized), generated on first use."""
        if self._tasks is None:
            suite = generate_suite(self.settings.count, seed=self.settings.suite_seed)
            self._tasks = {_normalized(task.intent): task for task in suite}
        return self._tasks

    def task_for(self, messages: Sequence[Mapping[str, Any]]) -> GuiTask | None:
        """The task whose intent is the conversation's first user message, if any."""
        first = next((m for m in messages if m.get("role") == "user"), None)
        if first is None:
            return None
        return self.tasks.get(_normalized(content_text(first.get("content"))))

    def next_step(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        *,
        seed: int | None = None,
        session: str = "",
    ) -> ScriptedStep:
        """The reply to a conversation (OpenAI chat messages) given the offered tools (OpenAI
        function tools): the teacher's next call with its thought as text, or the plans'
        reply for a conversation of no suite task. A conversation's teacher is made on its
        first call, seeded by ``seed`` (the call's own, which the capture proxy draws per
        rollout) or else the policy's generator. A call sent again (the same number of
        replies in its history as the one before) gets the same reply. Raises
        `GuiTeacherRequestError` for a suite task's call it cannot answer."""
        task = self.task_for(messages)
        if task is None:
            return self.fallback.next_step(messages, tools, seed)
        if not session:
            raise GuiTeacherRequestError(
                "the GUI teacher keeps one teacher per conversation and needs the call's capture "
                "session (SamplingParams.session, which the capture proxy sets)"
            )
        replies = len(assistant_turns(messages))
        conversation = self._conversation((session, task.id), task, replies, seed)
        if conversation.last is not None and replies == conversation.replies - 1:
            return conversation.last
        observation = _latest_observation(messages)
        if isinstance(observation, Observation) and observation.page_text is None:
            conversation.unread += 1
            if conversation.unread > UNREAD_LIMIT:
                raise GuiTeacherRequestError(
                    f"{conversation.unread} observations in a row have no page text, which the "
                    "GUI teacher aims by: run it with a harness that shows the page as text "
                    "(builtin:browser-text)"
                )
            call = _WAIT
        else:
            conversation.unread = 0
            call = conversation.teacher.next_call(observation)
        try:
            offered = adapt_step(call.name, call.arguments, tools)
        except NoToolFits as exc:
            step = ScriptedStep(f"{call.thought} I cannot go on: {exc}.")
        else:
            step = ScriptedStep(call.thought, offered.name, offered.arguments)
        conversation.replies, conversation.last = replies + 1, step
        return step

    def _conversation(
        self, key: tuple[str, str], task: GuiTask, replies: int, seed: int | None
    ) -> _Conversation:
        conversation = self._conversations.get(key)
        if conversation is not None:
            self._conversations.move_to_end(key)
            return conversation
        if replies:
            raise GuiTeacherRequestError(
                f"the GUI teacher of conversation {key[0]!r} is gone (more than "
                f"{self.max_conversations} conversations at once, or the service restarted): "
                f"it cannot go on from reply {replies + 1}"
            )
        teacher = ScriptedGuiTeacher(
            task,
            seed=self._rng.getrandbits(63) if seed is None else seed,
            mistake_rate=self.settings.mistake_rate,
            slip_share=self.settings.slip_share,
        )
        conversation = self._conversations[key] = _Conversation(teacher)
        while len(self._conversations) > self.max_conversations:
            self._conversations.popitem(last=False)
        return conversation


def _latest_observation(messages: Sequence[Mapping[str, Any]]) -> Observation | str:
    """The last message's observation, from its `Observation.summary` text (or, failing that,
    a page text rendering alone, which tells no tabs); its page text may be None."""
    last = messages[-1] if messages else {}
    if last.get("role") not in ("tool", "user"):
        raise GuiTeacherRequestError(
            "the GUI teacher answers an observation: the last message must be a tool result or "
            f"a user message, not {last.get('role')!r}"
        )
    text = content_text(last.get("content"))
    try:
        return parse_summary(text)
    except ValueError:
        if parse_page_text(text).url:
            return text
        raise GuiTeacherRequestError(
            f"the last message is no observation (Observation.summary) of the GUI harness: "
            f"{json.dumps(text[:200])}"
        ) from None
