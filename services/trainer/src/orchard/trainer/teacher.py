"""A teacher's conversation as a training trajectory in the student's tokens.

The student's own rollouts come back from orchard-rollout as trajectories already: the calls
its capture proxy recorded, with the exact token ids sampled and their logprobs. A teacher
behind an OpenAI-compatible API (or the scripted teacher) gives text only. Its conversation is
rendered with the *student's* tokenizer and chat template, turn by turn, exactly as the capture
proxy would have rendered it had the student written the same words: each turn's input is what
the prompt added since the previous turn, its output the assistant message up to and including
the end-of-turn token. Teacher turns have no logprobs (`output_logprobs` stays empty) and the
weight version ``teacher:<model>``.

Screenshots (``image_url`` content parts, the GUI domain's `builtin:browser` harness) render
only for a vision-language student (`orchard.lm.vision.VisionChatRenderer`): their tokens are
in the turns, and the row keeps its conversation so the images travel with it to SFT. A text
student's renderer refuses them: the row fails with the reason ``image_content`` (a text student
learns the GUI from the page as text, the `builtin:browser-text` harness; dropping the images
would teach it actions on pages it never saw).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from orchard.lm.chat import IM_END, ChatFormatError, ChatImageError, ChatRenderer, content_text
from orchard.lm.vision import message_image_urls
from orchard.types.v1 import trajectory_pb2

__all__ = [
    "TrajectoryBuildError",
    "teacher_trajectory",
]


class TrajectoryBuildError(ValueError):
    """A conversation the student's chat template cannot render turn by turn; `reason` is a
    short, stable name to count by."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _assistant_end(renderer: ChatRenderer, ids: list[int]) -> int:
    """Index just past the last end-of-turn token in ``ids``."""
    end_ids = set(renderer.stop_token_ids)
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] in end_ids:
            return i + 1
    raise TrajectoryBuildError(
        "template_mismatch", f"the rendered assistant turn has no {IM_END} token"
    )


def teacher_trajectory(
    source: trajectory_pb2.Trajectory,
    renderer: ChatRenderer,
    tools: Sequence[Mapping[str, Any]],
    *,
    teacher_model: str,
) -> trajectory_pb2.Trajectory:
    """The teacher's trajectory as orchard-rollout gave it (its reward, outcome and
    conversation, no turns) with turns in the student's tokens; raises `TrajectoryBuildError`
    when it has no conversation, the conversation is not a list of chat messages, or the
    template does not extend turn by turn."""
    if not source.conversation_json:
        raise TrajectoryBuildError(
            "no_conversation", f"rollout {source.rollout_id}: no conversation to render"
        )
    messages = _messages(source)
    if not any(m.get("role") == "assistant" for m in messages):
        raise TrajectoryBuildError(
            "no_assistant_turn",
            f"rollout {source.rollout_id}: the conversation has no assistant message to train on",
        )
    schemas = [dict(t) for t in tools]
    try:
        return _render(source, messages, renderer, schemas, teacher_model)
    except ChatImageError as exc:
        raise TrajectoryBuildError(
            "image_content",
            f"rollout {source.rollout_id}: {exc}; train a text student on the page as text "
            "(harness builtin:browser-text), or train a vision-language student",
        ) from None
    except ChatFormatError as exc:
        raise TrajectoryBuildError(
            "bad_conversation", f"rollout {source.rollout_id}: {exc}"
        ) from None


def _messages(source: trajectory_pb2.Trajectory) -> list[dict[str, Any]]:
    """The conversation's messages; raises `TrajectoryBuildError` when it is not a JSON array
    of objects."""
    try:
        messages = json.loads(source.conversation_json)
    except json.JSONDecodeError as exc:
        raise TrajectoryBuildError(
            "bad_conversation",
            f"rollout {source.rollout_id}: conversation_json is not JSON ({exc.msg} at "
            f"character {exc.pos})",
        ) from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise TrajectoryBuildError(
            "bad_conversation",
            f"rollout {source.rollout_id}: conversation_json must be a JSON array of chat "
            "messages (objects with a role)",
        )
    return messages


def _render(
    source: trajectory_pb2.Trajectory,
    messages: list[dict[str, Any]],
    renderer: ChatRenderer,
    schemas: list[dict[str, Any]],
    teacher_model: str,
) -> trajectory_pb2.Trajectory:
    turns: list[trajectory_pb2.Turn] = []
    consumed: list[int] = []
    previous = -1
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        # What the turn saw that the previous one did not: the prompt or the tool outputs.
        seen = "\n\n".join(content_text(m.get("content")) for m in messages[previous + 1 : index])
        previous = index
        history = messages[:index]
        prompt = list(renderer.render(history, schemas).token_ids)
        with_answer = list(
            renderer.render([*history, message], schemas, add_generation_prompt=False).token_ids
        )
        if prompt[: len(consumed)] != consumed or with_answer[: len(prompt)] != prompt:
            raise TrajectoryBuildError(
                "template_mismatch",
                f"rollout {source.rollout_id}: turn {len(turns)} does not extend the tokens "
                "before it under the student's chat template",
            )
        output = with_answer[len(prompt) : _assistant_end(renderer, with_answer)]
        calls = message.get("tool_calls") or []
        turns.append(
            trajectory_pb2.Turn(
                index=len(turns),
                kind=trajectory_pb2.TURN_KIND_POLICY,
                input_token_ids=prompt[len(consumed) :],
                output_token_ids=output,
                output_loss_mask=[True] * len(output),
                weight_version=f"teacher:{teacher_model}",
                finish_reason="tool_calls" if calls else "stop",
                output_text=renderer.decode(output),
                tool_calls=[
                    trajectory_pb2.ToolCall(
                        id=str(c.get("id", "")),
                        name=str(c.get("function", {}).get("name", "")),
                        arguments_json=str(c.get("function", {}).get("arguments", "")),
                    )
                    for c in calls
                ],
                input_text=seen,
            )
        )
        consumed = prompt + output
    trajectory = trajectory_pb2.Trajectory()
    trajectory.CopyFrom(source)
    images = len(message_image_urls(messages))
    # The images travel with a vision-language student's row: SFT needs their pixels.
    trajectory.conversation_json = source.conversation_json if images else ""
    del trajectory.turns[:]
    trajectory.turns.extend(turns)
    trajectory.metadata["source"] = "teacher"
    if images:
        trajectory.metadata["images"] = str(images)
    return trajectory
