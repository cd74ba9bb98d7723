"""A teacher's conversation in the student's tokens (`orchard.trainer.teacher`): turn by turn,
exactly what the student's chat template renders, and refused by name when it cannot be."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orchard.lm.chat import ChatRenderer
from orchard.lm.tokenizer import build_tokenizer
from orchard.trainer.teacher import TrajectoryBuildError, teacher_trajectory
from orchard.types.v1 import reward_pb2, trajectory_pb2

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command in the task's machine.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Finish the task.",
            "parameters": {"type": "object", "properties": {"summary": {"type": "string"}}},
        },
    },
]


def call(index: int, name: str, arguments: dict[str, str]) -> dict[str, object]:
    return {
        "id": f"c{index}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def conversation(command: str = "cat src/*/rules.py") -> list[dict[str, object]]:
    """A teacher's rollout of the built-in suite as the rollout service records it."""
    return [
        {"role": "system", "content": "You fix bugs."},
        {"role": "user", "content": "`f(3)` is wrong; fix src/a/rules.py."},
        {"role": "assistant", "content": "I read it.",
         "tool_calls": [call(0, "bash", {"command": command})]},
        {"role": "tool", "tool_call_id": "c0",
         "content": "exit code 0\ndef f(x):\n    return x > 3\n"},
        {"role": "assistant", "content": "Done.", "tool_calls": [call(1, "submit", {})]},
        {"role": "tool", "tool_call_id": "c1", "content": "submitted"},
    ]  # fmt: skip


def teacher_rollout(**fields: Any) -> trajectory_pb2.Trajectory:
    """A teacher's trajectory as orchard-rollout streams it: reward, outcome, conversation."""
    given: dict[str, Any] = {
        "id": "r1/0",
        "rollout_id": "r1",
        "task_id": "t1",
        "harness": "builtin:swe",
        "group_id": "job/t1/builtin:swe",
        "outcome": trajectory_pb2.TRAJECTORY_OUTCOME_COMPLETED,
        "reward": reward_pb2.Reward(
            status=reward_pb2.REWARD_STATUS_SCORED, value=1.0, scorer="tests"
        ),
        "conversation_json": json.dumps(conversation()),
    }
    return trajectory_pb2.Trajectory(**(given | fields))


def test_a_teacher_conversation_becomes_the_students_exact_tokens() -> None:
    renderer = ChatRenderer(build_tokenizer())
    source = teacher_rollout(metadata={"status": "completed"})
    trajectory = teacher_trajectory(source, renderer, TOOLS, teacher_model="teacher")
    assert len(trajectory.turns) == 2
    # What the rollout service said about it stays: reward, outcome, ids, metadata.
    assert trajectory.reward == source.reward and trajectory.outcome == source.outcome
    assert (trajectory.rollout_id, trajectory.group_id) == ("r1", "job/t1/builtin:swe")
    assert trajectory.metadata["status"] == "completed"
    assert trajectory.metadata["source"] == "teacher" and not trajectory.conversation_json
    tokens: list[int] = []
    for turn in trajectory.turns:
        tokens += [*turn.input_token_ids, *turn.output_token_ids]
        assert all(turn.output_loss_mask) and not turn.output_logprobs
        assert turn.output_token_ids[-1] in renderer.stop_token_ids  # ends its turn
        assert turn.weight_version == "teacher:teacher"
    # Inputs and outputs in order are the student's rendering of the conversation up to the
    # last answer: nothing re-tokenized differently, nothing lost between turns.
    whole = renderer.render(conversation()[:5], TOOLS, add_generation_prompt=False).token_ids
    assert tuple(tokens) == tuple(whole[: len(tokens)])
    assert renderer.decode(whole[len(tokens) :]).strip() == ""
    assert [c.name for t in trajectory.turns for c in t.tool_calls] == ["bash", "submit"]
    # What each turn saw, as text for judges: the task first, then each tool's output.
    assert "fix src/a/rules.py" in trajectory.turns[0].input_text
    assert trajectory.turns[1].input_text == "exit code 0\ndef f(x):\n    return x > 3\n"


@pytest.mark.parametrize(
    ("conversation_json", "reason", "says"),
    [
        ("", "no_conversation", "rollout r1: no conversation"),
        ("[{", "bad_conversation", "not JSON"),
        ('{"role": "user"}', "bad_conversation", "JSON array of chat messages"),
        ('[{"role": "user", "content": "x"}]', "no_assistant_turn", "no assistant message"),
        (
            '[{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]',
            "bad_conversation",
            "wizard",
        ),
    ],
)
def test_a_conversation_that_cannot_be_rendered_is_refused_by_name(
    conversation_json: str, reason: str, says: str
) -> None:
    renderer = ChatRenderer(build_tokenizer())
    with pytest.raises(TrajectoryBuildError, match=says) as caught:
        teacher_trajectory(
            teacher_rollout(conversation_json=conversation_json),
            renderer,
            [],
            teacher_model="teacher",
        )
    assert caught.value.reason == reason
