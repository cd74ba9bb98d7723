"""The value model: it learns a separable signal from Trajectory protos, on tasks it never saw,
the same way under a seed, and refuses a history of one class."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from orchard.recipes.value_model import (
    FeatureSpace,
    auc,
    fit_value_model,
    split_by_task,
    trajectory_text,
    within_task_accuracy,
)
from orchard.types.v1 import reward_pb2, trajectory_pb2

NOISE = [
    *("cat", "ls", "grep", "sed", "src", "tests", "module", "value"),
    *("name", "line", "file", "def", "return", "print", "open"),
]


def trajectory(task: str, succeeded: bool, rng: random.Random, *, tell: float = 1.0) -> (
    trajectory_pb2.Trajectory
):  # fmt: skip
    """A captured rollout of a bug fix: noise commands and outputs, then a test run whose output
    says "passed" when the rollout succeeded (with chance ``tell``; else the other way)."""
    shows_pass = succeeded if rng.random() < tell else not succeeded
    turns = []
    for i in range(rng.randint(2, 5)):
        noise = " ".join(rng.choice(NOISE) for _ in range(12))
        turns.append(
            trajectory_pb2.Turn(
                index=i,
                input_text=f"tool: exit code 0\n{noise}" if i else f"user: fix {task}\n{noise}",
                output_text=f'<tool_call>{{"name": "bash", "arguments": "{rng.choice(NOISE)}"}}',
                weight_version="v1",
            )
        )
    result = "3 passed in 0.1s" if shows_pass else "1 failed, 2 passed in 0.1s"
    turns.append(
        trajectory_pb2.Turn(
            index=len(turns),
            input_text=f"tool: exit code {0 if shows_pass else 1}\n{result}",
            output_text='<tool_call>{"name": "submit", "arguments": {}}</tool_call>',
            weight_version="v1",
        )
    )
    return trajectory_pb2.Trajectory(
        id=f"{task}-{rng.getrandbits(32):08x}",
        task_id=task,
        turns=turns,
        reward=reward_pb2.Reward(
            status=reward_pb2.REWARD_STATUS_SCORED, value=1.0 if succeeded else -1.0
        ),
    )


def dataset(
    tasks: range, per_task: int, seed: int, tell: float = 0.9
) -> tuple[list[trajectory_pb2.Trajectory], list[bool]]:
    rng = random.Random(seed)
    rows, labels = [], []
    for task in tasks:
        for _ in range(per_task):
            won = rng.random() < 0.3
            rows.append(trajectory(f"task-{task}", won, rng, tell=tell))
            labels.append(won)
    return rows, labels


def test_it_learns_a_separable_signal_and_ranks_unseen_tasks() -> None:
    train, train_labels = dataset(range(40), 5, seed=1)
    held, held_labels = dataset(range(100, 120), 5, seed=2)
    model = fit_value_model(train, train_labels, l2=1e-3)
    held_auc = auc(model.scores(held), held_labels)
    assert held_auc is not None and held_auc > 0.8, held_auc
    # a test run's "passed" outweighs the noise: the success in a pair scores higher
    rng = random.Random(3)
    won, lost = trajectory("task-x", True, rng), trajectory("task-x", False, rng)
    high, low = model.scores([won, lost])
    assert high > 0.5 > low


def test_the_signal_it_learns_is_the_outcome_not_chance() -> None:
    """With the test output unrelated to success (tell 0.5), held-out AUC stays near chance."""
    train, train_labels = dataset(range(40), 5, seed=1, tell=0.5)
    held, held_labels = dataset(range(100, 140), 5, seed=2, tell=0.5)
    model = fit_value_model(train, train_labels)
    held_auc = auc(model.scores(held), held_labels)
    assert held_auc is not None and abs(held_auc - 0.5) < 0.15, held_auc


def test_it_is_deterministic_and_the_split_follows_the_seed() -> None:
    rows, labels = dataset(range(20), 4, seed=7)
    first = fit_value_model(rows, labels)
    second = fit_value_model(rows, labels)
    assert np.array_equal(first.weights, second.weights) and first.bias == second.bias
    assert first.scores(rows) == second.scores(rows)
    tasks = [t.task_id for t in rows]
    held = split_by_task(tasks, 0.25, seed=3)
    assert held == split_by_task(tasks, 0.25, seed=3)
    assert len(held) == 5 and held <= set(tasks)
    assert any(split_by_task(tasks, 0.25, seed=s) != held for s in range(4, 10))
    # never all tasks, none from a single task
    assert split_by_task(["a", "b"], 0.9, seed=1) in ({"a"}, {"b"})
    assert split_by_task(["a", "a"], 0.5, seed=1) == set()


@pytest.mark.parametrize("won", [True, False])
def test_a_history_of_one_class_is_refused(won: bool) -> None:
    rng = random.Random(0)
    rows = [trajectory("t", won, rng) for _ in range(5)]
    with pytest.raises(ValueError, match="needs successes and failures"):
        fit_value_model(rows, [won] * 5)
    with pytest.raises(ValueError, match="5 trajectories for 4 labels"):
        fit_value_model(rows, [won] * 4)


def test_observations_and_actions_are_features_of_their_own() -> None:
    space = FeatureSpace(ngrams=1, buckets=2**16)
    seen = trajectory_pb2.Trajectory(turns=[trajectory_pb2.Turn(input_text="passed")])
    typed = trajectory_pb2.Trajectory(turns=[trajectory_pb2.Turn(output_text="passed")])
    assert set(space.features(seen)).isdisjoint(space.features(typed))
    vector = space.features(seen)
    assert sum(v * v for v in vector.values()) == pytest.approx(1.0)
    assert space.features(trajectory_pb2.Trajectory()) == {}


def test_a_conversation_without_turns_is_read_from_its_messages() -> None:
    conversation = [
        {"role": "user", "content": "fix it"},
        {
            "role": "assistant",
            "content": "running tests",
            "tool_calls": [{"function": {"name": "bash", "arguments": "pytest"}}],
        },
        {"role": "tool", "content": "2 passed"},
    ]
    pieces = trajectory_text(trajectory_pb2.Trajectory(conversation_json=json.dumps(conversation)))
    assert [kind for kind, _ in pieces] == ["obs", "act", "obs"]
    assert "pytest" in pieces[1][1] and pieces[2][1] == "tool: 2 passed"
    assert trajectory_text(trajectory_pb2.Trajectory(conversation_json="not json")) == []


def test_auc_and_within_task_accuracy() -> None:
    assert auc([0.9, 0.8, 0.1], [True, True, False]) == 1.0
    assert auc([0.1, 0.9], [True, False]) == 0.0
    assert auc([0.5, 0.5, 0.5], [True, False, False]) == 0.5  # ties count half
    assert auc([0.3, 0.4], [True, True]) is None
    # task a: the success above the failure; task b: below; task c: one class, no pair
    groups = [[(0.9, True), (0.2, False)], [(0.1, True), (0.7, False)], [(0.5, True)]]
    assert within_task_accuracy(groups) == (0.5, 2)
    assert within_task_accuracy([[(0.4, True), (0.4, False), (0.1, False)]]) == (0.75, 2)
    assert within_task_accuracy([[(0.4, False)]]) == (None, 0)
