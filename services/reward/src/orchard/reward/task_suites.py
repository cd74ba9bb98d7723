"""The task suites orchard-reward knows and scores, as ListTaskSuites lists them.

Each is a suite generated in code from a (count, seed) pair in orchard-tasks: the SWE suite's
tasks are instances this service scores with ScoreTests, the Claw suite's are personal-assistant
tasks it scores with ScoreTask (their checks regenerated from the task id). The facts come from
the generators themselves, so a client checks a suite's settings without importing them.
"""

from __future__ import annotations

from orchard.reward.v1 import reward_service_pb2 as api
from orchard.tasks import swe_suite
from orchard.tasks.claw import suite as claw_suite

__all__ = ["task_suites"]


def _builtin_swe() -> api.TaskSuite:
    return api.TaskSuite(
        name=swe_suite.SUITE_NAME,
        description=swe_suite.SUITE_DESCRIPTION,
        families=[
            api.TaskFamily(
                name=name,
                difficulty=difficulty,
                description=swe_suite.FAMILY_DESCRIPTIONS[name],
            )
            for name, (difficulty, _) in swe_suite.FAMILIES.items()
        ],
        min_tasks=swe_suite.MIN_TASKS,
        max_tasks=swe_suite.MAX_TASKS,
        scored_by="ScoreTests",
        test_parser="pytest",
    )


def _builtin_claw() -> api.TaskSuite:
    return api.TaskSuite(
        name=claw_suite.SUITE_NAME,
        description=claw_suite.SUITE_DESCRIPTION,
        families=[
            api.TaskFamily(
                name=name,
                difficulty=difficulty,
                description=claw_suite.FAMILY_DESCRIPTIONS[name],
            )
            for name, (difficulty, _) in claw_suite.FAMILIES.items()
        ],
        min_tasks=claw_suite.MIN_TASKS,
        max_tasks=claw_suite.MAX_TASKS,
        scored_by="ScoreTask",
    )


def task_suites() -> list[api.TaskSuite]:
    """Every suite this service knows, by name."""
    return sorted([_builtin_swe(), _builtin_claw()], key=lambda suite: suite.name)
