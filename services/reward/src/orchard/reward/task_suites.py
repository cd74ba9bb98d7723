"""The task suites orchard-reward knows and scores, as ListTaskSuites lists them.

Each is a suite generated in code from a (count, seed) pair in orchard-tasks: the SWE suite's
tasks are instances this service scores with ScoreTests, the Claw suite's are personal-assistant
tasks it scores with ScoreTask (their checks regenerated from the task id), the GUI suite's are
browser tasks its JudgeOutcome scores (the built-in state judge regenerates each from its id).
The facts come from the generators themselves, so a client checks a suite's settings without
importing them.
"""

from __future__ import annotations

from collections.abc import Iterable

from orchard.reward.v1 import reward_service_pb2 as api
from orchard.tasks import swe_suite
from orchard.tasks.claw import suite as claw_suite
from orchard.tasks.gui import suite as gui_suite

__all__ = ["task_suites"]


def _suite(
    name: str,
    description: str,
    families: Iterable[tuple[str, int, str]],
    tasks: tuple[int, int],
    scored_by: str,
    *,
    test_parser: str = "",
) -> api.TaskSuite:
    return api.TaskSuite(
        name=name,
        description=description,
        families=[
            api.TaskFamily(name=family, difficulty=difficulty, description=text)
            for family, difficulty, text in families
        ],
        min_tasks=tasks[0],
        max_tasks=tasks[1],
        scored_by=scored_by,
        test_parser=test_parser,
    )


def task_suites() -> list[api.TaskSuite]:
    """Every suite this service knows, by name."""
    suites = [
        _suite(
            swe_suite.SUITE_NAME,
            swe_suite.SUITE_DESCRIPTION,
            (
                (name, difficulty, swe_suite.FAMILY_DESCRIPTIONS[name])
                for name, (difficulty, _) in swe_suite.FAMILIES.items()
            ),
            (swe_suite.MIN_TASKS, swe_suite.MAX_TASKS),
            "ScoreTests",
            test_parser="pytest",
        ),
        _suite(
            claw_suite.SUITE_NAME,
            claw_suite.SUITE_DESCRIPTION,
            (
                (name, difficulty, claw_suite.FAMILY_DESCRIPTIONS[name])
                for name, (difficulty, _) in claw_suite.FAMILIES.items()
            ),
            (claw_suite.MIN_TASKS, claw_suite.MAX_TASKS),
            "ScoreTask",
        ),
        _suite(
            gui_suite.SUITE_NAME,
            gui_suite.SUITE_DESCRIPTION,
            (
                (name, family.difficulty, family.description)
                for name, family in gui_suite.FAMILIES.items()
            ),
            (gui_suite.MIN_TASKS, gui_suite.MAX_TASKS),
            "JudgeOutcome",
        ),
    ]
    return sorted(suites, key=lambda suite: suite.name)
