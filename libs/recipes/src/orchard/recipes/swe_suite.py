"""The built-in software-engineering suite, from orchard-tasks (`orchard.tasks.swe_suite`),
where orchard-reward also reads it to list the suite (ListTaskSuites)."""

from orchard.tasks.swe_suite import (
    FAMILIES,
    FAMILY_COMMANDS,
    FAMILY_DESCRIPTIONS,
    MAX_TASKS,
    MIN_TASKS,
    SOLVE_RATE,
    SUITE_DESCRIPTION,
    SUITE_NAME,
    Edit,
    FamilyCommands,
    Split,
    SuiteTask,
    generate_suite,
    split_suite,
    teacher_script,
)

__all__ = [
    "FAMILIES",
    "FAMILY_COMMANDS",
    "FAMILY_DESCRIPTIONS",
    "MAX_TASKS",
    "MIN_TASKS",
    "SOLVE_RATE",
    "SUITE_DESCRIPTION",
    "SUITE_NAME",
    "Edit",
    "FamilyCommands",
    "Split",
    "SuiteTask",
    "generate_suite",
    "split_suite",
    "teacher_script",
]
