"""The scripted teacher's plans for claw tasks, in any harness.

Each plan is the task's reference solution, one shell command per step (``shell`` steps: the
scripted policy puts each in the harness's own shell tool, whatever its name and schema), then
a final answer. Its failure is what a hasty assistant does: it looks, skips the last command of
the solution and runs the one before it without the retry a seeded fault needs, then says it is
done, which the task's checks score below the pass mark.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from orchard.tasks.claw.suite import ClawTask

__all__ = ["SOLVE_RATE", "teacher_script"]

SOLVE_RATE: Mapping[int, float] = {1: 0.85, 2: 0.65, 3: 0.45}
"""How often the teacher takes the solution path, by difficulty."""


def _shell(thought: str, command: str) -> dict[str, Any]:
    return {"thought": thought, "tool": "shell", "arguments": {"command": command}}


def _without_retry(command: str) -> str:
    # The suite's solution runs a command that meets a seeded fault as `cmd || cmd`.
    first, sep, second = command.partition(" || ")
    return first if sep and first == second else command


def _solution(task: ClawTask) -> list[dict[str, Any]]:
    steps = [
        _shell(f"Step {i} of {len(task.solution)}: I use the {c.split()[0]} tool.", c)
        for i, c in enumerate(task.solution, start=1)
    ]
    steps[0]["thought"] = "I start by looking at what is there. " + steps[0]["thought"]
    steps.append({"thought": "Done: everything you asked for is in place."})
    return steps


def _failure(task: ClawTask) -> list[dict[str, Any]]:
    commands = [_without_retry(c) for c in task.solution[:-1]] or [task.solution[0]]
    steps = [_shell("A quick look, then I act.", commands[0])]
    steps += [_shell("Next.", c) for c in commands[1:]]
    steps.append({"thought": "Done, I think."})
    return steps


def teacher_script(tasks: Sequence[ClawTask], model: str = "scripted-teacher") -> dict[str, Any]:
    """The plans for ``tasks`` in the scripted policy's JSON form
    (:meth:`orchard.rollout.scripted_policy.PolicyScript.from_json`), each matched by its task's
    whole instruction (unique within a suite: `generate_suite`)."""
    plans = [
        {
            "match": task.instruction,
            "solve_rate": SOLVE_RATE[task.difficulty],
            "solution": _solution(task),
            "failure": _failure(task),
        }
        for task in tasks
    ]
    return {"model": model, "plans": plans}
